// Epilogue role of the backward kernel, run by both MMA warpgroups at the end
// of each task: dK = softmax_scale * (sum over steps of dS^T Q) and dV.
//
// MHA (heads == heads_kv): each (batch, head, KV tile) has exactly one task,
// so dK and dV go straight from registers to global memory in the input type
// (each thread stores pairs of adjacent elements; rows past seqlen_k are not
// written).
//
// GQA/MQA: the q heads of a group all contribute to the same dK/dV rows. Each
// task stores its fp32 registers into its own query head's slab of the
// partials (batch, heads, seqlen_k, d); the postprocess sums each group's
// slabs in ascending head order and casts. The sum's order is fixed, so dK/dV
// are deterministic in both modes, and no task waits for another here (adds
// into one shared accumulator would need atomics, and ordered adds would make
// the heads of a group take turns).
#pragma once

#include <cute/tensor.hpp>

#include "common/gemm_sm90.h"
#include "kernels/bwd/bwd_mainloop.h"
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

    if (p.dk_partial == nullptr) {
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

    // GQA: this query head's slab; every (batch, head, KV tile) has exactly one
    // task, so plain stores suffice: no zeroing, no atomics, no turn-taking.
    int const h = row[schedule::kCHead];
    int64_t const base = (int64_t(b) * p.heads + h) * p.seqlen_k;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int const n = n0 + get<0>(tDcD(2 * r));
      if (n < p.seqlen_k) {
        float* dk_row = p.dk_partial + (base + n) * kHeadDim;
        float* dv_row = p.dv_partial + (base + n) * kHeadDim;
        CUTE_UNROLL
        for (int v = 0; v < kV; ++v) {
          int const i = 4 * v + 2 * r;  // registers i, i + 1: columns d, d + 1 of row n
          int const d = get<1>(tDcD(i));
          *reinterpret_cast<float2*>(dk_row + d) = make_float2(tdKrdK(i), tdKrdK(i + 1));
          *reinterpret_cast<float2*>(dv_row + d) = make_float2(tdVrdV(i), tdVrdV(i + 1));
        }
      }
    }
  }
};

}  // namespace dash_fa3::bwd
