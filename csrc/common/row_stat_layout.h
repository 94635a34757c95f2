// Order of the per-row statistics of one backward Q tile (log2-domain LSE and
// dPsum, block_m rows each) in global memory (the preprocess writes them so)
// and in the main kernel's shared-memory stages (one bulk copy per tile).
//
// Why not row order: the backward computes S^T and dP^T, whose columns are the
// tile's Q rows. In the SM90 WGMMA accumulator layout the thread with lane
// % 4 = t holds the columns n = 8j + 2t + {0, 1}, j = 0 .. block_m/8 - 1, so
// in row order its block_m/4 statistics are pairs 32 bytes apart: block_m/8
// 64-bit shared loads per statistic and step. Stored here, t's values are
// contiguous (position t * block_m/4 + 2j + (n & 1)): block_m/16 128-bit
// loads, the same 16 bytes for every lane of a given t (a broadcast, one
// wavefront per load), few enough registers to load ahead of the GEMM wait.
//
// Plain C++ (host and device); dash_fa3/bwd_layouts.py mirrors it and
// tests/test_row_stat_layout.py compares the two.
#pragma once

#include "common/host_device.h"

namespace dash_fa3 {

// Quad lanes (lane % 4) of the accumulator layout; each owns block_m/4 rows.
constexpr int kRowStatQuads = 4;

// Position of tile-local row n (0 <= n < block_m, block_m % 8 == 0).
DASH_FA3_HD constexpr int row_stat_pos(int block_m, int n) {
  return (n % 8) / 2 * (block_m / kRowStatQuads) + 2 * (n / 8) + (n & 1);
}

// Inverse: the tile-local row stored at position pos.
DASH_FA3_HD constexpr int row_stat_row(int block_m, int pos) {
  int const run = block_m / kRowStatQuads;
  int const k = pos % run;
  return 8 * (k / 2) + 2 * (pos / run) + (k & 1);
}

}  // namespace dash_fa3
