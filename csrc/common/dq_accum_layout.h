// The fragment order of a dQ tile: how the backward kernel's partial dQ sits
// in shared memory (sdQ) and, tile by tile, in the fp32 dQ accumulator; the
// postprocess reads it back. dash_fa3/bwd_layouts.py is the Python mirror;
// tests/test_contract_cpp.py compares the two on every (m, c) of each head dim,
// and the mirror with the register layout of cute's own TiledMmaDq.
//
// Why not row-major: the MMA threads then wrote their accumulator pairs with
// 64-bit shared stores into a 128-byte-swizzled tile, each a 2-way bank
// conflict (rows r and r^1 of the accumulator hit the same banks). In fragment
// order a thread's 4 consecutive accumulator registers are 4 consecutive
// floats and a warp's 128-bit stores cover 512 contiguous bytes: conflict-free.
// The tile is then one contiguous block of block_m * hdim floats, which a
// plain 1-D bulk reduce-add moves to global memory (no tensor map).
//
// The order. A (block_m, hdim) tile is the product of the kernel's W MMA
// warpgroups (W = bwd_mma_warpgroups(hdim), kernel_contract.h: 3 at hdim 192,
// else 2; TiledMmaDq in kernels/bwd/bwd_traits.h), each a 64 x N accumulator
// made of WGMMA m64nAk16 instructions ("atoms") side by side along N:
//   block_m == 128 (W = 2): N = hdim; warpgroup w owns rows [64w, 64w + 64) x all columns;
//   block_m == 64:  N = hdim / W; warpgroup w owns all 64 rows x the column
//                   atoms k with k % W == w, i.e. columns [(W j + w) A, (W j + w + 1) A)
//                   for its j-th atom. When A == N (hdim 128, 192, 256) that is
//                   the contiguous part [w N, (w + 1) N); at hdim 96 cute picks
//                   A = 16 for N = 48 (no 48-wide atom without CUTLASS's extended
//                   shapes), so warpgroup 0 owns columns 0-15, 32-47, 64-79.
// A = dq_frag_atom_cols (bwd_traits.h checks it against TiledMmaDq's atom).
// Thread tid (0..127; warp = tid / 32, lane = tid % 32) of a warpgroup holds
// registers r = 0 .. N/2 - 1 (the SM90 WGMMA C layout, atoms one after the other)
// at warpgroup-local
//   row = 16 warp + lane / 4 + 8 ((r >> 1) & 1)
//   col = 8 (r >> 2) + 2 (lane % 4) + (r & 1)      (col j A + x is x of atom j)
// and register group g = r >> 2 (4 consecutive registers) of thread tid is
// stored at float offset
//   w * 64 * N + (g * 128 + tid) * 4 + (r & 3).
// So the 16 floats from dq_frag_offset(m, c) with m % 16 < 8 and c % 8 == 0
// hold rows m and m + 8 x columns c .. c + 7: float4 k is
// (m, c + 2k), (m, c + 2k + 1), (m + 8, c + 2k), (m + 8, c + 2k + 1).
// Rows and columns place independently: the offset of (m, c) is that of
// (m, 0) plus that of (0, c), which the postprocess uses (its threads keep one
// column chunk) and tests/test_contract_cpp.py checks.
//
// Defined for block_m in {64, 128} with N a multiple of 8 (the smallest
// atom): the head dims of the backward kernels (64, 96, 128, 192, 256).
// Others (e.g. hdim 72 with block_m 64: N = 36) are rejected by
// dq_frag_layout_ok.
//
// Plain C++ (host + device): every / and % has non-negative operands.
#pragma once

#include "common/host_device.h"
#include "kernel_contract.h"  // generated: bwd_mma_warpgroups

namespace dash_fa3 {

constexpr int kDqFragWgRows = 64;       // rows of one warpgroup's accumulator (m64nNk16)
constexpr int kDqFragWgThreads = 128;   // threads of a warpgroup
constexpr int kDqFragGroup = 4;         // registers per group: one 128-bit store

// MMA warpgroups that produce a dQ tile of this head dim.
DASH_FA3_HD constexpr int dq_frag_warpgroups(int hdim) { return bwd_mma_warpgroups(hdim); }

// Columns of one warpgroup's accumulator.
DASH_FA3_HD constexpr int dq_frag_wg_cols(int block_m, int hdim) {
  return block_m == 2 * kDqFragWgRows ? hdim : dq_frag_warpgroups(hdim) > 0 ? hdim / dq_frag_warpgroups(hdim) : 0;
}

// Whether the fragment order is defined for this tile.
DASH_FA3_HD constexpr bool dq_frag_layout_ok(int block_m, int hdim) {
  return (block_m == kDqFragWgRows || (block_m == 2 * kDqFragWgRows && dq_frag_warpgroups(hdim) == 2)) &&
         hdim > 0 && dq_frag_warpgroups(hdim) > 0 && hdim % dq_frag_warpgroups(hdim) == 0 &&
         dq_frag_wg_cols(block_m, hdim) % 8 == 0;
}

// A, the N of one dQ WGMMA: the largest N among the SM90 shapes that CUTLASS
// offers without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED which divides the
// warpgroup's columns (what cute's ss_op_selector picks). 0 if none.
DASH_FA3_HD constexpr int dq_frag_atom_cols(int block_m, int hdim) {
  int const n = dq_frag_wg_cols(block_m, hdim);
  return n % 256 == 0 ? 256 : n % 192 == 0 ? 192 : n % 128 == 0 ? 128 : n % 96 == 0 ? 96
       : n % 64 == 0 ? 64 : n % 32 == 0 ? 32 : n % 16 == 0 ? 16 : n % 8 == 0 ? 8 : 0;
}

// Float offset of warpgroup wg's region in the tile.
DASH_FA3_HD constexpr int dq_frag_wg_base(int block_m, int hdim, int wg) {
  return wg * kDqFragWgRows * dq_frag_wg_cols(block_m, hdim);
}

// Float offset, within its warpgroup's region, of register r of thread tid
// (0..127) of the warpgroup.
DASH_FA3_HD constexpr int dq_frag_reg_offset(int tid, int r) {
  return ((r / kDqFragGroup) * kDqFragWgThreads + tid) * kDqFragGroup + r % kDqFragGroup;
}

// Float offset in the tile of tile-local row m (0 .. block_m-1), column c
// (0 .. hdim-1). Inverts the accumulator's (w, tid, r) -> (row, col) above.
DASH_FA3_HD constexpr int dq_frag_offset(int block_m, int hdim, int m, int c) {
  bool const split_m = block_m == 2 * kDqFragWgRows;
  int const a = dq_frag_atom_cols(block_m, hdim);
  int const atom = c / a;  // along the tile's columns
  int const w = dq_frag_warpgroups(hdim);
  int const wg = split_m ? m / kDqFragWgRows : atom % w;
  // Warpgroup-local row and column (its atoms side by side).
  int const row = m % kDqFragWgRows;
  int const col = split_m ? c : (atom / w) * a + c % a;
  int const tid = 32 * (row / 16) + 4 * (row % 8) + (col % 8) / 2;
  int const r = 4 * (col / 8) + 2 * ((row / 8) % 2) + col % 2;
  return dq_frag_wg_base(block_m, hdim, wg) + dq_frag_reg_offset(tid, r);
}

}  // namespace dash_fa3
