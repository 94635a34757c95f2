// The backward's one dispatch function: runtime arguments -> compiled variant
// of the main kernel, run between the preprocess and the postprocess in one
// op call; the schedule is a runtime input.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <vector>

#include "api.h"
#include "bwd_workspace.h"
#include "common/constants.h"
#include "message.h"
#include "variant_registry.h"
#include "common/launch.h"
#include "common/seqlen_info.h"
#include "schedules/schedule_metadata.h"
#include "variant_table.h"

#ifndef DASH_FA3_FOR_EACH_BWD_KERNEL
#error "variant_table.h must define DASH_FA3_FOR_EACH_BWD_KERNEL(X) (tools/build_config.py)"
#endif

namespace dash_fa3 {
namespace {

#define DASH_FA3_BWD_ENTRY(HDIM, HDIM_V, DTYPE, MASK, PACKED, SOFTCAP, NAME)                        \
  KernelVariant<BwdParams>{HDIM, HDIM_V, DType::DTYPE, MaskKind::MASK, PACKED, SOFTCAP, NAME,                \
                           &run_bwd<HDIM, HDIM_V, DType::DTYPE, MaskKind::MASK, PACKED, SOFTCAP>},
// A vector, not an array: a build may select no variant of a direction.
const std::vector<KernelVariant<BwdParams>> kBwdKernels = {DASH_FA3_FOR_EACH_BWD_KERNEL(DASH_FA3_BWD_ENTRY)};
#undef DASH_FA3_BWD_ENTRY

}  // namespace

std::vector<std::string> built_bwd_variants(bool packed, bool softcap) {
  return variant_names(kBwdKernels, packed, softcap);
}

namespace {

// The whole backward in one call: preprocess, main kernel, postprocess, with
// one workspace allocation. schedule: the flat int32 metadata of
// dash_fa3.schedule on q's device; schedule_header: the same buffer's first
// entries (or all of it) as a CPU int32 tensor, checked against this call
// before launch. The window (left, right; -1 unbounded) picks the mask kind
// (mask_kind_of: full, causal or local). Packed calls pass (1, total, heads,
// d) views and lse as (1, heads, total_q). Returns (dq, dk, dv) in q's dtype, or
// with dkv_fp32 dK and dV in fp32: each KV head's group sum of the per-head fp32
// slabs (MHA too), not rounded, so that context parallelism can add such
// partials of several calls before the one rounding (distributed/superblocks.py).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_dispatch(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const at::Tensor& schedule, const at::Tensor& schedule_header,
    double softmax_scale, int64_t window_left, int64_t window_right, double softcap, bool deterministic,
    const PackedDocs* packed, bool dkv_fp32 = false) {
  const at::Tensor q = kernel_view(q_in), k = kernel_view(k_in), v = kernel_view(v_in);
  const at::Tensor dout = kernel_view(dout_in), out = kernel_view(out_in);
  const QkvShape sh = check_qkv(q, k, v);
  const at::Device dev = q.device();
  TORCH_CHECK(dout.device() == dev && out.device() == dev, "dash_fa3: dout and out must be on q's device");
  TORCH_CHECK(out.dim() == 4 && out.size(0) == sh.batch && out.size(1) == sh.seqlen_q && out.size(2) == sh.heads &&
                  out.size(3) == sh.hdim_v,
              msg("dash_fa3: out must be (", sh.batch, ", ", sh.seqlen_q, ", ", sh.heads, ", ", sh.hdim_v,
                  ") (q's batch, seqlen and heads, v's head dim), got ", out.sizes()));
  check_preprocess_inputs(out, dout, lse);
  TORCH_CHECK(window_left >= -1 && window_right >= -1 && window_left < (int64_t(1) << 30) &&
                  window_right < (int64_t(1) << 30),
              msg("dash_fa3: window (", window_left, ", ", window_right, ") entries must be in [-1, 2^30) "
                  "(-1: unbounded)"));
  const MaskKind mask = mask_kind_of(static_cast<int>(window_left), static_cast<int>(window_right));
  check_softcap(softcap);
  const auto& chosen =
      find_variant(kBwdKernels, "backward", sh.hdim, sh.hdim_v, sh.dtype, mask, packed != nullptr, softcap > 0);
  const int64_t seqlen_q = sh.seqlen_q, seqlen_k = sh.seqlen_k, heads = sh.heads, heads_kv = sh.heads_kv,
                hdim = sh.hdim, hdim_v = sh.hdim_v;
  const int64_t block_m = bwd_block_m(static_cast<int>(hdim));
  // Dense: (batch, heads, seqlen_q rounded up to block_m) statistics rows;
  // packed: (heads, padded total) (common/seqlen_info.h).
  int64_t docs = sh.batch, rounded = (seqlen_q + block_m - 1) / block_m * block_m;
  if (packed) {
    docs = check_packed_docs(*packed, seqlen_q, seqlen_k, dev);
    rounded = packed_padded_offset(seqlen_q, static_cast<int>(docs), static_cast<int>(block_m));
  }

  TORCH_CHECK(schedule.is_cuda() && schedule.device() == dev && schedule.scalar_type() == at::kInt &&
                  schedule.is_contiguous() && schedule.dim() == 1,
              "dash_fa3: schedule must be a 1-D contiguous int32 tensor on q's device");
  TORCH_CHECK(!schedule_header.is_cuda() && schedule_header.scalar_type() == at::kInt &&
                  schedule_header.is_contiguous() && schedule_header.numel() >= schedule::kHeaderLen, msg(
              "dash_fa3: schedule_header must be a contiguous CPU int32 tensor with at least ",
              schedule::kHeaderLen, " entries"));
  const int32_t* hdr = schedule_header.data_ptr<int32_t>();
  const int64_t expected_len = schedule::buffer_len(hdr);
  TORCH_CHECK(schedule.numel() == expected_len, msg("dash_fa3: schedule has ", schedule.numel(),
              " entries, its header says ", expected_len));

  c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool gqa = heads != heads_kv;
  // Non-deterministic GQA with at least twice as many keys as queries adds a group's dK/dV
  // into one accumulator per KV head: its tasks are short, and a slab per query head would
  // move `group` times the bytes. With longer tasks the slabs' plain stores are faster than
  // adds into a shared accumulator (docs/journal/results.md, GQA dK/dV without ordered adds).
  // A schedule whose rows chain a group's heads (header dkv_chained) adds each chain's sum once:
  // into the accumulator, never a slab (which would leave the chain's other heads' slabs unwritten).
  // Where every chain is its whole group, or every row is (grouped schedules), (kDkvChainedWhole)
  // the chain's last row stores dK/dV in 16 bits as an MHA task does: no partials at all.
  const bool chained = hdr[schedule::kHDkvChained] == schedule::kDkvChainedAdd;
  const bool whole_groups = gqa && hdr[schedule::kHDkvChained] == schedule::kDkvChainedWhole;
  const bool dkv_accumulate = gqa && !deterministic && !whole_groups && (2 * seqlen_q <= seqlen_k || chained);
  TORCH_CHECK(!dkv_fp32 || (deterministic && packed == nullptr),
              "dash_fa3: fp32 dK/dV partials come from dense deterministic calls only");
  TORCH_CHECK(!(dkv_fp32 && whole_groups),
              "dash_fa3: the schedule's whole-group rows (groups, grouped_*) store 16-bit dK/dV; fp32 dK/dV "
              "partials need another schedule");
  // The main kernel writes fp32 slabs whenever it has them (BwdParams::dk_partial), MHA included.
  const bool slabs = (gqa && !whole_groups) || dkv_fp32;
  // Deterministic dense GQA whose schedule orders the turns: one accumulator per KV head that
  // the group's query heads add into in ascending order (the slabs' bits, 1/group of their bytes).
  const bool dkv_ordered = gqa && deterministic && packed == nullptr && hdr[schedule::kHDkvOrdered] == 1;
  const int64_t n_kv = (seqlen_k + bwd_block_n(static_cast<int>(hdim)) - 1) / bwd_block_n(static_cast<int>(hdim));
  const int64_t dq_splits = hdr[schedule::kHNumSplits];
  TORCH_CHECK(dq_splits >= 1 && (dq_splits == 1 || packed == nullptr),
              msg("dash_fa3: schedule has ", dq_splits, " dQ splits (dense calls only, at least 1)"));
  const BwdWorkspace ws = make_bwd_workspace(
      {sh.batch, heads, rounded, seqlen_k, hdim, hdim_v, rounded / block_m, slabs, dq_splits,
       dkv_accumulate || dkv_ordered ? heads_kv : heads, dkv_ordered, dkv_ordered ? sh.batch * heads_kv * n_kv : 0,
       deterministic},
      dev);
  launch_bwd_preprocess(out, dout, lse, ws, rounded, stream, packed, block_m);

  const auto kv_options = [&](const at::Tensor& t) {
    auto o = t.options().memory_format(at::MemoryFormat::Contiguous);
    return dkv_fp32 ? o.dtype(at::kFloat) : o;
  };
  at::Tensor dk = at::empty_like(k, kv_options(k));
  at::Tensor dv = at::empty_like(v, kv_options(v));
  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.q_stride = sh.q_stride;
  p.k_stride = sh.k_stride;
  p.v_stride = sh.v_stride;
  p.do_stride = bshd_strides(dout, "dout");
  p.lse_log2 = ws.lse_log2;
  p.dpsum = ws.dpsum;
  p.dq_accum = ws.dq_accum;
  p.dq_semaphore = ws.dq_semaphore;
  p.dq_split_floats = ws.dq_split_floats;
  p.dq_split_sems = ws.dq_split_sems;
  p.task_counter = ws.task_counter;
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dk_stride = bshd_strides(dk, "dk");
  p.dv_stride = bshd_strides(dv, "dv");
  p.dk_partial = ws.dk_partial;
  p.dv_partial = ws.dv_partial;
  p.dkv_accumulate = dkv_accumulate;
  p.dkv_ordered = dkv_ordered;
  p.dkv_semaphore = ws.dkv_semaphore;
  p.schedule = schedule.data_ptr<int32_t>();
  p.schedule_header_host = hdr;
  p.batch = static_cast<int>(docs);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  if (packed) {
    p.cu_seqlens_q = packed->cu_seqlens_q.data_ptr<int>();
    p.cu_seqlens_k = packed->cu_seqlens_k.data_ptr<int>();
    p.total_q = static_cast<int>(seqlen_q);
    p.total_k = static_cast<int>(seqlen_k);
    p.seqlen_q = static_cast<int>(packed->max_seqlen_q);
    p.seqlen_k = static_cast<int>(packed->max_seqlen_k);
  }
  p.seqlen_q_rounded = static_cast<int>(rounded);
  p.heads = static_cast<int>(heads);
  p.heads_kv = static_cast<int>(heads_kv);
  p.headdim = static_cast<int>(hdim);
  p.headdim_v = static_cast<int>(hdim_v);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softcap = static_cast<float>(softcap);
  p.window_left = static_cast<int>(window_left);
  p.window_right = static_cast<int>(window_right);
  p.deterministic = deterministic;
  try {
    chosen.launch(p, stream);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  const DkvCast dkv{ws.dk_partial, ws.dv_partial, dkv_accumulate || dkv_ordered, dk, dv, dkv_fp32};
  at::Tensor dq = launch_bwd_postprocess(ws.dq_accum, sh.batch, heads, seqlen_q, rounded, hdim, softmax_scale,
                                         q.scalar_type(), dev, stream, slabs ? &dkv : nullptr, packed,
                                         dq_splits, ws.dq_split_floats, deterministic ? ws.dq_semaphore : nullptr,
                                         ws.dq_split_sems);
  return {dq, dk, dv};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                   const at::Tensor& schedule, const at::Tensor& schedule_header,
                                                   double softmax_scale, int64_t window_left, int64_t window_right,
                                                   double softcap, bool deterministic) {
  return bwd_dispatch(dout, q, k, v, out, lse, schedule, schedule_header, softmax_scale, window_left, window_right,
                      softcap, deterministic, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_dkv_fp32(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            const at::Tensor& schedule,
                                                            const at::Tensor& schedule_header, double softmax_scale,
                                                            int64_t window_left, int64_t window_right) {
  return bwd_dispatch(dout, q, k, v, out, lse, schedule, schedule_header, softmax_scale, window_left, window_right,
                      0.0, true, nullptr, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_varlen(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const at::Tensor& schedule, const at::Tensor& schedule_header, double softmax_scale,
    int64_t window_left, int64_t window_right, double softcap, bool deterministic) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && dout.dim() == 3 && out.dim() == 3 && lse.dim() == 2,
              "dash_fa3: packed dout, q, out must be (total_q, heads, d), k, v (total_k, heads_kv, d), lse "
              "(heads, total_q)");
  const PackedDocs packed{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  auto [dq, dk, dv] = bwd_dispatch(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                   out.unsqueeze(0), lse.unsqueeze(0), schedule, schedule_header, softmax_scale,
                                   window_left, window_right, softcap, deterministic, &packed);
  return {dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)};
}

}  // namespace dash_fa3
