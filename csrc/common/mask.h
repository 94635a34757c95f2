// Attention masks on SM90 accumulator fragments, and the range of key blocks
// a query block must visit.
//
// Convention (bottom-right aligned causal, as FlashAttention 2.1+):
// query row i attends key j iff j < seqlen_k and, when causal,
// j <= i + seqlen_k - seqlen_q. A row that attends no key gets O = 0 and
// LSE = -inf.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace dash_fa3 {

template <int kBlockM, int kBlockN, bool kCausal>
struct KeyBlockRange {
  // One past the last key block that query block m_block attends (may be <= 0).
  CUTE_HOST_DEVICE static int end(int m_block, int seqlen_q, int seqlen_k) {
    int const n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
    if constexpr (!kCausal) {
      return n_blocks;
    } else {
      int const rows_end = cute::min((m_block + 1) * kBlockM, seqlen_q);
      int const keys_end = rows_end + seqlen_k - seqlen_q;  // last attended key + 1
      if (keys_end <= 0) { return 0; }
      return cute::min(n_blocks, (keys_end + kBlockN - 1) / kBlockN);
    }
  }

  // Key blocks [0, unmasked_end) need no causal mask for any row of the query
  // block (the last key of the block is attended by the block's first row).
  // Only meaningful for causal; the caller also masks the last key block.
  CUTE_HOST_DEVICE static int unmasked_end(int m_block, int seqlen_q, int seqlen_k) {
    int const first_row_keys = m_block * kBlockM + seqlen_k - seqlen_q + 1;
    return first_row_keys <= 0 ? 0 : first_row_keys / kBlockN;
  }
};

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
