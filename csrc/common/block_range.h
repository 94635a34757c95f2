// Block ranges of one (batch, head) attention problem: which KV tiles a Q tile
// meets, which Q tiles a KV tile meets, and which tiles need the element mask.
// The forward and the backward kernel and the schedule decode
// (schedules/schedule_metadata.h) all take them from here;
// dash_fa3/schedule/geometry.py TileGeometry is the Python mirror, formula for
// formula, and tests/test_contract_cpp.py compares the two on many shapes.
//
// Masks (bottom-right aligned causal, as FlashAttention 2.1+): query row i
// attends key j iff j < seqlen_k and, when causal, j <= i + seqlen_k - seqlen_q.
// A row that attends no key (seqlen_q > seqlen_k) gets O = 0, LSE = -inf, and
// its Q tile may meet no KV tile. Every row sees a prefix of the keys, so a Q
// tile meets the KV tiles [0, end) and a KV tile the Q tiles [begin, n_q). A
// sliding window or documents bound a row's keys from below too: they change
// the begins and ends computed here, and callers already walk [begin, end).
//
// Plain C++: every / has non-negative operands (C's truncation = Python's floor).
#pragma once

#include "common/host_device.h"

namespace dash_fa3 {

// Tiles [begin, end); empty when end <= begin.
struct BlockRange {
  int begin;
  int end;
};

struct TileGeometry {
  int seqlen_q;
  int seqlen_k;
  int block_m;  // query rows per tile
  int block_n;  // key rows per tile
  bool causal;

  DASH_FA3_HD int n_q() const { return (seqlen_q + block_m - 1) / block_m; }
  DASH_FA3_HD int n_kv() const { return (seqlen_k + block_n - 1) / block_n; }

  // KV tiles that Q tile q meets.
  DASH_FA3_HD BlockRange kv_range(int q) const {
    if (!causal) { return {0, n_kv()}; }
    // Last key the tile's last row attends.
    int const reach = imin((q + 1) * block_m, seqlen_q) - 1 + seqlen_k - seqlen_q;
    return {0, reach < 0 ? 0 : imin(n_kv(), reach / block_n + 1)};
  }

  // Q tiles that KV tile kv meets.
  DASH_FA3_HD BlockRange q_range(int kv) const {
    if (!causal) { return {0, n_q()}; }
    // First query row that attends the tile's first key.
    int const first_row = imax(0, kv * block_n - (seqlen_k - seqlen_q));
    return {first_row < seqlen_q ? first_row / block_m : n_q(), n_q()};
  }

  // A tile (q, kv) needs the element mask when it holds a key past seqlen_k or
  // an element the mask hides. The two prefixes below say which tiles do not.

  // KV tiles [0, kv_unmasked_end(q)) need no mask with Q tile q (the forward).
  DASH_FA3_HD int kv_unmasked_end(int q) const {
    int const whole = seqlen_k / block_n;  // KV tiles without keys past seqlen_k
    if (!causal) { return whole; }
    int const seen = q * block_m + seqlen_k - seqlen_q + 1;  // keys the tile's first row sees
    return imin(whole, seen <= 0 ? 0 : seen / block_n);
  }

  // Q tiles [q_unmasked_begin(kv), n_q) need no mask with KV tile kv (the
  // backward: one compare per step).
  DASH_FA3_HD int q_unmasked_begin(int kv) const {
    int const key_end = (kv + 1) * block_n;  // one past the tile's last key
    if (key_end > seqlen_k) { return n_q(); }
    if (!causal) { return 0; }
    // The tile's last key must be visible to the Q tile's first row q * block_m.
    int const first_row = key_end - 1 - (seqlen_k - seqlen_q);
    return first_row <= 0 ? 0 : imin(n_q(), (first_row + block_m - 1) / block_m);
  }
};

}  // namespace dash_fa3
