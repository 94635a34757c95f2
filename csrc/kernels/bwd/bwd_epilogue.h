// Epilogue role of the backward kernel, run by both MMA warpgroups at the end
// of each task: dK = softmax_scale * (sum over steps of dS^T Q) and dV.
//
// MHA (heads == heads_kv): each (batch, head, KV tile) has exactly one task,
// so dK and dV go straight from registers to global memory in the input type
// (each thread stores pairs of adjacent elements; rows past seqlen_k are not
// written).
//
// GQA/MQA: the q heads of a group all add into the same dK/dV rows, so the
// task adds its fp32 registers into fp32 accumulators (batch, heads_kv,
// seqlen_k, d) with red.add; the postprocess casts them afterwards. In
// deterministic mode the q heads of a group take turns in the schedule's fixed
// order (task column rank_dkv), through one semaphore per (batch, head_kv, KV
// tile); the ordering argument is the one of bwd_semaphore.h, with every add
// in the generic proxy.
#pragma once

#include <cute/tensor.hpp>

#include "common/gemm_sm90.h"
#include "common/named_barriers.h"
#include "kernels/bwd/bwd_mainloop.h"
#include "kernels/bwd/bwd_semaphore.h"
#include "kernels/bwd/bwd_traits.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

template <class Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  using FragDkv = typename BwdMainloop<Traits>::FragDkv;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kMmaThreads = Traits::kNumMmaThreads;

  CUTE_DEVICE static void store(Params const& p, FragDkv& tdKrdK, FragDkv& tdVrdV, int32_t const* row,
                                int mma_tid) {
    typename Traits::TiledMmaDkv mma_dkv;
    auto thr = mma_dkv.get_thread_slice(mma_tid);
    Tensor tDcD = thr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= p.softmax_scale; }

    int const b = row[schedule::kCBatch];
    int const h_kv = row[schedule::kCHeadKv];
    int const kv = row[schedule::kCKvTile];
    int const n0 = kv * kBlockN;
    constexpr int kV = decltype(size<0, 2>(tdKrdK))::value;

    if (p.dk_accum == nullptr) {
      Tensor tdKout = make_tensor<Element>(typename FragDkv::layout_type{});
      Tensor tdVout = make_tensor<Element>(typename FragDkv::layout_type{});
      convert_fragment(tdKrdK, tdKout);
      convert_fragment(tdVrdV, tdVout);
      Element* dk = static_cast<Element*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride;
      Element* dv = static_cast<Element*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        int const n = n0 + get<0>(tDcD(2 * r));
        if (n < p.seqlen_k) {
          CUTE_UNROLL
          for (int v = 0; v < kV; ++v) {
            int const i = 4 * v + 2 * r;  // registers i, i + 1: columns d, d + 1 of row n
            int const d = get<1>(tDcD(i));
            *reinterpret_cast<uint32_t*>(dk + n * p.dk_row_stride + d) =
                *reinterpret_cast<uint32_t const*>(&tdKout(i));
            *reinterpret_cast<uint32_t*>(dv + n * p.dv_row_stride + d) =
                *reinterpret_cast<uint32_t const*>(&tdVout(i));
          }
        }
      }
      return;
    }

    int* sem = p.dkv_semaphore + (int64_t(b) * p.heads_kv + h_kv) * p.n_kv + kv;
    if (p.deterministic) {
      if (mma_tid == 0) { semaphore_wait_for(sem, row[schedule::kCRankDkv]); }
      // Everyone waits until thread 0 has seen our turn come up.
      named_barrier_sync(BwdBarrier::kDkvTurn, kMmaThreads);
    }
    int64_t const base = (int64_t(b) * p.heads_kv + h_kv) * p.seqlen_k;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int const n = n0 + get<0>(tDcD(2 * r));
      if (n < p.seqlen_k) {
        float* dk_row = p.dk_accum + (base + n) * kHeadDim;
        float* dv_row = p.dv_accum + (base + n) * kHeadDim;
        CUTE_UNROLL
        for (int v = 0; v < kV; ++v) {
          CUTE_UNROLL
          for (int c = 0; c < 2; ++c) {
            int const i = 4 * v + 2 * r + c;
            int const d = get<1>(tDcD(i));
            atomicAdd(dk_row + d, tdKrdK(i));
            atomicAdd(dv_row + d, tdVrdV(i));
          }
        }
      }
    }
    if (p.deterministic) {
      __threadfence();  // our adds are performed at gpu scope before the barrier
      // Everyone waits until all 256 threads have added; then thread 0 passes the turn on.
      named_barrier_sync(BwdBarrier::kDkvTurn, kMmaThreads);
      if (mma_tid == 0) { semaphore_release_increment(sem); }
    }
  }
};

}  // namespace dash_fa3::bwd
