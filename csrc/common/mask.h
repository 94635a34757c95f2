// Attention masks on SM90 accumulator fragments. Which key blocks a query
// block visits, and which of them need this mask, is common/block_range.h.
//
// Convention (bottom-right aligned causal, as FlashAttention 2.1+):
// query row i attends key j iff j < seqlen_k and, when causal,
// j <= i + seqlen_k - seqlen_q. A row that attends no key gets O = 0 and
// LSE = -inf.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace dash_fa3 {

// Sets masked scores to -inf. coords is the identity-tensor partition of the
// tile (tile-local (row, col) per register); row0/col0 are the global indices
// of the tile's first query row and first key.
template <bool kCausal, class Frag, class Coords>
CUTE_DEVICE void apply_attention_mask(Frag& s, Coords const& coords, int row0, int col0,
                                      int seqlen_q, int seqlen_k) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    int col_end = seqlen_k - col0;
    if constexpr (kCausal) {
      int const row = row0 + get<0>(coords(2 * r));
      col_end = cute::min(col_end, row + seqlen_k - seqlen_q + 1 - col0);
    }
    CUTE_UNROLL
    for (int v = 0; v < decltype(size<0, 2>(s))::value; ++v) {
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        int const i = 4 * v + 2 * r + c;
        if (get<1>(coords(i)) >= col_end) { s(i) = -INFINITY; }
      }
    }
  }
}

}  // namespace dash_fa3
