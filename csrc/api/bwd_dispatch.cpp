// The backward's one dispatch function: runtime arguments -> compiled variant
// of the main kernel. The preprocess (bwd_preprocess) and the postprocess
// (bwd_postprocess) are separate ops; the schedule is a runtime input.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <vector>

#include "api.h"
#include "common/constants.h"
#include "message.h"
#include "variant_registry.h"
#include "common/launch.h"
#include "schedules/schedule_metadata.h"
#include "variant_table.h"

#ifndef DASH_FA3_FOR_EACH_BWD_VARIANT
#error "variant_table.h must define DASH_FA3_FOR_EACH_BWD_VARIANT(X) (tools/build_config.py)"
#endif

namespace dash_fa3 {
namespace {

#define DASH_FA3_BWD_ENTRY(HDIM, DTYPE, CAUSAL, NAME) \
  KernelVariant<BwdParams>{HDIM, DType::DTYPE, CAUSAL, NAME, &run_bwd<HDIM, DType::DTYPE, CAUSAL>},
// A vector, not an array: a build may select no variant of this direction.
const std::vector<KernelVariant<BwdParams>> kBwdVariants = {DASH_FA3_FOR_EACH_BWD_VARIANT(DASH_FA3_BWD_ENTRY)};
#undef DASH_FA3_BWD_ENTRY

void check_f32_cuda(const at::Tensor& t, const char* name, at::IntArrayRef sizes, const at::Device& dev) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.sizes() == sizes, msg(
              "dash_fa3: ", name, " must be a contiguous fp32 tensor of shape ", sizes, " on ", dev, ", got ",
              t.scalar_type(), " ", t.sizes()));
}

}  // namespace

std::vector<std::string> built_bwd_variants() { return variant_names(kBwdVariants); }

// Main backward kernel. dq_accum and dq_semaphore come from bwd_preprocess
// (zeroed there) and are updated in place; returns (dk, dv) in q's dtype and
// k's layout. schedule: the flat int32 metadata of dash_fa3.schedule on q's
// device; schedule_header: the same buffer's first 24 entries (or all of it)
// as a CPU int32 tensor, checked against this call before launch.
std::tuple<at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dpsum, const at::Tensor& lse_log2,
                                       at::Tensor& dq_accum, at::Tensor& dq_semaphore, const at::Tensor& schedule,
                                       const at::Tensor& schedule_header, double softmax_scale, bool causal,
                                       bool deterministic) {
  const QkvShape sh = check_qkv(q, k, v);
  const at::Device dev = q.device();
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && dout.device() == dev,
              "dash_fa3: dout must have q's dtype and device");
  const TensorStrides do_stride = bshd_strides(dout, "dout");
  TORCH_CHECK(dout.sizes() == q.sizes(), msg("dash_fa3: dout must have q's shape ", q.sizes(), ", got ", dout.sizes()));
  const auto& chosen = find_variant(kBwdVariants, "backward", sh.hdim, sh.dtype, causal);
  const int64_t batch = sh.batch, seqlen_q = sh.seqlen_q, seqlen_k = sh.seqlen_k, heads = sh.heads,
                heads_kv = sh.heads_kv, hdim = sh.hdim;

  const int64_t block_m = bwd_block_m(static_cast<int>(hdim));
  const int64_t n_q = (seqlen_q + block_m - 1) / block_m;
  const int64_t rounded = n_q * block_m;
  const int64_t block_n = bwd_block_n(static_cast<int>(hdim));
  const int64_t n_kv = (seqlen_k + block_n - 1) / block_n;
  check_f32_cuda(dpsum, "dpsum", {batch, heads, rounded}, dev);
  check_f32_cuda(lse_log2, "lse_log2", {batch, heads, rounded}, dev);
  check_f32_cuda(dq_accum, "dq_accum", {batch, heads, rounded, hdim}, dev);
  TORCH_CHECK(dq_semaphore.is_cuda() && dq_semaphore.device() == dev && dq_semaphore.scalar_type() == at::kInt &&
                  dq_semaphore.is_contiguous() && dq_semaphore.sizes() == at::IntArrayRef({batch, heads, n_q}), msg(
              "dash_fa3: dq_semaphore must be a contiguous int32 tensor of shape (", batch, ", ", heads, ", ", n_q,
              ") (bwd_preprocess with block_m = ", block_m, ")"));
  TORCH_CHECK(schedule.is_cuda() && schedule.device() == dev && schedule.scalar_type() == at::kInt &&
                  schedule.is_contiguous() && schedule.dim() == 1,
              "dash_fa3: schedule must be a 1-D contiguous int32 tensor on q's device");
  TORCH_CHECK(!schedule_header.is_cuda() && schedule_header.scalar_type() == at::kInt &&
                  schedule_header.is_contiguous() && schedule_header.numel() >= schedule::kHeaderLen, msg(
              "dash_fa3: schedule_header must be a contiguous CPU int32 tensor with at least ",
              schedule::kHeaderLen, " entries"));
  const int32_t* hdr = schedule_header.data_ptr<int32_t>();
  const int64_t expected_len = schedule::kHeaderLen + int64_t(hdr[schedule::kHOffsetsLen]) +
                               int64_t(hdr[schedule::kHNumTasks]) * schedule::kNumCols;
  TORCH_CHECK(schedule.numel() == expected_len, msg("dash_fa3: schedule has ", schedule.numel(),
              " entries, its header says ", expected_len));

  c10::cuda::CUDAGuard guard(dev);
  at::Tensor dk = at::empty_like(k, k.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dv = at::empty_like(v, v.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dk_accum, dv_accum, dkv_semaphore;
  const bool gqa = heads != heads_kv;
  if (gqa) {
    dk_accum = at::zeros({batch, heads_kv, seqlen_k, hdim}, q.options().dtype(at::kFloat));
    dv_accum = at::zeros({batch, heads_kv, seqlen_k, hdim}, q.options().dtype(at::kFloat));
    dkv_semaphore = at::zeros({batch, heads_kv, n_kv}, q.options().dtype(at::kInt));
  }

  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.q_stride = sh.q_stride;
  p.k_stride = sh.k_stride;
  p.v_stride = sh.v_stride;
  p.do_stride = do_stride;
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dpsum = dpsum.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq_semaphore = dq_semaphore.data_ptr<int>();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dk_stride = bshd_strides(dk, "dk");
  p.dv_stride = bshd_strides(dv, "dv");
  p.dk_accum = gqa ? dk_accum.data_ptr<float>() : nullptr;
  p.dv_accum = gqa ? dv_accum.data_ptr<float>() : nullptr;
  p.dkv_semaphore = gqa ? dkv_semaphore.data_ptr<int>() : nullptr;
  p.schedule = schedule.data_ptr<int32_t>();
  p.schedule_header_host = hdr;
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.seqlen_q_rounded = static_cast<int>(rounded);
  p.heads = static_cast<int>(heads);
  p.heads_kv = static_cast<int>(heads_kv);
  p.headdim = static_cast<int>(hdim);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softmax_scale_log2 = static_cast<float>(softmax_scale) * kLog2e;
  p.deterministic = deterministic;
  try {
    chosen.launch(p, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  return {dk, dv};
}

}  // namespace dash_fa3
