// The backward's preprocess and postprocess steps, shared by the one backward
// op (bwd_dispatch.cpp) and the ops that expose each step alone for tests and
// benchmarks.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "api.h"
#include "bwd_workspace.h"
#include "message.h"
#include "common/dq_accum_layout.h"
#include "common/launch.h"

namespace dash_fa3 {

void check_preprocess_inputs(const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse) {
  dtype_of(out, "out");
  TORCH_CHECK(dout.scalar_type() == out.scalar_type(), "dash_fa3: dout must have out's dtype");
  TORCH_CHECK(dout.sizes() == out.sizes(), msg("dash_fa3: dout must have out's shape ", out.sizes(), ", got ",
              dout.sizes()));
  const int64_t batch = out.size(0), seqlen_q = out.size(1), heads = out.size(2), hdim = out.size(3);
  TORCH_CHECK(hdim % 8 == 0, msg("dash_fa3: headdim must be a multiple of 8, got ", hdim));
  TORCH_CHECK(lse.is_cuda() && lse.device() == out.device() && lse.scalar_type() == at::kFloat &&
                  lse.is_contiguous() && lse.sizes() == at::IntArrayRef({batch, heads, seqlen_q}), msg(
              "dash_fa3: lse must be a contiguous fp32 tensor of shape (", batch, ", ", heads, ", ", seqlen_q,
              ") on out's device"));
}

void launch_bwd_preprocess(const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                           const BwdWorkspace& ws, int64_t seqlen_q_rounded, cudaStream_t stream,
                           const PackedDocs* docs, int64_t block_m) {
  BwdPreprocessParams p{};
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_stride = bshd_strides(out, "out");
  p.dout_stride = bshd_strides(dout, "dout");
  p.dpsum = ws.dpsum;
  p.lse_log2 = ws.lse_log2;
  p.zero_begin = ws.zero_begin;
  p.zero_vec16 = ws.zero_bytes / 16;
  p.batch = static_cast<int>(out.size(0));
  p.seqlen_q = static_cast<int>(out.size(1));
  p.seqlen_q_rounded = static_cast<int>(seqlen_q_rounded);
  p.heads = static_cast<int>(out.size(2));
  p.headdim = static_cast<int>(out.size(3));
  if (docs != nullptr) {
    p.cu_seqlens_q = docs->cu_seqlens_q.data_ptr<int>();
    p.batch = static_cast<int>(docs->cu_seqlens_q.numel() - 1);
    p.block_m = static_cast<int>(block_m);
  }
  run_bwd_preprocess(p, dtype_of(out, "out"), stream);
}

at::Tensor launch_bwd_postprocess(const float* dq_accum, int64_t batch, int64_t heads, int64_t seqlen_q,
                                  int64_t seqlen_q_rounded, int64_t hdim, double softmax_scale,
                                  at::ScalarType dtype, const at::Device& device, cudaStream_t stream,
                                  const DkvCast* dkv, const PackedDocs* docs, int64_t dq_splits,
                                  int64_t dq_split_floats, const int* dq_semaphore, int64_t dq_split_sems) {
  // The main kernel's Q tiles, whose fragment order the accumulator holds.
  const int block_m = bwd_block_m(static_cast<int>(hdim));
  TORCH_CHECK(dq_frag_layout_ok(block_m, static_cast<int>(hdim)),
              msg("dash_fa3: no dQ accumulator layout for headdim ", hdim, " (bwd_block_m ", block_m, ")"));
  TORCH_CHECK(seqlen_q_rounded % block_m == 0, msg("dash_fa3: dq_accum has ", seqlen_q_rounded,
              " rows per head, not a multiple of the backward's block_m ", block_m, " for headdim ", hdim));
  at::Tensor dq = at::empty({batch, seqlen_q, heads, hdim}, at::TensorOptions().dtype(dtype).device(device));
  BwdPostprocessParams p{};
  p.dq_accum = dq_accum;
  p.num_dq_splits = static_cast<int>(dq_splits);
  p.dq_split_floats = dq_split_floats;
  p.dq_semaphore = dq_semaphore;
  p.dq_split_sems = dq_split_sems;
  p.block_m = block_m;
  p.dq = dq.data_ptr();
  p.dq_stride = bshd_strides(dq, "dq");
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_q_rounded = static_cast<int>(seqlen_q_rounded);
  p.heads = static_cast<int>(heads);
  p.headdim = static_cast<int>(hdim);
  p.headdim_v = static_cast<int>(hdim);
  if (dkv != nullptr) {
    p.dk_partial = dkv->dk_partial;
    p.dv_partial = dkv->dv_partial;
    p.dk = dkv->dk.data_ptr();
    p.dv = dkv->dv.data_ptr();
    p.dk_stride = bshd_strides(dkv->dk, "dk");
    p.dv_stride = bshd_strides(dkv->dv, "dv");
    p.heads_kv = static_cast<int>(dkv->dk.size(2));
    p.dkv_partial_group = dkv->accumulated ? 1 : static_cast<int>(heads / p.heads_kv);
    p.dkv_fp32 = dkv->fp32;
    p.headdim_v = static_cast<int>(dkv->dv.size(3));
    p.seqlen_k = static_cast<int>(dkv->dk.size(1));
  }
  if (docs != nullptr) {
    // Packed: the kernel reads the tensors as batch 0 and batch as the document count.
    p.cu_seqlens_q = docs->cu_seqlens_q.data_ptr<int>();
    p.batch = static_cast<int>(docs->cu_seqlens_q.numel() - 1);
  }
  run_bwd_postprocess(p, dtype_of(dq, "dq"), stream);
  return dq;
}

// Returns (dPsum, lse_log2, dq_accum, dq_semaphore), views of one workspace:
//   dPsum, lse_log2: (batch, heads, seqlen_q_rounded) fp32
//   dq_accum:        (batch, heads, seqlen_q_rounded, headdim) fp32, zeroed (the main
//                    kernel adds each Q tile into it in fragment order)
//   dq_semaphore:    (batch, heads, seqlen_q_rounded / block_m) int32, zeroed; one per dQ tile
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_preprocess(const at::Tensor& out,
                                                                          const at::Tensor& dout,
                                                                          const at::Tensor& lse,
                                                                          int64_t block_m) {
  check_preprocess_inputs(out, dout, lse);
  TORCH_CHECK(block_m >= 1, "dash_fa3: block_m must be >= 1");
  const int64_t batch = out.size(0), seqlen_q = out.size(1), heads = out.size(2), hdim = out.size(3);
  c10::cuda::CUDAGuard guard(out.device());
  const int64_t n_q = (seqlen_q + block_m - 1) / block_m;
  const int64_t rounded = n_q * block_m;
  const BwdWorkspace ws =
      make_bwd_workspace({batch, heads, rounded, 0, hdim, hdim, n_q, false}, out.device());
  launch_bwd_preprocess(out, dout, lse, ws, rounded, c10::cuda::getCurrentCUDAStream().stream());
  auto region = [&](int64_t offset, at::ScalarType type, at::IntArrayRef sizes) {
    int64_t numel = 1;
    for (int64_t n : sizes) numel *= n;
    return ws.buffer.narrow(0, offset, numel * int64_t(at::elementSize(type))).view(type).view(sizes);
  };
  return {region(ws.dpsum_offset, at::kFloat, {batch, heads, rounded}),
          region(ws.lse_log2_offset, at::kFloat, {batch, heads, rounded}),
          region(ws.dq_accum_offset, at::kFloat, {batch, heads, rounded, hdim}),
          region(ws.dq_semaphore_offset, at::kInt, {batch, heads, n_q})};
}

at::Tensor bwd_postprocess(const at::Tensor& dq_accum, int64_t seqlen_q, double softmax_scale,
                           at::ScalarType dtype) {
  TORCH_CHECK(dq_accum.is_cuda() && dq_accum.scalar_type() == at::kFloat && dq_accum.is_contiguous() &&
                  dq_accum.dim() == 4 && reinterpret_cast<uintptr_t>(dq_accum.data_ptr()) % 16 == 0,
              "dash_fa3: dq_accum must be a contiguous, 16-byte aligned fp32 CUDA tensor (batch, heads, "
              "seqlen_q_rounded, headdim)");
  const int64_t batch = dq_accum.size(0), heads = dq_accum.size(1), rounded = dq_accum.size(2),
                hdim = dq_accum.size(3);
  TORCH_CHECK(seqlen_q >= 1 && seqlen_q <= rounded, msg("dash_fa3: seqlen_q must be in [1, ", rounded, "], got ",
              seqlen_q));
  TORCH_CHECK(hdim % 8 == 0, msg("dash_fa3: headdim must be a multiple of 8, got ", hdim));
  c10::cuda::CUDAGuard guard(dq_accum.device());
  return launch_bwd_postprocess(dq_accum.data_ptr<float>(), batch, heads, seqlen_q, rounded, hdim, softmax_scale,
                                dtype, dq_accum.device(), c10::cuda::getCurrentCUDAStream().stream());
}

}  // namespace dash_fa3
