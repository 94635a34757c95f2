// Epilogue role of the forward kernel: each MMA warpgroup writes its 64 rows
// of O (converted to the input type) and each thread the LSE of its two rows.
//
// Every kernel built (Traits::kTmaEpilogue): O goes into a
// 64-row slot of shared memory with stmatrix and leaves with one TMA store per
// warpgroup, which runs while the warpgroup starts its next tile. Why: written
// straight from registers (a 4-byte store per register pair, the four threads
// of a quad covering 16 contiguous bytes of a row) the epilogue cost about as
// much as a key-block step per tile, which weighs most at short lengths where a
// tile has few steps (docs/journal/fwd-kernel.md).
// Slot hand-offs: with a slot per warpgroup, the warpgroup's issuing thread
// waits until the copy engine has read its previous store before the
// warpgroup writes the slot again; with one slot for two warpgroups (hdim 128,
// 128 x 176 tiles, and (192, 128)) they take turns on it in warpgroup order
// (kOutputTurn0/1), the issuing warp passing the turn once its store has been
// read. That wait sits on the second warpgroup's path and costs most at long
// lengths (measured: docs/journal/code-comments.md), so run_fwd launches the
// shared-slot kernel only below kSharedOutputSlotBelowKeys keys and one with
// O in V's buffer (below) from there on.
//
// hdim 192 and 256 (no room for a slot beside Q, K and V) and the long-key
// kernels built with kOutputInV_ (Traits::kOutputInV):
// each warpgroup's slot lies in V's buffer, which no one reads between a
// tile's last PV GEMM (kOutputVFree: every warpgroup's has retired) and the
// next tile's first V load, which the producer holds until every
// warpgroup's issuing thread has seen its store read (o_read).
// From registers, rows past the problem's seqlen_q not written: a packed
// document's tiles that reach past its last row (those rows belong to the
// next document; both warpgroups of such a tile store from registers, so the
// shared slot's turns stay in step) and tiles whose rows attend no key
// (store_empty).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include <cutlass/arch/barrier.h>

