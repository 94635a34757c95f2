// Attention masks on SM90 accumulator fragments. Which key blocks a query
// block visits, and which of them need this mask, is common/block_range.h.
//
// Convention (bottom-right aligned, as FlashAttention 2.1+ and FA3's windows):
// query row i attends key j iff j < seqlen_k and, when causal,
// j <= i + seqlen_k - seqlen_q; with a window (kLocal),
// i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right.
// A row that attends no key gets O = 0 and LSE = -inf.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace dash_fa3 {

// Sets masked scores to -inf. coords is the identity-tensor partition of the
// tile (tile-local (row, col) per register); row0/col0 are the global indices
// of the tile's first query row and first key. window_left/right (kLocal
// only) are non-negative: an unbounded side comes as a bound that hides
// nothing (left >= seqlen_k, right >= seqlen_q).
template <bool kCausal, bool kLocal = false, class Frag, class Coords>
CUTE_DEVICE void apply_attention_mask(Frag& s, Coords const& coords, int row0, int col0,
                                      int seqlen_q, int seqlen_k, int window_left = 0, int window_right = 0) {
  using namespace cute;
  static_assert(!(kCausal && kLocal), "a window includes the causal mask");
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    int col_end = seqlen_k - col0;
    int col_begin = 0;  // kLocal: tile-local columns [col_begin, col_end) are kept
    if constexpr (kCausal) {
      int const row = row0 + get<0>(coords(2 * r));
      col_end = cute::min(col_end, row + seqlen_k - seqlen_q + 1 - col0);
    }
    if constexpr (kLocal) {
      int const diag = row0 + get<0>(coords(2 * r)) + seqlen_k - seqlen_q - col0;  // this row's diagonal
      col_end = cute::min(col_end, diag + window_right + 1);
      col_begin = diag - window_left;
    }
    CUTE_UNROLL
    for (int v = 0; v < decltype(size<0, 2>(s))::value; ++v) {
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        int const i = 4 * v + 2 * r + c;
        int const col = get<1>(coords(i));
        if (col >= col_end || (kLocal && col < col_begin)) { s(i) = -INFINITY; }
      }
    }
  }
}

}  // namespace dash_fa3
