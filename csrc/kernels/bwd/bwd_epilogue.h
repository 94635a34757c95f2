// Epilogue role of the backward kernel, run by both MMA warpgroups at the end
// of each task: dK = softmax_scale * (sum over steps of dS^T Q) and dV.
//
// MHA (heads == heads_kv): each (batch, head, KV tile) has exactly one task.
// So does each (batch, KV head, KV tile) under a schedule of whole-group chains
// (header dkv_chained = kDkvChainedWhole, the groups schedule): the chain's
// last row holds its group's dK/dV and takes this path (no dk_partial).
// store_tma: the task's dK and dV go through shared memory (stmatrix from the
// accumulators) and leave with one TMA store each. They are staged in sdS
// where it holds them (Traits::kDkStagedInDs, kDvStagedInDs: its last reader,
// the task's last dQ GEMM, has retired), else in the sK / sV tile the task no
// longer reads. A K or V buffer is released to the producer (kKEmpty,
// kVEmpty) as soon as the task's GEMMs have retired if its tile is staged in
// sdS, so the next task's load overlaps this epilogue; otherwise once the
// copy engine has read it. (FA3's epilogue reuses its mainloop's shared
// memory, so its next K/V load waits for the store.) Why shared memory: written
// straight from the accumulators (one 4-byte store per register pair, half a
// 32-byte sector per row and warp) the epilogue takes longer than two MMA
// steps of the task, while the tensor cores idle (measured:
// docs/journal/code-comments.md).
// store_direct: tasks without steps (their KV tile sees no query; dK = dV = 0)
// store from registers: their sK/sV may already hold the next task's K/V. So
// do tasks whose KV tile reaches past its packed document's end (a TMA store
// of the whole tile would overwrite the next document's first rows);
// needs_direct_store says which.
//
// GQA/MQA: the q heads of a group all contribute to the same dK/dV rows. Each
// task stores its fp32 registers into its own query head's slab of the
// partials (batch, heads, seqlen_k, d; dV's with dv columns); the postprocess sums each group's
// slabs in ascending head order and casts. The sum's order is fixed, so dK/dV
// are deterministic in both modes, and no task waits for another here. Two
// alternatives write one accumulator per KV head instead: the non-deterministic
// mode's atomic adds (dkv_accumulate), and the deterministic mode's turns
// (dkv_ordered), where the schedule plans a group's heads so that taking turns
// costs no time (store_direct says how).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/gemm_sm90.h"
#include "common/named_barriers.h"
#include "kernels/bwd/bwd_mainloop.h"
#include "kernels/bwd/bwd_semaphore.h"
#include "kernels/bwd/bwd_traits.h"
#include "schedules/schedule_metadata.h"

namespace dash_fa3::bwd {

// Adds two consecutive floats into global memory (a reduction: nothing comes back, so no
// registers wait for a result).
CUTE_DEVICE void red_add_f32x2(float* gmem, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" : : "l"(gmem), "f"(a), "f"(b) : "memory");
}

template <class Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  using FragDk = typename BwdMainloop<Traits>::FragDk;
  using FragDv = typename BwdMainloop<Traits>::FragDv;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static constexpr int kMmaThreads = Traits::kNumMmaThreads;

  using SharedStorage = typename Traits::SharedStorage;

  // MHA, a task with steps: every GEMM of this warpgroup has retired. Releases
  // sK and sV to the producer (kKEmpty, kVEmpty) and returns once sdS may be
  // written again.
  CUTE_DEVICE static void store_tma(Params const& p, SharedStorage& smem, FragDk& tdKrdK, FragDv& tdVrdV,
                                    int32_t const* row, int mma_tid) {
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= p.softmax_scale; }
    Tensor tdKout = make_tensor<Element>(typename FragDk::layout_type{});
    Tensor tdVout = make_tensor<Element>(typename FragDv::layout_type{});
    convert_fragment(tdKrdK, tdKout);
    convert_fragment(tdVrdV, tdVout);

