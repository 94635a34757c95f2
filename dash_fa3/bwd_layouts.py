"""The fragment order of the backward's dQ tiles, mirror of csrc/common/dq_accum_layout.h.

The backward kernel hands each partial dQ tile (block_m rows x hdim columns,
fp32) to shared memory and adds it into the dQ accumulator in the order of
its MMA accumulator registers, so every thread stores 4 registers with one
conflict-free 128-bit store and the tile moves with one 1-D bulk reduce-add.
``reg_position`` is the (row, column) of each accumulator register (the SM90
WGMMA C layout, with the warpgroups' atoms alternating along the columns when
they split the head dim: two warpgroups, or three at head dim 192,
``warpgroups``), ``reg_offset`` where the kernel stores it.
Rows [q * block_m, (q + 1) * block_m) of a (batch, head) slab of the
accumulator (batch, heads, seqlen_q_rounded, hdim) hold tile q in that order;
the postprocess reads it back. The header documents the order;
tests/test_contract_cpp.py compares this mirror with it on every element.
"""

from __future__ import annotations

import numpy as np

from .schedule import contract

WG_ROWS = 64  # rows of one warpgroup's accumulator (m64nNk16)
WG_THREADS = 128
GROUP = 4  # accumulator registers per 128-bit store


# The N of the SM90 WGMMA shapes CUTLASS offers without its extended shapes, largest first.
ATOM_NS = (256, 192, 128, 96, 64, 32, 16, 8)


def warpgroups(hdim: int) -> int:
    """MMA warpgroups that produce a dQ tile: the backward kernel's (contract.BWD_MMA_WARPGROUPS at
    ``contract.bwd_entry(hdim)``; 0 if none)."""
    entry = contract.bwd_entry(hdim)
    return 0 if entry is None else contract.BWD_MMA_WARPGROUPS[entry]


def wg_cols(block_m: int, hdim: int) -> int:
    """Columns of one warpgroup's accumulator: all of them (block_m 128, two warpgroups along the
    rows) or the warpgroup's share (block_m 64, warpgroups along the columns)."""
    return hdim if block_m == 2 * WG_ROWS else hdim // max(warpgroups(hdim), 1)


def atom_cols(block_m: int, hdim: int) -> int:
    """N of one dQ WGMMA (what cute's ss_op_selector picks for the warpgroup's columns); 0 if none."""
    n = wg_cols(block_m, hdim)
    return next((a for a in ATOM_NS if n > 0 and n % a == 0), 0)


def layout_ok(block_m: int, hdim: int) -> bool:
    w = warpgroups(hdim)
    return (block_m in (WG_ROWS, 2 * WG_ROWS) and hdim > 0 and w > 0 and hdim % w == 0
            and (block_m == WG_ROWS or w == 2) and wg_cols(block_m, hdim) % 8 == 0)


def _check(block_m: int, hdim: int) -> None:
    if not layout_ok(block_m, hdim):
        raise ValueError(f"no dQ fragment order for block_m={block_m}, hdim={hdim}")


