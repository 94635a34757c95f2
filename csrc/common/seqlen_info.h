// Where the rows of one problem of a call live, defined once for the forward,
// the backward and its pre/postprocess.
//
// Dense calls: (batch, seqlen, heads, d) tensors, every problem of the batch
// has the call's lengths. Packed calls (varlen, FA3's cu_seqlens layout):
// (total, heads, d) tensors that the kernels view as one batch of `total`
// rows; document b is q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) against
// k rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]), masks aligned to its own
// bottom-right corner. Empty documents are legal.
//
// The backward's per-row statistics (LSE, dPsum), its dQ accumulator and its
// semaphores are tiled by block_m rows per (problem, head). Dense: (batch,
// heads, seqlen_q_rounded). Packed: (heads, total_q_padded), document b
// starting at the padded row ((cu_seqlens_q[b] + b * block_m) / block_m) *
// block_m, so every document begins on a tile boundary and its last tile does
// not reach the next document's first row (padded_offset(b) + n_q(b) *
// block_m <= padded_offset(b + 1)); total_q_padded = padded row of b = batch.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dash_fa3 {

// Rows past a document's end that its last tile covers: their statistics rows
// are padding (LSE +inf, dPsum 0), so they add nothing in the backward even
// though the tile loads the next document's rows there.
DASH_FA3_HD int64_t packed_padded_offset(int64_t row0, int b, int block_m) {
  return (row0 + int64_t(b) * block_m) / block_m * block_m;
}

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

// First row of problem (b, h) in the backward's per-row statistics, dQ
// accumulator rows and (divided by block_m) semaphores. rows_per_head:
// seqlen_q_rounded dense, total_q_padded packed.
DASH_FA3_HD int64_t stat_row_of(int b, int h, int heads, int64_t rows_per_head, int block_m, int const* cu_q) {
  if (cu_q == nullptr) { return (int64_t(b) * heads + h) * rows_per_head; }
  return int64_t(h) * rows_per_head + packed_padded_offset(cu_q[b], b, block_m);
}

}  // namespace dash_fa3
