// Bindings of the backward preprocess and postprocess kernels.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "api.h"
#include "message.h"
#include "common/launch.h"

namespace dash_fa3 {

// Returns (dPsum, lse_log2, dq_accum, dq_semaphore):
//   dPsum, lse_log2: (batch, heads, seqlen_q_rounded) fp32
//   dq_accum:        (batch, heads, seqlen_q_rounded, headdim) fp32, zeroed
//   dq_semaphore:    (batch, heads, seqlen_q_rounded / block_m) int32, zeroed; one per dQ tile
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_preprocess(const at::Tensor& out,
                                                                          const at::Tensor& dout,
                                                                          const at::Tensor& lse,
                                                                          int64_t block_m) {
  const DType dtype = dtype_of(out, "out");
  TORCH_CHECK(dout.scalar_type() == out.scalar_type(), "dash_fa3: dout must have out's dtype");
  TORCH_CHECK(dout.sizes() == out.sizes(), msg("dash_fa3: dout must have out's shape ", out.sizes(), ", got ",
              dout.sizes()));
  const TensorStrides o_stride = bshd_strides(out, "out");
  const TensorStrides do_stride = bshd_strides(dout, "dout");
  const int64_t batch = out.size(0), seqlen_q = out.size(1), heads = out.size(2), hdim = out.size(3);
  TORCH_CHECK(hdim % 8 == 0, msg("dash_fa3: headdim must be a multiple of 8, got ", hdim));
  TORCH_CHECK(block_m >= 1, "dash_fa3: block_m must be >= 1");
  TORCH_CHECK(lse.is_cuda() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({batch, heads, seqlen_q}), msg(
              "dash_fa3: lse must be a contiguous fp32 CUDA tensor of shape (", batch, ", ", heads, ", ", seqlen_q,
              ")"));

  c10::cuda::CUDAGuard guard(out.device());
  const int64_t num_q_tiles = (seqlen_q + block_m - 1) / block_m;
  const int64_t seqlen_q_rounded = num_q_tiles * block_m;
  auto f32 = out.options().dtype(at::kFloat);
  at::Tensor dpsum = at::empty({batch, heads, seqlen_q_rounded}, f32);
  at::Tensor lse_log2 = at::empty({batch, heads, seqlen_q_rounded}, f32);
  at::Tensor dq_accum = at::empty({batch, heads, seqlen_q_rounded, hdim}, f32);
  at::Tensor dq_semaphore = at::empty({batch, heads, num_q_tiles}, out.options().dtype(at::kInt));

  BwdPreprocessParams p{};
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_stride = o_stride;
  p.dout_stride = do_stride;
  p.dpsum = dpsum.data_ptr<float>();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq_semaphore = dq_semaphore.data_ptr<int>();
  p.dq_semaphore_numel = dq_semaphore.numel();
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_q_rounded = static_cast<int>(seqlen_q_rounded);
  p.heads = static_cast<int>(heads);
  p.headdim = static_cast<int>(hdim);
  run_bwd_preprocess(p, dtype, c10::cuda::getCurrentCUDAStream().stream());
  return {dpsum, lse_log2, dq_accum, dq_semaphore};
}

at::Tensor bwd_postprocess(const at::Tensor& dq_accum, int64_t seqlen_q, double softmax_scale,
                           at::ScalarType dtype) {
  TORCH_CHECK(dq_accum.is_cuda() && dq_accum.scalar_type() == at::kFloat && dq_accum.is_contiguous() &&
                  dq_accum.dim() == 4,
              "dash_fa3: dq_accum must be a contiguous fp32 CUDA tensor (batch, heads, seqlen_q_rounded, headdim)");
  const int64_t batch = dq_accum.size(0), heads = dq_accum.size(1), rounded = dq_accum.size(2),
                hdim = dq_accum.size(3);
  TORCH_CHECK(seqlen_q >= 1 && seqlen_q <= rounded, msg("dash_fa3: seqlen_q must be in [1, ", rounded, "], got ",
              seqlen_q));
  TORCH_CHECK(hdim % 8 == 0, msg("dash_fa3: headdim must be a multiple of 8, got ", hdim));

  c10::cuda::CUDAGuard guard(dq_accum.device());
  at::Tensor dq = at::empty({batch, seqlen_q, heads, hdim}, dq_accum.options().dtype(dtype));
  BwdPostprocessParams p{};
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dq_stride = bshd_strides(dq, "dq");
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_q_rounded = static_cast<int>(rounded);
  p.heads = static_cast<int>(heads);
  p.headdim = static_cast<int>(hdim);
  run_bwd_postprocess(p, dtype_of(dq, "dq"), c10::cuda::getCurrentCUDAStream().stream());
  return dq;
}

}  // namespace dash_fa3
