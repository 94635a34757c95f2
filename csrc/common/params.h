// Kernel parameter structs: the contract between the torch binding (csrc/api)
// and the kernels. Plain data, host and device visible, no torch types.
#pragma once

#include <cstdint>

// Measurement build, never the default (tools/build_config.py
// MEASUREMENT_KNOBS): the backward records timestamps (kernels/bwd/bwd_trace.h).
#ifndef DASH_FA3_BWD_TRACE
#define DASH_FA3_BWD_TRACE 0
#endif

namespace dash_fa3 {

// Element type of Q, K, V, O, dO, dQ, dK, dV. The kernels map it to a CUTLASS
// type (common/variant.h); the binding maps it from a torch dtype.
enum class DType : int { kBF16 = 0, kFP16 = 1 };

// The mask kind: which kernel family runs a call (dash_fa3/variants.py MASKS).
// full and causal have fixed windows, (-1, -1) and (-1, 0); local takes the
// window (window_left, window_right) of the parameters at run time (any
// bottom-right aligned window, -1 = unbounded; common/block_range.h). The
// values are the schedule header's mask codes (dash_fa3/schedule/contract.py).
enum class MaskKind : int { kFull = 0, kCausal = 1, kLocal = 2 };

// The kind that runs window (left, right): full for (-1, -1), causal for
// (-1, 0), local otherwise (dash_fa3.variants.mask_of_window).
inline MaskKind mask_kind_of(int window_left, int window_right) {
  if (window_left < 0 && window_right < 0) { return MaskKind::kFull; }
  if (window_left < 0 && window_right == 0) { return MaskKind::kCausal; }
  return MaskKind::kLocal;
}

inline const char* mask_kind_name(MaskKind mask) {
  return mask == MaskKind::kFull ? "full" : mask == MaskKind::kCausal ? "causal" : "local";
}

// Strides are in elements. Tensors use FA3's (batch, seqlen, heads, headdim)
// layout with a contiguous last dim; the other strides are arbitrary.
struct TensorStrides {
  int64_t batch;
  int64_t row;   // seqlen
  int64_t head;
};

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // (batch, heads, seqlen_q), contiguous, natural log

  TensorStrides q_stride, k_stride, v_stride, o_stride;

  int batch;
  int seqlen_q;
  int seqlen_k;
  int heads;     // query heads
  int heads_kv;  // heads % heads_kv == 0 (GQA/MQA)
  int headdim;    // q, k
  int headdim_v;  // v, o (MLA: narrower than headdim)

  float softmax_scale;  // applied to QK^T (the launcher derives the kernels' exp2 scales)
  // > 0: scores softcap * tanh(softmax_scale * QK^T / softcap) (common/softcap.h),
  // run by the softcap instantiations only; 0: none.
  float softcap;

  // The window, -1 = unbounded (common/block_range.h). Read by the local
  // kernels only; the full and causal kernels have theirs built in.
  int window_left;
  int window_right;

  // Packed documents (common/seqlen_info.h), int32 batch + 1 offsets on the
  // device; nullptr for a dense batch. Packed: batch counts documents,
  // seqlen_q / seqlen_k are the longest document's (FA3's max_seqlen), q, k,
  // v, o hold total_q / total_k rows as batch 0 (batch strides unread) and
  // lse is (heads, total_q).
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q;
  int total_k;

  int num_sms;  // persistent grid size, read off the device by the caller
  // Packed documents: an int32 buffer of packed_order_ints(batch) entries
  // that run_fwd fills with the order of the documents' work before the
  // main kernel reads it (common/packed_order.h); nullptr for a dense batch.
  int* packed_order;
  // Dense causal masks: one int32 on the device, the counter from which CTAs
  // take query tiles (kernels/fwd/fwd_tile_scheduler.h); run_fwd zeroes it
  // before the kernel. nullptr for every other mask and for packed documents.
  int* tile_counter;
};

// The packed forward's order kernel (kernels/fwd/fwd_packed_order.cu): writes
// `order` (common/packed_order.h) for `batch` documents of `heads` heads in
// tiles of block_m queries and block_n keys.
struct FwdPackedOrderParams {
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int batch;
  int heads;
  int block_m;
  int block_n;
  bool causal_pairs;  // the causal kernels' units are pairs of query tiles
  int* order;
};

