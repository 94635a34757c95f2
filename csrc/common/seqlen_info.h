// Where the rows of one problem of a call live, defined once for the kernels.
//
// Dense calls: (batch, seqlen, heads, d) tensors, every problem of the batch
// has the call's lengths. Packed calls (varlen, FA3's cu_seqlens layout):
// (total, heads, d) tensors that the kernels view as one batch of `total`
// rows; document b is q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) against
// k rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]), masks aligned to its own
// bottom-right corner. Empty documents are legal.
//
// The backward's per-row statistics (LSE, dPsum), dQ accumulator and
// semaphores are tiled by block_m rows per (problem, head): dense (batch,
// heads, seqlen_q_rounded); packed (heads, total_q_padded), document b from
// padded row packed_padded_offset(cu_seqlens_q[b], b, block_m) on, so that
// each document starts on a tile and its last tile ends before the next
// document's first (padded_offset(b) + n_q(b) * block_m <= padded_offset(b +
// 1)); total_q_padded = packed_padded_offset(total_q, batch, block_m). Rows
// of a tile past its document's end are padding (LSE +inf, dPsum 0), so the
// next document's rows that the tile's Q and dO loads read add nothing.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dash_fa3 {

struct SeqlenInfo {
  int seqlen_q;
  int seqlen_k;
  int offset_q;  // first row of the problem in the q / out / dq tensors' row dim
  int offset_k;  // ... in k / v / dk / dv
  int tensor_batch;  // batch coordinate in the tensors: b dense, 0 packed

  // cu_q == nullptr: dense, every problem seqlen_q x seqlen_k; else cu_q and
  // cu_k hold batch + 1 offsets.
  DASH_FA3_HD static SeqlenInfo of(int b, int seqlen_q, int seqlen_k, int const* cu_q, int const* cu_k) {
    if (cu_q == nullptr) { return {seqlen_q, seqlen_k, 0, 0, b}; }
    int const q0 = cu_q[b], k0 = cu_k[b];
    return {cu_q[b + 1] - q0, cu_k[b + 1] - k0, q0, k0, 0};
  }
};

// The lengths and rows of problem b of a kernel whose Params hold seqlen_q,
// seqlen_k and cu_seqlens_q/k: the packed instantiations (kPacked) read its
// document's from cu_seqlens, the dense ones take the call's lengths.
template <bool kPacked, class Params>
DASH_FA3_HD SeqlenInfo problem_seqlens(Params const& p, int b) {
  if constexpr (kPacked) {
    return SeqlenInfo::of(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k);
  } else {
    return {p.seqlen_q, p.seqlen_k, 0, 0, b};
  }
}

// Padded first statistics row of a packed document that starts at packed row
// row0 and is the b-th of the batch (see the top of this file).
DASH_FA3_HD int64_t packed_padded_offset(int64_t row0, int b, int block_m) {
  return (row0 + int64_t(b) * block_m) / block_m * block_m;
}

// The packed row that padded statistics row r (0 <= r < the padded total) of
// a batch of `batch` documents holds, or -1 for a padding row.
DASH_FA3_HD int packed_row_of(int64_t r, int const* cu_q, int batch, int block_m) {
  // The last document whose padded offset is <= r (offsets strictly increase).
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    int const mid = (lo + hi + 1) / 2;
    if (packed_padded_offset(cu_q[mid], mid, block_m) <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  int64_t const row = cu_q[lo] + (r - packed_padded_offset(cu_q[lo], lo, block_m));
  return row < cu_q[lo + 1] ? int(row) : -1;
}

// The input row that statistics row r of a (problem, head) holds, or -1 for a
// padding row: dense, r below seqlen_q; packed (cu_q given; r a padded row of
// all `batch` documents), packed_row_of.
DASH_FA3_HD int stat_input_row(int64_t r, int seqlen_q, int const* cu_q, int batch, int block_m) {
  if (cu_q != nullptr) { return packed_row_of(r, cu_q, batch, block_m); }
  return r < seqlen_q ? int(r) : -1;
}

// Batches of the tensors (and of the statistics rows): dense, the call's;
// packed, one.
DASH_FA3_HD int tensor_batches(int batch, int const* cu_q) { return cu_q != nullptr ? 1 : batch; }

}  // namespace dash_fa3
