// The forward's order of work over packed documents, defined once for the
// order kernel (kernels/fwd/fwd_packed_order.cu) that writes it and the tile
// scheduler (kernels/fwd/fwd_tile_scheduler.h) that reads it.
//
// Why. The persistent forward hands out units (a query tile, or a causal pair
// of tiles) in a static snake over CTAs, which balances units of equal cost.
// A document's units cost about its key length in blocks, so a batch of
// unequal documents must be handed out costliest first for the snake to even
// the CTAs out: a unit-cost model of 16k tokens in log-uniform documents
// (64..8192) put the busiest CTA 28-116 % above the mean when the units were
// those of a batch of the longest document's length, 1-8 % with documents in
// descending key length handed out in the static snake, and about 1 % handed
// out in that order as CTAs finish (the tile counter below).
//
// The order lives on the device (the lengths are), in one int32 buffer of
// packed_order_ints(batch) entries:
//   [0]                   the units of the call (every document, every head);
//   [1 + s], s = 0..batch the first unit of the s-th document in the order
//                         ([1 + batch] = the units of the call);
//   [2 + batch + s]       the index of the s-th document in the order;
//   [2 + 2 * batch]       the tile counter: the forward's CTAs take their
//                         units after the first off it (zeroed here).
// Documents are ordered by key blocks, descending (packed_order_bucket);
// documents in one bucket cost the same per unit and may come in any order.
// Which CTA computes a unit changes from call to call (the counter hands
// them out as CTAs finish, an LPT-like greedy over units in descending
// cost), but a tile's bits do not.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dash_fa3 {

// Units per (document or batch, head) with num_m_blocks query tiles: causal
// masks pair tile n - 1 - j with tile j (fwd_tile_scheduler.h).
DASH_FA3_HD int fwd_units_per_head(int num_m_blocks, bool causal_pairs) {
  return causal_pairs ? (num_m_blocks + 1) / 2 : num_m_blocks;
}

// Dense causal kernels that take single tiles off a counter, longest first
// (FwdTraits::kDynamicCausalTiles): KV heads per section, the smallest power
// of two whose tiles (num_m_blocks per head) fill the grid's CTAs once. Each
// section, and the kernel, then ends on short tiles; head counts are usually
// powers of two, so no partial section ends the kernel
// (dash_fa3/fwd_order.py models the balance).
DASH_FA3_HD int fwd_causal_section_kv_heads(int num_m_blocks, int grid) {
  int kv_heads = 1;
  while (int64_t(kv_heads) * num_m_blocks < grid) { kv_heads *= 2; }
  return kv_heads;
}

// Where each entry lives (the layout above), for the writer and the readers.
DASH_FA3_HD int packed_order_ints(int batch) { return 2 * batch + 3; }
constexpr int kPackedOrderUnitsIndex = 0;
DASH_FA3_HD int packed_order_first_index(int s) { return 1 + s; }
DASH_FA3_HD int packed_order_document_index(int batch, int s) { return 2 + batch + s; }
DASH_FA3_HD int packed_order_counter_index(int batch) { return 2 * batch + 2; }

// Sort buckets: the order kernel counts documents per bucket in shared
// memory; longer documents share the last bucket (their order among
// themselves is then arbitrary, still longest class first).
constexpr int kPackedOrderBuckets = 4096;

// Bucket of a document with seqlen_k keys, 0 first: descending key blocks.
DASH_FA3_HD int packed_order_bucket(int seqlen_k, int block_n) {
  int const blocks = (seqlen_k + block_n - 1) / block_n;
  return kPackedOrderBuckets - 1 - imin(blocks, kPackedOrderBuckets - 1);
}

DASH_FA3_HD int packed_order_units(int const* order) { return order[kPackedOrderUnitsIndex]; }
DASH_FA3_HD int packed_order_first_unit(int const* order, int s) { return order[packed_order_first_index(s)]; }
DASH_FA3_HD int packed_order_document(int const* order, int batch, int s) {
  return order[packed_order_document_index(batch, s)];
}

// The position s in the order whose units hold `unit` (0 <= unit < the
// call's units): the last s with first(s) <= unit, so documents without units
// are passed over.
DASH_FA3_HD int packed_order_position(int const* order, int batch, int unit) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (packed_order_first_unit(order, mid) <= unit) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}


}  // namespace dash_fa3