    // The staging tiles, in the K and V tiles' layouts (the TMA stores' source layouts).
    Element* const dk_stage = Traits::kDkStagedInDs ? smem.ds.data() : smem.k.data();
    Element* const dv_stage =
        Traits::kDvStagedInDs ? smem.ds.data() + Traits::kKvTileElements : smem.v.data();
    Tensor sdK = make_tensor(make_smem_ptr(dk_stage), typename Traits::SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(dv_stage), typename Traits::SmemLayoutV{});
    // Wait until the other warpgroup's GEMMs have retired too: its dQ GEMM
    // reads all of sK and of the last step's sdS.
    named_barrier_sync(BwdBarrier::kEpilogue, kMmaThreads);
    // A buffer that holds no staging tile is free now: the next task's load overlaps the rest.
    if constexpr (Traits::kDkStagedInDs) {
      named_barrier_arrive(BwdBarrier::kKEmpty, kMmaThreads + Traits::kWarpThreads);
    }
    if constexpr (Traits::kDvStagedInDs) {
      named_barrier_arrive(BwdBarrier::kVEmpty, kMmaThreads + Traits::kWarpThreads);
    }
    stage_tile<false>(tdKout, dk_stage, mma_tid);
    if (Traits::has_dv_slice(mma_tid)) { stage_tile<true>(tdVout, dv_stage, mma_tid); }
    // The generic-proxy stores above are read by the TMA store (async proxy).
    cutlass::arch::fence_view_async_shared();
    // Wait until both warpgroups have written their rows of dK and dV.
    named_barrier_sync(BwdBarrier::kEpilogue, kMmaThreads);
    if (mma_tid == 0) {
      SeqlenInfo const sl = Traits::seqlens(p, row[schedule::kCBatch]);
      int const h_kv = row[schedule::kCHeadKv];
      int const kv = row[schedule::kCKvTile];
      Tensor gdK = Traits::template kv_tile<false>(p.tma_dk, p, sl, h_kv, kv);
      Tensor gdV = Traits::template kv_tile<true>(p.tma_dv, p, sl, h_kv, kv);
      auto tma_dk = p.tma_dk.get_slice(_0{});
      auto tma_dv = p.tma_dv.get_slice(_0{});
      copy(p.tma_dk, tma_dk.partition_S(sdK), tma_dk.partition_D(gdK));
      copy(p.tma_dv, tma_dv.partition_S(sdV), tma_dv.partition_D(gdV));
      tma_store_arrive();
      // The staging tiles have been read: sK/sV may take the next K/V, sdS the next dS.
      bulk_wait_all_read();
    }
    // Staged in sK / sV: free once read (thread 0 arrives after its wait).
    if constexpr (!Traits::kDkStagedInDs) {
      named_barrier_arrive(BwdBarrier::kKEmpty, kMmaThreads + Traits::kWarpThreads);
    }
    if constexpr (!Traits::kDvStagedInDs) {
      named_barrier_arrive(BwdBarrier::kVEmpty, kMmaThreads + Traits::kWarpThreads);
    }
    if constexpr (Traits::kDkStagedInDs) {
      // Wait until thread 0 has seen the stores read sdS: the next task's
      // first step writes it. (The next task's K load, issued at the first
      // barrier above, takes longer, so this wait is mostly hidden.)
      named_barrier_sync(BwdBarrier::kEpilogue, kMmaThreads);
    }
  }

  // Whether an MHA task with steps must store from registers: its KV tile
  // reaches past its packed document's end.
  CUTE_DEVICE static bool needs_direct_store(Params const& p, int32_t const* row) {
    if constexpr (Traits::kPacked) {
      return (row[schedule::kCKvTile] + 1) * kBlockN > Traits::seqlens(p, row[schedule::kCBatch]).seqlen_k;
    } else {
      return false;
    }
  }

  // Tasks without steps (dK = dV = 0, nothing loaded), GQA, and MHA tiles that
  // cross a packed document's end: straight from registers, rows past the
  // problem's seqlen_k not written. Row and head-dim splits: register pairs
  // run along the head dim, one 4-byte store (8 bytes fp32) per pair. Three
  // warpgroups: the accumulators are dK^T and dV^T (pairs run along the KV
  // rows), one element per store; warpgroups without a dV slice store no dV.
  CUTE_DEVICE static void store_direct(Params const& p, FragDk& tdKrdK, FragDv& tdVrdV, int32_t const* row,
                                       int mma_tid) {
    CUTE_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= p.softmax_scale; }
    SeqlenInfo const sl = Traits::seqlens(p, row[schedule::kCBatch]);
    int const h_kv = row[schedule::kCHeadKv];
    int const n0 = row[schedule::kCKvTile] * kBlockN;
    bool const has_dv = Traits::has_dv_slice(mma_tid);
    if (p.dk_partial == nullptr) {
      Tensor tdKout = make_tensor<Element>(typename FragDk::layout_type{});
      Tensor tdVout = make_tensor<Element>(typename FragDv::layout_type{});
      convert_fragment(tdKrdK, tdKout);
      convert_fragment(tdVrdV, tdVout);
      Element* dk = static_cast<Element*>(p.dk) + sl.tensor_batch * p.dk_batch_stride +
                    sl.offset_k * p.dk_row_stride + h_kv * p.dk_head_stride;
      Element* dv = static_cast<Element*>(p.dv) + sl.tensor_batch * p.dv_batch_stride +
                    sl.offset_k * p.dv_row_stride + h_kv * p.dv_head_stride;
      if constexpr (Traits::kThreeWarpgroups) {
        store_elements<typename Traits::TiledMmaDk, kHeadDim>(
            sl, n0, mma_tid, [&](int n, int d, int i) { dk[n * p.dk_row_stride + d] = tdKout(i); });
        if (has_dv) {
          store_elements<typename Traits::TiledMmaDv, kHeadDimV>(
              sl, n0, mma_tid, [&](int n, int d, int i) { dv[n * p.dv_row_stride + d] = tdVout(i); });
        }
      } else {
        // Registers i, i + 1: columns d, d + 1 of row n.
        store_kv_rows(
            sl, n0, mma_tid,
            [&](int n, int d, int i) {
              *reinterpret_cast<uint32_t*>(dk + n * p.dk_row_stride + d) =
                  *reinterpret_cast<uint32_t const*>(&tdKout(i));
            },
            [&](int n, int d, int i) {
              *reinterpret_cast<uint32_t*>(dv + n * p.dv_row_stride + d) =
                  *reinterpret_cast<uint32_t const*>(&tdVout(i));
            });
      }
      return;
    }
    // GQA. Deterministic, or with long tasks: this query head's slab; every (batch,
    // head, KV tile) has exactly one task, so plain stores suffice: no zeroing, no
    // atomics, no turn-taking. Non-deterministic with short tasks
    // (p.dkv_accumulate): the group's query heads add into their KV head's
    // accumulator, in whatever order their tasks end (a slab each would cost
    // `group` times the bytes, written here and read by the postprocess).
    // Deterministic in turns (p.dkv_ordered): at each KV tile the group's query heads take
    // turns in ascending order on the tile's counter; the first stores its tile into the KV
    // head's accumulator, each later one adds its own (red.add): the same additions in the
    // same order as the postprocess's sum of the slabs (group_sum), so the same bits (red.add
    // flushes subnormal fp32 to zero), with one accumulator's bytes instead of `group` slabs'.
    // The schedule's header says its order lets the turns come (dash_fa3/schedule/validate.py,
    // dkv_order_ok): a task waits only on one planned to finish no later.
    //   acquire: thread 0 spins (ld.acquire.gpu) until the counter reads this head's turn;
    //            the named barrier then lets every MMA thread add
    //   release: every thread's stores or adds, __threadfence (performed at gpu scope), the
    //            named barrier, then thread 0 increments the counter (red.release.gpu)
    // A chain's last row (schedule columns chain_before/after) holds the sum of the chain's
    // heads, added in its first head's turn, which then passes on past the chain.
    bool const ordered = p.dkv_ordered;
    int64_t const kv_head = int64_t(sl.tensor_batch) * p.heads_kv + h_kv;
    int const chain = (Traits::kChains ? row[schedule::kCChainBefore] : 0) + 1;
    int const turn = ordered ? (row[schedule::kCHead] - (chain - 1)) % (p.heads / p.heads_kv) : 0;
    int* const sem = ordered ? p.dkv_semaphore + kv_head * ((p.seqlen_k + kBlockN - 1) / kBlockN) +
                                   row[schedule::kCKvTile]
                             : nullptr;
    if (turn > 0) {
      if (mma_tid == 0) { semaphore_wait_for(sem, turn); }
      named_barrier_sync(BwdBarrier::kEpilogue, kMmaThreads);
    }
    bool const accumulate = p.dkv_accumulate || turn > 0;
    int64_t const slab = p.dkv_accumulate || ordered ? kv_head
                                                     : int64_t(sl.tensor_batch) * p.heads + row[schedule::kCHead];
    int64_t const base = slab * p.partial_rows + sl.offset_k;
    if constexpr (Traits::kThreeWarpgroups) {
      store_elements<typename Traits::TiledMmaDk, kHeadDim>(sl, n0, mma_tid, [&](int n, int d, int i) {
        float* dst = p.dk_partial + (base + n) * kHeadDim + d;
        if (accumulate) { atomicAdd(dst, tdKrdK(i)); } else { *dst = tdKrdK(i); }
      });
      if (has_dv) {
        store_elements<typename Traits::TiledMmaDv, kHeadDimV>(sl, n0, mma_tid, [&](int n, int d, int i) {
          float* dst = p.dv_partial + (base + n) * kHeadDimV + d;
          if (accumulate) { atomicAdd(dst, tdVrdV(i)); } else { *dst = tdVrdV(i); }
        });
      }
    } else {
      // Registers i, i + 1: columns d, d + 1 of row n.
      auto const put = [accumulate](float* dst, float a, float b) {
        if (accumulate) {
          red_add_f32x2(dst, a, b);
        } else {
          *reinterpret_cast<float2*>(dst) = make_float2(a, b);
        }
      };
      store_kv_rows(
          sl, n0, mma_tid,
          [&](int n, int d, int i) { put(p.dk_partial + (base + n) * kHeadDim + d, tdKrdK(i), tdKrdK(i + 1)); },
          [&](int n, int d, int i) { put(p.dv_partial + (base + n) * kHeadDimV + d, tdVrdV(i), tdVrdV(i + 1)); });
    }
    if (ordered) {
      __threadfence();
      named_barrier_sync(BwdBarrier::kEpilogue, kMmaThreads);
      if (mma_tid == 0) { semaphore_release_add(sem, chain); }
    }
  }

 private:
  // A tile's converted dK (kValue: dV) registers into its staging tile (the
  // TMA store's source) with stmatrix: rows of 8 contiguous elements of the
  // (KV, d) tile; from the transposed accumulators of three warpgroups the
  // transposing form, whose matrix rows run along d.
  template <bool kValue, class Frag>
  CUTE_DEVICE static void stage_tile(Frag const& out, Element* stage, int mma_tid) {
    constexpr bool kT = Traits::kThreeWarpgroups;
    using TiledMma = std::conditional_t<kValue, typename Traits::TiledMmaDv, typename Traits::TiledMmaDk>;
    // The staging tile as the accumulator sees it: (KV, d), or (d, KV) for the transposed ones.
    using LayoutV = std::conditional_t<kT, typename Traits::SmemLayoutVt, typename Traits::SmemLayoutV>;
    using LayoutK = std::conditional_t<kT, typename Traits::SmemLayoutKt, typename Traits::SmemLayoutK>;
    using Layout = std::conditional_t<kValue, LayoutV, LayoutK>;
    using Store = std::conditional_t<kT, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
    Tensor s = make_tensor(make_smem_ptr(stage), Layout{});
    auto r2s = make_tiled_copy_C(Copy_Atom<Store, Element>{}, TiledMma{});
    auto thr = r2s.get_thread_slice(mma_tid);
    copy(r2s, thr.retile_S(out), thr.partition_D(s));
  }

  // Calls store(n, d, i) for each register i of a transposed accumulator of
  // TiledMma over a kDim x kBlockN tile (row d, column n) whose KV row n is
  // below the problem's seqlen_k.
  template <class TiledMma, int kDim, class Store>
  CUTE_DEVICE static void store_elements(SeqlenInfo const& sl, int n0, int mma_tid, Store&& store) {
    auto thr = TiledMma{}.get_thread_slice(mma_tid);
    Tensor tDcD = thr.partition_C(make_identity_tensor(Shape<Int<kDim>, Int<kBlockN>>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(tDcD); ++i) {
      int const n = n0 + get<1>(tDcD(i));
      if (n < sl.seqlen_k) { store(n, get<0>(tDcD(i)), i); }
    }
  }

  // dK's and dV's register pairs through store_k / store_v (see store_rows).
  // Equal head dims share one loop (the accumulators share a layout): with
  // a loop each, ptxas spilled 20 bytes in the hdim 64 full packed kernel.
  template <class StoreK, class StoreV>
  CUTE_DEVICE static void store_kv_rows(SeqlenInfo const& sl, int n0, int mma_tid, StoreK&& store_k,
                                        StoreV&& store_v) {
    if constexpr (kHeadDim == kHeadDimV) {
      store_rows<typename Traits::TiledMmaDk, kHeadDim>(sl, n0, mma_tid, [&](int n, int d, int i) {
        store_k(n, d, i);
        store_v(n, d, i);
      });
    } else {
      store_rows<typename Traits::TiledMmaDk, kHeadDim>(sl, n0, mma_tid, store_k);
      store_rows<typename Traits::TiledMmaDv, kHeadDimV>(sl, n0, mma_tid, store_v);
    }
  }

  // Calls store(n, d, i) for each register pair i, i + 1 of an accumulator of
  // TiledMma over a kBlockN x kDim tile (columns d, d + 1 of problem row n)
  // whose row is below the problem's seqlen_k.
  template <class TiledMma, int kDim, class Store>
  CUTE_DEVICE static void store_rows(SeqlenInfo const& sl, int n0, int mma_tid, Store&& store) {
    auto thr = TiledMma{}.get_thread_slice(mma_tid);
    Tensor tDcD = thr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDim>>{}));
    constexpr int kV = decltype(size<0, 2>(tDcD))::value;
    static_assert(decltype(size<1>(tDcD))::value == 1 && decltype(size<2>(tDcD))::value == 1,
                  "one WGMMA atom per warpgroup: registers (2, 2, kV)");
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int const n = n0 + get<0>(tDcD(2 * r));
      if (n < sl.seqlen_k) {
        CUTE_UNROLL
        for (int v = 0; v < kV; ++v) {
          int const i = 4 * v + 2 * r;
          store(n, get<1>(tDcD(i)), i);
        }
      }
    }
  }
};

}  // namespace dash_fa3::bwd
