// Persistent tile scheduler of the forward kernel: static for dense full and
// local masks, dynamic for dense causal masks (but the hdim-64 two-warpgroup
// kernel's, FwdTraits::kDynamicCausalTiles) and packed documents.
//
// Work is cut into units. Full and local (window) masks, and dense causal
// masks: a unit is one query tile. Packed causal documents (and the hdim-64
// two-warpgroup causal kernel, static): a unit is the
// PAIR of query blocks (n_m - 1 - j, j), the longest tile with the shortest,
// so that every unit costs about n_m + 1 key blocks (the causal profile is
// linear in the block index). The grid has min(num_sms, num_units) CTAs (G).
//
// Static (dense full and local masks, the hdim-64 two-warpgroup causal
// pairs): in round r, CTA c takes unit r * G + c (r even) or r * G + (G - 1 -
// c) (r odd, a snake that evens out what unequal units remain, e.g. with
// seqlen_q != seqlen_k). The producer warp and the MMA warpgroups compute the
// same units independently.
//
// Dynamic: CTA c takes unit c first, then, once per round, the producer warp
// takes the next unit off the call's counter and hands it to the MMA threads
// through shared memory (the mbarriers tile_full / tile_empty), a greedy over
// units in descending cost. Mbarriers rather than named barriers: an mbarrier
// arrive releases the arriving thread's earlier reads, which compute-sanitizer's
// racecheck did not grant the named-barrier version of this hand-off.
// Dense causal: single tiles, longest first within a section (below). Equal
// pairs in a static snake (before) left the last round's quantisation: 1024
// units on 132 CTAs, 7.76 rounds, the busiest CTA ~3% above the mean at every
// grid point; greedy single tiles longest first: 0.1-1.8% (a unit-cost model
// of the bench grid with sections of a power of two of KV heads holding at
// least a round of tiles; sections of any size leave a partial one at the
// end, up to 10% in the model and on the GPU).
// Packed documents: the units of one document (its own query tiles, every
// head) are consecutive, ordered within it as a dense batch of one, and the
// documents follow the order that the order kernel wrote before the launch
// (common/packed_order.h: longest key range first).
//
// A CTA visits slots k = 0, 1, 2, ...: slot k is half k % kTilesPerUnit of
// the unit of round k / kTilesPerUnit.
//
// Unit order. The (batch, head) pairs are cut into sections of
// heads_per_section consecutive pairs: the query heads of one KV head (GQA;
// one head without), or for dense causal masks the smallest power of two of
// KV heads holding a round of tiles (fwd_causal_section_kv_heads,
// common/packed_order.h, mirrored and modelled in dash_fa3/fwd_order.py). Within a section the order is
// unit major (query block: descending for dense causal masks, or block pair
// j), (batch, head) minor. So a KV head's query tiles run side by side and its
// K and V come from DRAM about once. Sections of several KV heads (as many as
// fill 24 MiB of L2) make each round re-read every head's K and V, with more
// DRAM traffic than FA3's and the MMA warps waiting on K and V; one KV head
// per section is the faster for full masks and at least level for causal
// (measured: docs/journal/code-comments.md).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/block_range.h"
#include "common/packed_order.h"
#include "common/seqlen_info.h"
#include "kernels/fwd/fwd_traits.h"

namespace dash_fa3::fwd {

struct FwdTile {
  int m_block;  // -1: this slot holds no tile (the middle block of an odd causal pair)
  int head;
  int batch;
};

template <class Traits>
struct FwdTileScheduler {
  using Params = typename Traits::Params;
  // Dense causal masks: single query tiles, handed out dynamically, longest
  // first (FwdTraits::kDynamicCausalTiles). Packed causal documents and the
  // hdim-64 two-warpgroup kernel keep pairs.
  static constexpr int kTilesPerUnit = Traits::kCausal && !Traits::kDynamicCausalTiles ? 2 : 1;

  // Host and device: units per (batch, head) pair.
  CUTE_HOST_DEVICE static int units_per_head(int num_m_blocks) {
    return fwd_units_per_head(num_m_blocks, kTilesPerUnit == 2);
  }

  // Unit `in` of `pairs` (batch, head) pairs of num_m_blocks query tiles each,
  // as (pair, j) in the section order above; t.m_block from j and the slot half.
  CUTE_DEVICE static int decode(Params const& p, int k, int in, int pairs, int num_m_blocks, FwdTile& t) {
    int const per_head = units_per_head(num_m_blocks);
    int const units_per_section = p.heads_per_section * per_head;
    int const section = in / units_per_section;
    int const first_pair = section * p.heads_per_section;
    int const pairs_here = cute::min(p.heads_per_section, pairs - first_pair);
    int const in_section = in - section * units_per_section;
    int const j = in_section / pairs_here;
    if constexpr (Traits::kDynamicCausalTiles) {
      t.m_block = num_m_blocks - 1 - j;  // longest first
    } else if constexpr (Traits::kCausal) {
      int const hi = num_m_blocks - 1 - j;
      t.m_block = (k % kTilesPerUnit == 0) ? hi : (j == hi ? -1 : j);
    } else {
      t.m_block = j;
    }
    return first_pair + (in_section - j * pairs_here);
  }

  static constexpr bool kDynamic = Traits::kPacked || Traits::kDynamicCausalTiles;

  // Dynamic: the call's tile counter and its number of units.
  CUTE_DEVICE static int* unit_counter(Params const& p) {
    if constexpr (Traits::kPacked) {
      return p.packed_order + packed_order_counter_index(p.batch);
    } else {
      return p.tile_counter;
    }
  }
  CUTE_DEVICE static int dynamic_units(Params const& p) {
    if constexpr (Traits::kPacked) {
      return packed_order_units(p.packed_order);
    } else {
      return p.num_units;
    }
  }

