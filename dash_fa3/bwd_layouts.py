"""Python mirrors of the backward kernel's data layouts (numpy only, no torch).

Each definition names the C++ header it mirrors; tests compile that header
with the host compiler and compare.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------
# Row statistics (lse_log2, dPsum) of a Q tile: csrc/common/row_stat_layout.h.
# S^T / dP^T have the tile's Q rows as columns, and the accumulator thread with
# lane % 4 = t holds columns 8j + 2t + {0, 1}; storing those block_m/4 rows
# contiguously lets it load them with 128-bit loads.

ROW_STAT_QUADS = 4


def _check_block_m(block_m: int) -> None:
    if block_m <= 0 or block_m % 8 != 0:
        raise ValueError(f"row statistics need a positive block_m that is a multiple of 8, got {block_m}")


def row_stat_pos(block_m: int, n):
    """Position of tile-local row n (0 <= n < block_m) in its tile's block_m entries."""
    _check_block_m(block_m)
    n = np.asarray(n)
    return (n % 8) // 2 * (block_m // ROW_STAT_QUADS) + 2 * (n // 8) + (n & 1)


def row_stat_row(block_m: int, pos):
    """Inverse of :func:`row_stat_pos`: the tile-local row stored at position pos."""
    _check_block_m(block_m)
    pos = np.asarray(pos)
    run = block_m // ROW_STAT_QUADS
    k = pos % run
    return 8 * (k // 2) + 2 * (pos // run) + (k & 1)


def row_stat_positions(block_m: int, rows: int) -> np.ndarray:
    """Buffer index of each row s in [0, rows) (rows a multiple of block_m, e.g.
    seqlen_q_rounded): ``buf[..., row_stat_positions(bm, rows)]`` is in row order."""
    _check_block_m(block_m)
    if rows % block_m != 0:
        raise ValueError(f"rows ({rows}) must be a multiple of block_m ({block_m})")
    s = np.arange(rows)
    return s - s % block_m + row_stat_pos(block_m, s % block_m)