#include "common/gemm_sm90.h"
#include "common/named_barriers.h"
#include "common/problem_view.h"
#include "kernels/fwd/fwd_mainloop.h"
#include "kernels/fwd/fwd_tile_scheduler.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3::fwd {

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  using FragO = typename FwdMainloop<Traits>::FragO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // O's head dim

  static constexpr int kWarpgroupThreads = Traits::kThreadsPerWarpgroup;
  static constexpr int kSlots = Traits::kOutputSlots;
  static constexpr bool kInV = Traits::kOutputInV;
  // A turn of the shared slot counts the warpgroup that waits and the warp that passes.
  static constexpr int kOutputTurnThreads = kWarpgroupThreads + 32;

  CUTE_DEVICE static FwdBarrier output_barrier(int wg) {
    return static_cast<FwdBarrier>(static_cast<int>(FwdBarrier::kOutput0) + wg);
  }
  CUTE_DEVICE static FwdBarrier output_turn(int wg) {
    return static_cast<FwdBarrier>(static_cast<int>(FwdBarrier::kOutputTurn0) + wg);
  }
  // Whether this thread issues its warpgroup's O stores (and alone waits for them).
  CUTE_DEVICE static bool issues_store(int mma_tid) { return mma_tid % kWarpgroupThreads == 0; }

  // The MMA thread index the epilogue of a tile works with: with
  // Traits::kEpilogueIndexPerTile, read from %tid.x again (volatile, so not
  // hoisted), so that NVVM does not hoist the epilogue's per-thread address
  // arithmetic (the stmatrix offsets into O's slot) out of the tile loop and
  // hold it through the mainloop.
  CUTE_DEVICE static int tile_thread_index(int mma_tid) {
    if constexpr (!Traits::kEpilogueIndexPerTile) {
      return mma_tid;
    } else {
      uint32_t tid;
      asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
      return int(tid) - Traits::kThreadsPerWarpgroup;
    }
  }

  // Called once by every MMA thread before the first tile.
  CUTE_DEVICE static void init(int mma_tid) {
    if constexpr (kSlots == 1) {
      int const wg = FwdMainloop<Traits>::warpgroup(mma_tid);
      // kOutputTurn0: warpgroup 0 has the slot first; this arrival of its first
      // warp stands in for warpgroup 1's "slot read" that its first wait needs.
      if (wg == 0 && mma_tid < 32) { named_barrier_arrive(FwdBarrier::kOutputTurn0, kOutputTurnThreads); }
    }
  }

  // Called once by every MMA thread after the last tile: shared memory must
  // outlive the copy engine's reads of it.
  CUTE_DEVICE static void finish(int mma_tid) {
    if constexpr (Traits::kTmaEpilogue) {
      if (issues_store(mma_tid)) { tma_store_wait<0>(); }
    }
  }

  // kOutputInV: this warpgroup's O has left V's buffer (or never entered it):
  // its issuing thread's arrival on o_read, one of the producer's
  // kNumMmaWarpgroups for the tile. (The issuing thread is the one that
  // waited for its O store's read.)
  CUTE_DEVICE static void signal_o_read(typename Traits::SharedStorage& smem, int mma_tid) {
    if constexpr (kInV) {
      if (issues_store(mma_tid)) { cutlass::arch::ClusterBarrier::arrive(&smem.o_read); }
    }
  }

  // O and LSE of a tile whose mainloop ran.
  CUTE_DEVICE static void store(Params const& p, typename Traits::SharedStorage& smem, FragO const& tOrO,
                                float const (&lse)[2], FwdTile const& t, SeqlenInfo const& sl, int mma_tid) {
    if constexpr (Traits::kTmaEpilogue) {
      if (!Traits::kPacked || (t.m_block + 1) * kBlockM <= sl.seqlen_q) {
        store_tma(p, smem, tOrO, t, sl, FwdMainloop<Traits>::warpgroup(mma_tid), mma_tid);
        store_lse(p, output_coords(mma_tid), lse, t, sl);
        return;
      }
    }
    store_direct(p, tOrO, lse, t, sl, mma_tid);
    // No O in V's buffer: the producer may load the next tile's V once this
    // tile's V stages are released (its pipeline's own barriers).
    signal_o_read(smem, mma_tid);
  }

  // This warpgroup's 64 rows of O through its slot and one TMA store.
  CUTE_DEVICE static void store_tma(Params const& p, typename Traits::SharedStorage& smem, FragO const& tOrO,
                                    FwdTile const& t, SeqlenInfo const& sl, int wg, int mma_tid) {
    using MmaWg = typename Traits::TiledMmaPVWarpgroup;
    using FragOWg = decltype(partition_fragment_C(MmaWg{}, Shape<_64, Int<kHeadDimV>>{}));
    static_assert(cosize_v<typename FragOWg::layout_type> == cosize_v<typename FragO::layout_type>,
                  "a warpgroup's rows of O hold the same registers in both MMA views");
    Tensor tOrOut = make_tensor<Element>(typename FragOWg::layout_type{});
    convert_fragment(make_tensor(tOrO.data(), typename FragOWg::layout_type{}), tOrOut);

    int const slot = kSlots == 1 ? 0 : wg;
    Element* const o_base = [&] {
      if constexpr (kInV) {
        return smem.v.data();
      } else {
        return smem.out.o.data();
      }
    }();
    Tensor sO = make_tensor(make_smem_ptr(o_base), typename Traits::SmemLayoutO{})(_, _, slot);
    if constexpr (kInV) {
      // kOutputVFree: every warpgroup's last PV GEMM of the tile has retired,
      // so V's buffer is read by no one; the producer loads no V of the next
      // tile before o_read. (This warpgroup's previous O left before its
      // o_read arrival, below.)
      named_barrier_sync(FwdBarrier::kOutputVFree, Traits::kNumMmaThreads);
    } else if constexpr (kSlots == 1) {
      // kOutputTurn<wg>: the other warpgroup's store has read the shared slot.
      named_barrier_sync(output_turn(wg), kOutputTurnThreads);
    } else {
      // This warpgroup's previous store has read its slot ...
      if (issues_store(mma_tid)) { tma_store_wait<0>(); }
      // kOutput<wg>: ... before any of its threads writes the slot again.
      named_barrier_sync(output_barrier(wg), kWarpgroupThreads);
    }
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, MmaWg{});
    auto thr_r2s = r2s.get_thread_slice(mma_tid % kWarpgroupThreads);
    copy(r2s, thr_r2s.retile_S(tOrOut), thr_r2s.partition_D(sO));
    // The generic-proxy writes above are read by the TMA store (async proxy).
    cutlass::arch::fence_view_async_shared();
    // kOutput<wg>: every thread of the warpgroup has written its rows.
    named_barrier_sync(output_barrier(wg), kWarpgroupThreads);
    if (issues_store(mma_tid)) {
      Tensor gO = local_tile(
          rows_from<Traits::kPacked>(p.tma_o.get_tma_tensor(Traits::shape_o(p))(_, _, t.head, sl.tensor_batch),
                                     sl.offset_q),
          Shape<_64, Int<kHeadDimV>>{}, make_coord(t.m_block * Traits::kNumMmaWarpgroups + wg, _0{}));
      auto tma_o = p.tma_o.get_slice(_0{});
      copy(p.tma_o, tma_o.partition_S(sO), tma_o.partition_D(gO));
      tma_store_arrive();
      // kInV: O must have left V's buffer before the producer may load V again.
      if constexpr (kInV) { tma_store_wait<0>(); }
    }
    signal_o_read(smem, mma_tid);
    if constexpr (kSlots == 1) {
      if (mma_tid % kWarpgroupThreads < 32) {
        if (issues_store(mma_tid)) { tma_store_wait<0>(); }
        __syncwarp();
        // kOutputTurn<other>: the shared slot has been read; the other warpgroup may write it.
        named_barrier_arrive(output_turn(wg ^ 1), kOutputTurnThreads);
      }
    }
  }

  // The quad thread that holds column 0 writes the LSE of the two rows;
  // tOcO: this thread's (row, column) coordinates of O in the tile.
  template <class CoordTensor>
  CUTE_DEVICE static void store_lse(Params const& p, CoordTensor const& tOcO, float const (&lse)[2], FwdTile const& t,
                                    SeqlenInfo const& sl) {
    if (get<1>(tOcO(0)) == 0) {
      float* lse_bh = p.lse + sl.tensor_batch * p.lse_batch_stride + t.head * p.lse_head_stride + sl.offset_q;
      int const row0 = t.m_block * kBlockM;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        int const row = row0 + get<0>(tOcO(2 * r));
        if (row < sl.seqlen_q) { lse_bh[row] = lse[r]; }
      }
    }
  }

  // This thread's (row, column) coordinates of O in the tile.
  CUTE_DEVICE static auto output_coords(int mma_tid) {
    typename Traits::TiledMmaPV mma_pv;
    return mma_pv.get_thread_slice(mma_tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  }

  // O from registers: pairs of adjacent elements (4 bytes), rows past the
  // problem's seqlen_q not written.
  CUTE_DEVICE static void store_direct(Params const& p, FragO const& tOrO, float const (&lse)[2],
                                       FwdTile const& t, SeqlenInfo const& sl, int mma_tid) {
    Tensor tOcO = output_coords(mma_tid);
    Tensor tOrOut = make_tensor<Element>(typename FragO::layout_type{});
    convert_fragment(tOrO, tOrOut);

    int const row0 = t.m_block * kBlockM;
    Element* o = static_cast<Element*>(p.o) + sl.tensor_batch * p.o_batch_stride + sl.offset_q * p.o_row_stride +
                 t.head * p.o_head_stride;
    constexpr int kV = decltype(size<0, 2>(tOrOut))::value;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int const row = row0 + get<0>(tOcO(2 * r));
      if (row < sl.seqlen_q) {
        Element* o_row = o + row * p.o_row_stride;
        CUTE_UNROLL
        for (int v = 0; v < kV; ++v) {
          int const i = 4 * v + 2 * r;
          // Registers i and i + 1 hold columns col and col + 1.
          *reinterpret_cast<uint32_t*>(o_row + get<1>(tOcO(i))) =
              *reinterpret_cast<uint32_t const*>(&tOrOut(i));
        }
      }
    }
    store_lse(p, tOcO, lse, t, sl);
  }

  // A tile whose rows attend no key (causal with seqlen_q > seqlen_k):
  // O = 0, LSE = -inf.
  CUTE_DEVICE static void store_empty(Params const& p, FwdTile const& t, SeqlenInfo const& sl, int mma_tid) {
    FragO zero;
    clear(zero);
    float const lse[2] = {-INFINITY, -INFINITY};
    store_direct(p, zero, lse, t, sl, mma_tid);
  }
};

}  // namespace dash_fa3::fwd
