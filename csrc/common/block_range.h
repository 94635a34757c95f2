// Block ranges of one (batch, head) attention problem: which KV tiles a Q tile
// meets, which Q tiles a KV tile meets, and which tiles need the element mask.
// The forward and the backward kernel and the schedule decode
// (schedules/schedule_metadata.h) all take them from here;
// dash_fa3/schedule/geometry.py TileGeometry is the Python mirror, formula for
// formula, and tests/test_contract_cpp.py compares the two on many shapes.
//
// Masks (bottom-right aligned, as FlashAttention 2.1+ and FA3's windows): with
// off = seqlen_k - seqlen_q, query row i attends key j iff j < seqlen_k and
//   i + off - window_left <= j <= i + off + window_right,
// a side of -1 being unbounded. Full attention is (-1, -1), causal (-1, 0),
// a sliding window anything else. A row that attends no key gets O = 0,
// LSE = -inf; its Q tile may meet no KV tile. Each row sees one contiguous run
// of keys and the runs of consecutive rows overlap or touch, so a Q tile meets
// one contiguous range of KV tiles and a KV tile one contiguous range of Q
// tiles; the ranges below are exact (a tile in range holds at least one
// visible element). Keys no row sees (a bounded left side with seqlen_k -
// seqlen_q > window_left) form a prefix of KV tiles with empty Q ranges; rows
// that see no key (a bounded right side with seqlen_q - seqlen_k > window_right)
// form a prefix of Q tiles with empty KV ranges.
//
// Which tiles need no element mask: every key of the tile is < seqlen_k and
// every row of the tile below seqlen_q sees every key of it. Rows past
// seqlen_q (the ragged last Q tile) are not looked at: the forward does not
// store them, and in the backward their Q and dO are zero-filled, so they add
// nothing to dK, dV.
//
// With the window a compile-time constant ((-1, -1) or (-1, 0) in the full
// and causal kernels) every window test below folds away.
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
  int block_m;       // query rows per tile
  int block_n;       // key rows per tile
  int window_left;   // -1: unbounded
  int window_right;  // -1: unbounded; causal is (-1, 0)

  DASH_FA3_HD int n_q() const { return (seqlen_q + block_m - 1) / block_m; }
  DASH_FA3_HD int n_kv() const { return (seqlen_k + block_n - 1) / block_n; }

  // KV tiles that Q tile q meets.
  DASH_FA3_HD BlockRange kv_range(int q) const {
    int const off = seqlen_k - seqlen_q;
    int end = n_kv();
    if (window_right >= 0) {
      // Last key the tile's last row attends.
      int const reach = imin((q + 1) * block_m, seqlen_q) - 1 + seqlen_k - seqlen_q + window_right;
      end = reach < 0 ? 0 : imin(n_kv(), reach / block_n + 1);
    }
    int begin = 0;
    if (window_left >= 0) {
      // First key the tile's first row attends (if that row is empty, so is
      // everything left of the first non-empty row's keys: begin is 0 then).
      int const first = q * block_m + off - window_left;
      begin = first <= 0 ? 0 : first / block_n;
    }
    return {begin, end};
  }

  // Q tiles that KV tile kv meets.
  DASH_FA3_HD BlockRange q_range(int kv) const {
    int const off = seqlen_k - seqlen_q;
    int begin = 0;
    if (window_right >= 0) {
      // First query row that attends the tile's first key (a first key no row
      // sees makes this <= 0).
      int const first_row = imax(0, kv * block_n - (seqlen_k - seqlen_q) - window_right);
      begin = first_row < seqlen_q ? first_row / block_m : n_q();
    }
    int end = n_q();
    if (window_left >= 0) {
      // Last query row that attends the tile's last key (< 0: no row sees the tile).
      int const last_row = imin((kv + 1) * block_n, seqlen_k) - 1 - off + window_left;
      end = last_row < 0 ? 0 : imin(n_q(), last_row / block_m + 1);
    }
    return {begin, end};
  }

  // KV tiles [begin, end) need no mask with Q tile q (the forward); may be
  // empty, and lies within kv_range(q) when it is not.
  DASH_FA3_HD BlockRange kv_unmasked(int q) const {
    int const off = seqlen_k - seqlen_q;
    int end = seqlen_k / block_n;  // KV tiles without keys past seqlen_k
    if (window_right >= 0) {
      int const seen = q * block_m + seqlen_k - seqlen_q + window_right + 1;  // keys the tile's first row sees
      end = imin(end, seen <= 0 ? 0 : seen / block_n);
    }
    int begin = 0;
    if (window_left >= 0) {
      // Keys below this are hidden from the tile's last row.
      int const lo = imin((q + 1) * block_m, seqlen_q) - 1 + off - window_left;
      begin = lo <= 0 ? 0 : (lo + block_n - 1) / block_n;
    }
    return {begin, end};
  }

  // Q tiles [begin, end) need no mask with KV tile kv (the backward: a compare
  // or two per step); may be empty, and lies within q_range(kv) when it is not.
  DASH_FA3_HD BlockRange q_unmasked(int kv) const { return {q_unmasked_begin(kv), q_unmasked_end(kv)}; }
  DASH_FA3_HD int q_unmasked_begin(int kv) const {
    int const key_end = (kv + 1) * block_n;  // one past the tile's last key
    if (key_end > seqlen_k) { return n_q(); }
    if (window_right < 0) { return 0; }
    // The tile's last key must be visible to the Q tile's first row q * block_m.
    int const first_row = key_end - 1 - (seqlen_k - seqlen_q) - window_right;
    return first_row <= 0 ? 0 : imin(n_q(), (first_row + block_m - 1) / block_m);
  }
  DASH_FA3_HD int q_unmasked_end(int kv) const {
    if ((kv + 1) * block_n > seqlen_k || window_left < 0) { return n_q(); }
    // Rows below this see the tile's first key; a Q tile needs all its rows
    // below seqlen_q there.
    int const rows = kv * block_n - (seqlen_k - seqlen_q) + window_left + 1;
    return rows >= seqlen_q ? n_q() : (rows <= 0 ? 0 : rows / block_m);
  }
};

}  // namespace dash_fa3