  // Dynamic: called by one thread before the CTA's __syncthreads. tile_full
  // completes once per round (the producer warp's leader arrives after writing
  // the unit), tile_empty once per round (every MMA thread arrives after its
  // last read of the unit).
  CUTE_DEVICE static void init_handoff(typename Traits::SharedStorage& smem) {
    if constexpr (kDynamic) {
      cutlass::arch::ClusterBarrier::init(&smem.tile_full, 1);
      cutlass::arch::ClusterBarrier::init(&smem.tile_empty, Traits::kNumMmaThreads);
      cutlass::arch::fence_barrier_init();
    }
  }

  // The unit of round `round` of this CTA: the static snake, or (dynamic) the
  // producer warp's: it takes the unit off the call's counter and writes it to
  // shared memory for the MMA threads (mma_unit).
  template <bool kProducer>
  CUTE_DEVICE static int unit_of_round(Params const& p, typename Traits::SharedStorage& smem, int round) {
    if constexpr (!kDynamic) {
      int const lane = (round & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
      return round * int(gridDim.x) + lane;
    } else {
      static_assert(kProducer, "the MMA threads read their unit with mma_unit");
      int unit = int(blockIdx.x);
      if (round > 0) {
        if (threadIdx.x % 32 == 0) {
          unit = int(gridDim.x) + atomicAdd(unit_counter(p), 1);
        }
        unit = __shfl_sync(0xffffffff, unit, 0);
        // tile_empty: the MMA threads have read the previous round's unit for the last time.
        cutlass::arch::ClusterBarrier::wait(&smem.tile_empty, (round - 1) & 1);
      }
      if (threadIdx.x % 32 == 0) {
        smem.tile_unit = unit;
        // tile_full: this round's unit is in shared memory.
        cutlass::arch::ClusterBarrier::arrive(&smem.tile_full);
      }
      if (unit >= dynamic_units(p)) {
        // tile_empty: the MMA threads' read of this last (past the end) unit,
        // so that shared memory outlives it.
        cutlass::arch::ClusterBarrier::wait(&smem.tile_empty, round & 1);
      }
      return unit;
    }
  }

  // Dynamic: the unit of slot k as an MMA thread reads it. The unit stays in
  // shared memory through its round (the producer warp writes the next one
  // only after tile_empty), so it is read at every slot rather than held in a
  // register through the tile.
  CUTE_DEVICE static int mma_unit(Params const& p, typename Traits::SharedStorage& smem, int k) {
    int const round = k / kTilesPerUnit;
    // tile_full: the producer warp has written this round's unit.
    if (k % kTilesPerUnit == 0) { cutlass::arch::ClusterBarrier::wait(&smem.tile_full, round & 1); }
    int const unit = smem.tile_unit;
    // tile_empty: this was the round's last read (its last slot, or a unit past
    // the end, which has no more); the producer warp may write the next one.
    if (k % kTilesPerUnit == kTilesPerUnit - 1 || unit >= dynamic_units(p)) {
      cutlass::arch::ClusterBarrier::arrive(&smem.tile_empty);
    }
    return unit;
  }

  // Decodes slot k, half of `unit`, into t and its problem's lengths sl.
  // Returns false once the CTA has no unit left (for slot k and every later slot).
  CUTE_DEVICE static bool slot(Params const& p, int k, int unit, FwdTile& t, SeqlenInfo& sl) {
    if constexpr (Traits::kPacked) {
      int const* order = p.packed_order;
      if (unit >= packed_order_units(order)) { return false; }
      int const s = packed_order_position(order, p.batch, unit);
      t.batch = packed_order_document(order, p.batch, s);
      sl = Traits::seqlens(p, t.batch);
      int const num_m_blocks = (sl.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
      t.head = decode(p, k, unit - packed_order_first_unit(order, s), p.heads, num_m_blocks, t);
    } else {
      if (unit >= p.num_units) { return false; }
      int const pair = decode(p, k, unit, p.batch * p.heads, p.num_m_blocks, t);
      t.batch = pair / p.heads;
      t.head = pair - t.batch * p.heads;
      sl = Traits::seqlens(p, t.batch);
    }
    return true;
  }

  enum class Slot { kDone, kSkip, kTile };

  // Slot k as every role sees it: kDone once the CTA has no unit left, kSkip
  // for a slot without a tile (an odd causal pair's middle), else kTile with
  // the tile, its problem's lengths and its key blocks (possibly empty: rows
  // that attend no key).
  // `unit` carries the round's unit from its first slot to its second (the
  // MMA threads of the dynamic scheduler read it again instead).
  template <bool kProducer>
  CUTE_DEVICE static Slot tile_at(Params const& p, typename Traits::SharedStorage& smem, int k, int& unit, FwdTile& t,
                                  SeqlenInfo& sl, BlockRange& kv_blocks) {
    if constexpr (kDynamic && !kProducer) {
      unit = mma_unit(p, smem, k);
    } else if (k % kTilesPerUnit == 0) {
      unit = unit_of_round<kProducer>(p, smem, k / kTilesPerUnit);
    }
    if (!slot(p, k, unit, t, sl)) { return Slot::kDone; }
    if (t.m_block < 0) { return Slot::kSkip; }
    kv_blocks = Traits::tile_geometry(p, sl).kv_range(t.m_block);
    return Slot::kTile;
  }
};

}  // namespace dash_fa3::fwd