// Backward preprocess: dPsum = rowsum(dO * O) in fp32, LSE in the log2 domain,
// and every buffer the main kernel only adds into (dQ accumulator, GQA dK/dV
// accumulators, semaphores) zeroed. Those buffers are laid out as one
// contiguous span of the backward workspace (csrc/api/bwd_workspace.h), so
// zeroing them costs no launch of its own.
struct BwdPreprocessParams {
  const void* o;
  const void* dout;
  const float* lse;  // (batch, heads, seqlen_q), natural log
  TensorStrides o_stride, dout_stride;

  float* dpsum;     // (batch, heads, seqlen_q_rounded)
  float* lse_log2;  // (batch, heads, seqlen_q_rounded); padding rows hold +inf (P = 0 there)
  void* zero_begin;     // 16-byte aligned
  int64_t zero_vec16;   // bytes to zero from zero_begin, in 16-byte units

  int batch;
  int seqlen_q;
  int seqlen_q_rounded;
  int heads;
  int headdim;  // of out and dout (V's head dim)

  // Packed documents (common/seqlen_info.h), nullptr for a dense batch. Then
  // batch counts documents, seqlen_q is total_q, out/dout hold it as batch 0,
  // lse is (heads, total_q), and the outputs are (heads, seqlen_q_rounded),
  // the padded total for tiles of block_m rows.
  const int* cu_seqlens_q;
  int block_m;
};

// Backward postprocess: dQ = softmax_scale * dQaccum, cast to the input dtype;
// with GQA also dK, dV summed from their per-head fp32 partials and cast (one
// launch for both).
struct BwdPostprocessParams {
  // (batch, heads, seqlen_q_rounded, headdim), 16-byte aligned; rows
  // [q block_m, (q + 1) block_m) of a (batch, head) hold Q tile q in the main
  // kernel's fragment order (common/dq_accum_layout.h).
  const float* dq_accum;
  // dQ splits (BwdParams): num_dq_splits accumulators dq_split_floats apart,
  // summed in ascending order (a fixed order: the same bits in every run).
  int num_dq_splits;
  int64_t dq_split_floats;
  // Deterministic calls: the main kernel's dQ semaphores (one set per split,
  // dq_split_sems apart, an int per block_m-row tile from the slab's first row,
  // as BwdParams::dq_semaphore). A tile's first add (rank 0) STORES its partial,
  // so the accumulators are not zeroed, and a tile whose counter reads 0 got no
  // add and holds no sum: it counts as 0. nullptr: every accumulator is read
  // (non-deterministic calls, zeroed first).
  const int* dq_semaphore;
  int64_t dq_split_sems;
  int block_m;            // bwd_block_m(headdim): the tiles' rows
  void* dq;               // (batch, seqlen_q, heads, headdim), FA3 layout
  TensorStrides dq_stride;
  float softmax_scale;

  // GQA only, else nullptr: (batch, heads, seqlen_k, headdim) fp32 partials,
  // one slab per query head, already scaled; the heads / heads_kv slabs of a
  // group are summed in ascending head order (the same order whatever the
  // mode: dK/dV are deterministic) and cast into dk/dv (batch, seqlen_k,
  // heads_kv, headdim).
  const float* dk_partial;
  const float* dv_partial;
  int dkv_partial_group;  // slabs per KV head: heads / heads_kv, or 1 (BwdParams::dkv_accumulate)
  bool dkv_fp32;          // dk, dv are fp32 (the sums as they are), else the input dtype
  void* dk;
  void* dv;
  TensorStrides dk_stride, dv_stride;
  int heads_kv;
  int seqlen_k;

  int batch;
  int seqlen_q;
  int seqlen_q_rounded;
  int heads;
  int headdim;    // dq, dk_partial, dk
  int headdim_v;  // dv_partial, dv

  // Packed documents, as in BwdPreprocessParams: dq_accum is (heads,
  // seqlen_q_rounded, headdim) in the padded layout, dq holds total_q =
  // seqlen_q rows as batch 0, and the GQA partials (heads, seqlen_k, headdim)
  // with seqlen_k = total_k (batch 1).
  const int* cu_seqlens_q;
};

}  // namespace dash_fa3

