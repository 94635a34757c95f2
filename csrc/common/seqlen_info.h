// Where the rows of one problem of a call live, defined once for the kernels.
//
// Dense calls: (batch, seqlen, heads, d) tensors, every problem of the batch
// has the call's lengths. Packed calls (varlen, FA3's cu_seqlens layout):
// (total, heads, d) tensors that the kernels view as one batch of `total`
// rows; document b is q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) against
// k rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]), masks aligned to its own
// bottom-right corner. Empty documents are legal.
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

}  // namespace dash_fa3
