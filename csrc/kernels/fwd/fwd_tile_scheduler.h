// Static persistent tile scheduler of the forward kernel.
//
// The grid has min(num_sms, num_tiles) CTAs (G). In round r, CTA c processes
// tile r * G + c for even r and r * G + (G - 1 - c) for odd r (a snake), so
// with tiles sorted longest first the CTA that got the longest tile of one
// round gets the shortest of the next, which evens out the per-CTA totals.
// The producer warp and the MMA warpgroups walk the same sequence
// independently, so no tile index has to be passed between them.
//
// Tile order. The (batch, head) pairs are cut into sections of
// heads_per_section consecutive pairs, chosen on the host so that the K and V
// of one section fit in about half of L2. Within a section the order is query
// block major, (batch, head) minor; for causal masks the query blocks go from
// the last (longest: most key blocks) to the first, so that the round-robin
// assignment hands out the longest tiles first and the short ones fill in at
// the end. Heads sharing a KV head (GQA) are adjacent, so they share K/V in L2.
#pragma once

#include <cute/tensor.hpp>

namespace dash_fa3::fwd {

struct FwdTile {
  int m_block;
  int head;
  int batch;
};

template <class Traits>
struct FwdTileScheduler {
  using Params = typename Traits::Params;

  // Tile index of this CTA in round r; >= num_tiles once the CTA is done
  // (and for every later round).
  CUTE_DEVICE static int tile_of_round(int round) {
    int const lane = (round & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    return round * int(gridDim.x) + lane;
  }

  CUTE_DEVICE static FwdTile decode(Params const& p, int tile) {
    int const pairs = p.batch * p.heads;
    int const tiles_per_section = p.heads_per_section * p.num_m_blocks;
    int const section = tile / tiles_per_section;
    int const first_pair = section * p.heads_per_section;
    int const pairs_here = cute::min(p.heads_per_section, pairs - first_pair);
    int const in_section = tile - section * tiles_per_section;
    int const m_index = in_section / pairs_here;
    int const pair = first_pair + (in_section - m_index * pairs_here);
    FwdTile t;
    t.m_block = Traits::kCausal ? p.num_m_blocks - 1 - m_index : m_index;
    t.batch = pair / p.heads;
    t.head = pair - t.batch * p.heads;
    return t;
  }

  // Host: (batch, head) pairs per section, for K+V of kv_bytes_per_head each.
  static int heads_per_section(int64_t kv_bytes_per_head, int64_t l2_budget_bytes) {
    int64_t const n = l2_budget_bytes / (kv_bytes_per_head > 0 ? kv_bytes_per_head : 1);
    return n < 1 ? 1 : (n > (1 << 20) ? (1 << 20) : int(n));
  }
};

}  // namespace dash_fa3::fwd