namespace dash_fa3 {

// Backward main kernel (csrc/kernels/bwd/). Runs between the preprocess and
// the postprocess; the schedule (dash_fa3.schedule) is a runtime input.
struct BwdParams {
  const void* q;     // (batch, seqlen_q, heads, headdim)
  const void* k;     // (batch, seqlen_k, heads_kv, headdim)
  const void* v;     // (batch, seqlen_k, heads_kv, headdim_v)
  const void* dout;  // (batch, seqlen_q, heads, headdim_v)
  TensorStrides q_stride, k_stride, v_stride, do_stride;

  // From the preprocess, all (batch, heads, seqlen_q_rounded[, headdim]):
  const float* lse_log2;
  const float* dpsum;
  float* dq_accum;    // fp32, zeroed, 128-byte aligned; the kernel adds each Q tile into it in
                      // fragment order (common/dq_accum_layout.h)
  int* dq_semaphore;  // (batch, heads, seqlen_q_rounded / block_m), zeroed
  // dQ splits (the schedule's num_splits; dash_fa3/schedule/split.py): split s
  // has its own accumulator and semaphores, s * dq_split_floats floats and
  // s * dq_split_sems ints on; the postprocess sums the splits in order.
  int64_t dq_split_floats;
  int64_t dq_split_sems;
  int* task_counter;  // one int, zeroed: dynamic dispatch's claims (kernels/bwd/bwd_tasks.h)

  // Outputs, (batch, seqlen_k, heads_kv, headdim) in the input dtype.
  void* dk;
  void* dv;
  TensorStrides dk_stride, dv_stride;
  // GQA/MQA only (heads != heads_kv), else nullptr: fp32 (batch, heads,
  // seqlen_k, headdim) partials, one slab per query head, which the kernel
  // writes (no adds, no zeroing needed) and the postprocess sums per group
  // and casts into dk/dv (or one accumulator per KV head: dkv_accumulate, dkv_ordered).
  float* dk_partial;
  float* dv_partial;
  // Non-deterministic GQA: dk_partial/dv_partial are (batch, heads_kv, seqlen_k,
  // headdim) fp32 accumulators, zeroed, that each query head's task adds its
  // tile into (in any order); the postprocess only casts them.
  bool dkv_accumulate;
  // Deterministic dense GQA whose schedule's header says dkv_ordered: the partials are
  // (batch, heads_kv, seqlen_k, headdim) accumulators, not zeroed; at each KV tile the group's
  // query heads take turns in ascending order (dkv_semaphore: (batch, heads_kv, n_kv) turn
  // counters, zeroed): the first stores, the others add. The sum has the slabs' order, so
  // the bits are those of the slab path.
  bool dkv_ordered;
  int* dkv_semaphore;

  // Packed documents (common/seqlen_info.h), as in FwdParams: nullptr for a
  // dense batch. Packed: batch counts documents, seqlen_q / seqlen_k are the
  // longest document's, the tensors hold total_q / total_k rows as batch 0,
  // lse is (heads, total_q), and seqlen_q_rounded is the padded total
  // packed_padded_offset(total_q, batch, block_m).
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q;
  int total_k;

  // The schedule: the flat int32 buffer of dash_fa3.schedule.metadata
  // (header | cta_offsets | tasks) on the device, and its header on the host
  // (the launcher checks it against this call and takes the grid size from it).
  const int32_t* schedule;
  const int32_t* schedule_header_host;

  int batch;
  int seqlen_q;
  int seqlen_k;
  int seqlen_q_rounded;  // multiple of block_m
  int heads;
  int heads_kv;
  int headdim;    // q, k, dq, dk
  int headdim_v;  // v, dout, dv (MLA: narrower than headdim)

  float softmax_scale;
  float softcap;  // as in FwdParams
  // The window, -1 = unbounded, as in FwdParams (local kernels only; the
  // schedule's header must carry the same).
  int window_left;
  int window_right;
  bool deterministic;
#if DASH_FA3_BWD_TRACE
  // kernels/bwd/bwd_trace.h, or nullptr: (num_tasks, kNumTaskFields) and
  // (num_tasks, trace_max_steps, kNumStepFields) int64.
  int64_t* trace_tasks;
  int64_t* trace_steps;
  int trace_max_steps;
#endif
};

}  // namespace dash_fa3