def reg_position(block_m: int, hdim: int, wg, tid, r):
    """(row, col) in the tile of accumulator register r of thread tid of warpgroup wg
    (the SM90 WGMMA m64nNk16 C layout); vectorised over arrays."""
    _check(block_m, hdim)
    wg, tid, r = (np.asarray(x, dtype=np.int64) for x in (wg, tid, r))
    warp, lane = tid // 32, tid % 32
    row = 16 * warp + lane // 4 + 8 * ((r >> 1) & 1)
    col = 8 * (r >> 2) + 2 * (lane % 4) + (r & 1)  # warpgroup-local: its atoms side by side
    if block_m == 2 * WG_ROWS:
        return row + WG_ROWS * wg, col
    a = atom_cols(block_m, hdim)  # the warpgroups' atoms alternate along the tile's columns
    return row, (warpgroups(hdim) * (col // a) + wg) * a + col % a


def reg_offset(block_m: int, hdim: int, wg, tid, r):
    """Float offset in the tile where register r of thread tid of warpgroup wg is stored."""
    _check(block_m, hdim)
    wg, tid, r = (np.asarray(x, dtype=np.int64) for x in (wg, tid, r))
    return wg * WG_ROWS * wg_cols(block_m, hdim) + ((r // GROUP) * WG_THREADS + tid) * GROUP + r % GROUP


def dq_frag_offset(block_m: int, hdim: int, m, c):
    """Float offset in the tile of tile-local row m, column c; vectorised over arrays."""
    _check(block_m, hdim)
    m, c = np.asarray(m, dtype=np.int64), np.asarray(c, dtype=np.int64)
    if block_m == 2 * WG_ROWS:
        wg, row, col = m // WG_ROWS, m % WG_ROWS, c
    else:
        a = atom_cols(block_m, hdim)
        atom = c // a
        w = warpgroups(hdim)
        wg, row, col = atom % w, m, (atom // w) * a + c % a
    tid = 32 * (row // 16) + 4 * (row % 8) + (col % 8) // 2
    r = 4 * (col // 8) + 2 * ((row // 8) % 2) + col % 2
    return reg_offset(block_m, hdim, wg, tid, r)


def tile_permutation(block_m: int, hdim: int) -> np.ndarray:
    """(block_m, hdim) array of the fragment-order offset of each (m, c)."""
    m, c = np.meshgrid(np.arange(block_m), np.arange(hdim), indexing="ij")
    return dq_frag_offset(block_m, hdim, m, c)


def to_fragment_order(rows: np.ndarray, block_m: int) -> np.ndarray:
    """Row-major dQ (..., seqlen_rounded, hdim) -> the accumulator's layout (same shape):
    each block_m-row tile rewritten in fragment order."""
    *lead, s, d = rows.shape
    if s % block_m:
        raise ValueError(f"{s} rows are not a whole number of {block_m}-row tiles")
    perm = tile_permutation(block_m, d).ravel()
    tiles = rows.reshape(*lead, s // block_m, block_m * d)
    out = np.empty_like(tiles)
    out[..., perm] = tiles
    return out.reshape(rows.shape)


def from_fragment_order(accum: np.ndarray, block_m: int) -> np.ndarray:
    """Inverse of to_fragment_order: the accumulator's layout -> row-major dQ."""
    *lead, s, d = accum.shape
    if s % block_m:
        raise ValueError(f"{s} rows are not a whole number of {block_m}-row tiles")
    perm = tile_permutation(block_m, d).ravel()
    return accum.reshape(*lead, s // block_m, block_m * d)[..., perm].reshape(accum.shape)


# ---------------------------------------------------------------- packed documents
# Mirror of csrc/common/seqlen_info.h: the backward's statistics rows (LSE,
# dPsum, dQ accumulator, semaphores) of packed documents, (heads, padded total),
# document b from padded row packed_padded_offset(cu[b], b, block_m) on.


def packed_padded_offset(row0: int, b: int, block_m: int) -> int:
    """First padded statistics row of the b-th document, which starts at packed row ``row0``."""
    return (row0 + b * block_m) // block_m * block_m


def packed_rows(cu_seqlens, block_m: int) -> np.ndarray:
    """The packed row of every padded statistics row (-1: padding), for documents at offsets
    ``cu_seqlens`` (batch + 1 entries); its length is the padded total."""
    cu = [int(c) for c in cu_seqlens]
    batch = len(cu) - 1
    rows = np.full(packed_padded_offset(cu[-1], batch, block_m), -1, dtype=np.int64)
    for b in range(batch):
        start = packed_padded_offset(cu[b], b, block_m)
        rows[start:start + cu[b + 1] - cu[b]] = np.arange(cu[b], cu[b + 1])
    return rows
