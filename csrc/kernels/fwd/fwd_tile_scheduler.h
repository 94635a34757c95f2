// Static persistent tile scheduler of the forward kernel.
//
// Work is cut into units. Full and local (window) masks: a unit is one query
// tile (a window's tiles cost about the same, bar the sequence's ends). Causal: a unit
// is the PAIR of query blocks (n_m - 1 - j, j), the longest tile with the
// shortest, so that every unit costs about n_m + 1 key blocks (the causal
// profile is linear in the block index). The grid has min(num_sms,
// num_units) CTAs (G); in round r, CTA c takes unit r * G + c (r even) or
// r * G + (G - 1 - c) (r odd, a snake that evens out what unequal units
// remain, e.g. with seqlen_q != seqlen_k). Equal-cost units leave only the
// last round's quantisation as imbalance. Assigning single causal tiles
// longest-first by snake instead left the busiest CTA 11-20% above the mean
// in a unit-cost model of the benchmark grid (a greedy dynamic assignment:
// 0-4%; pairs: 3%).
//
// A CTA visits slots k = 0, 1, 2, ...: slot k is half k % kTilesPerUnit of
// the unit of round k / kTilesPerUnit. The producer warp and the MMA
// warpgroups walk the same slots independently, so no tile index has to be
// passed between them.
//
// Unit order. The (batch, head) pairs are cut into sections of
// heads_per_section consecutive pairs, chosen on the host so that the K and V
// of one section fit in about half of L2. Within a section the order is unit
// major (query block, or block pair j), (batch, head) minor. Heads sharing a
// KV head (GQA) are adjacent, so they share K/V in L2.
//
// Packed documents: the units of one document (its own query tiles, every
// head) are consecutive, ordered within it as a dense batch of one, and the
// documents follow the order that the order kernel wrote before the launch
// (common/packed_order.h: longest key range first), so that the snake meets
// the costliest units first.
#pragma once

#include <cute/tensor.hpp>

#include "common/block_range.h"
#include "common/packed_order.h"
#include "common/seqlen_info.h"

namespace dash_fa3::fwd {

struct FwdTile {
  int m_block;  // -1: this slot holds no tile (the middle block of an odd causal pair)
  int head;
  int batch;
};

template <class Traits>
struct FwdTileScheduler {
  using Params = typename Traits::Params;
  static constexpr int kTilesPerUnit = Traits::kCausal ? 2 : 1;

  // Host and device: units per (batch, head) pair.
  CUTE_HOST_DEVICE static int units_per_head(int num_m_blocks) {
    return fwd_units_per_head(num_m_blocks, Traits::kCausal);
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
    if constexpr (Traits::kCausal) {
      int const hi = num_m_blocks - 1 - j;
      t.m_block = (k % kTilesPerUnit == 0) ? hi : (j == hi ? -1 : j);
    } else {
      t.m_block = j;
    }
    return first_pair + (in_section - j * pairs_here);
  }

  // Decodes slot k of this CTA into t and its problem's lengths sl. Returns
  // false once the CTA has no unit left (for slot k and every later slot).
  CUTE_DEVICE static bool slot(Params const& p, int k, FwdTile& t, SeqlenInfo& sl) {
    int const round = k / kTilesPerUnit;
    int const lane = (round & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    int const unit = round * int(gridDim.x) + lane;
    if constexpr (Traits::kPacked) {
      int const* order = p.packed_order;
      if (unit >= order[0]) { return false; }
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
  CUTE_DEVICE static Slot tile_at(Params const& p, int k, FwdTile& t, SeqlenInfo& sl, BlockRange& kv_blocks) {
    if (!slot(p, k, t, sl)) { return Slot::kDone; }
    if (t.m_block < 0) { return Slot::kSkip; }
    kv_blocks = Traits::tile_geometry(p, sl).kv_range(t.m_block);
    return Slot::kTile;
  }

  // Host: (batch, head) pairs per section, for K+V of kv_bytes_per_head each.
  static int heads_per_section(int64_t kv_bytes_per_head, int64_t l2_budget_bytes) {
    int64_t const n = l2_budget_bytes / (kv_bytes_per_head > 0 ? kv_bytes_per_head : 1);
    return n < 1 ? 1 : (n > (1 << 20) ? (1 << 20) : int(n));
  }
};

}  // namespace dash_fa3::fwd
