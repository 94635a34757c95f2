// The backward's scratch memory, one allocation per call:
//
//   dpsum | lse_log2 | dk_partial | dv_partial | dq_accum | dq_semaphore | task_counter
//                                              '------ zeroed by the preprocess ------'
//
// One allocation instead of six keeps the caching allocator off the host
// path, and the buffers the main kernel only adds into form one contiguous
// span, so the preprocess zeroes them in its own launch. GQA's per-head dK/dV
// partials are written in full by the main kernel (no zeroing) and are empty
// (size 0) without GQA; non-deterministic GQA has one dK/dV accumulator per KV
// head instead, which the main kernel adds into, so the zeroed span starts at
// dk_partial then. Deterministic calls store each dQ tile's first partial
// instead of adding it, so their span starts at dq_semaphore (dq_stored).
// dq_accum and dq_semaphore hold one accumulator and
// semaphore set per dQ split of the schedule (one but for the split
// schedule), back to back.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dash_fa3 {

struct BwdWorkspace {
  at::Tensor buffer;  // uint8, owns every region below
  float* dpsum;
  float* lse_log2;
  float* dk_partial;  // nullptr without GQA
  float* dv_partial;  // nullptr without GQA
  float* dq_accum;
  int* dq_semaphore;
  int* dkv_semaphore;  // BwdWorkspaceShape::dkv_sems turn counters, or nullptr
  int* task_counter;  // dynamic dispatch's claim counter (one int)
  void* zero_begin;
  int64_t zero_bytes;  // a multiple of 16

  // Byte offsets of the regions, for callers that want tensor views.
  int64_t dpsum_offset, lse_log2_offset, dq_accum_offset, dq_semaphore_offset;
  // One dQ split's accumulator (floats) and semaphores (ints); split s starts s of them on.
  int64_t dq_split_floats, dq_split_sems;
};

struct BwdWorkspaceShape {
  int64_t batch, heads, seqlen_q_rounded, seqlen_k, headdim, headdim_v, n_q;
  bool gqa;
  int64_t dq_splits = 1;  // fp32 dQ accumulators (and semaphore sets), the schedule's num_splits
  // GQA: dK/dV partial slabs per batch: heads (one per query head, written whole), or heads_kv
  // (one accumulator per KV head, added into: then zeroed with the rest, unless ordered). 0: heads.
  int64_t dkv_slabs = 0;
  // Deterministic GQA in turns (BwdParams::dkv_ordered): the accumulators are stored before
  // they are added into (not zeroed), and dkv_sems turn counters (batch * heads_kv * n_kv) are.
  bool dkv_ordered = false;
  int64_t dkv_sems = 0;
  // Deterministic: each dQ tile's first add (rank 0) stores (bwd_dq_writer.h), so dq_accum is
  // not zeroed; the zeroed span starts at dq_semaphore.
  bool dq_stored = false;
};

BwdWorkspace make_bwd_workspace(const BwdWorkspaceShape& s, const at::Device& device);

}  // namespace dash_fa3
