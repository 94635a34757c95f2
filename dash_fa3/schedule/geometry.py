"""Tile geometry of the attention backward.

The backward runs one *task* per (batch, q_head, kv_tile).  A task walks the Q
tiles its KV tile interacts with; every such (kv_tile, q_tile) *pair* is one
*step*: compute a partial dQ (cost ``c``), then add it into the fp32 dQ tile
(cost ``r``).

Masks
-----
``full``
    every KV tile meets every Q tile.
``causal``
    bottom-right aligned, as FlashAttention does when ``seqlen_q != seqlen_k``:
    query row ``i`` may attend key column ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
    With ``seqlen_q > seqlen_k`` the first ``seqlen_q - seqlen_k`` query rows
    attend nothing; their Q tiles get no pair and dQ stays zero there.

For both masks the Q tiles of one KV tile form a contiguous range
``[q_begin[kv], n_q)`` and the KV tiles of one Q tile form a prefix
``[0, kv_end[q])``.  Ragged last tiles (seqlen not a multiple of the block) are
included.  A KV tile whose keys are masked for every query gets no pair and no
task (with a bottom-right causal mask that cannot happen: the last query row
sees every key).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

MASKS = ("full", "causal")

# Backward tile sizes (block_m = Q rows per tile, block_n = KV rows per tile)
# per head dim.  64 and 128 follow FlashAttention-3's Hopper backward; the
# others are our choice (registers bound the accumulators, so wider heads get
# narrower tiles).  Head dims between entries round up to the next entry.
BWD_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    64: (128, 128),
    96: (64, 128),
    128: (64, 128),
    192: (64, 96),
    256: (64, 64),
}


def bwd_block_sizes(headdim: int) -> tuple[int, int]:
    """(block_m, block_n) the backward uses for ``headdim``."""
    if headdim <= 0:
        raise ValueError(f"headdim must be positive, got {headdim}")
    for hd in sorted(BWD_BLOCK_SIZES):
        if headdim <= hd:
            return BWD_BLOCK_SIZES[hd]
    raise ValueError(f"headdim {headdim} > {max(BWD_BLOCK_SIZES)} is not supported")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Geometry:
    """Shape of one backward call, in tiles.  Hashable; used as a cache key."""

    batch: int
    heads: int
    heads_kv: int | None
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    mask: str = "full"

    def __post_init__(self):
        if self.heads_kv is None:
            object.__setattr__(self, "heads_kv", self.heads)
        for name in ("batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "block_m", "block_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"Geometry.{name} must be a positive integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.mask not in MASKS:
            raise ValueError(f"Geometry.mask must be one of {MASKS}, got {self.mask!r}")
        if self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of heads_kv ({self.heads_kv})")

    # ------------------------------------------------------------------ shape
    @classmethod
    def from_shape(cls, *, batch: int, heads: int, seqlen_q: int, headdim: int,
                   seqlen_k: int | None = None, heads_kv: int | None = None,
                   causal: bool = False, block_m: int | None = None,
                   block_n: int | None = None) -> "Geometry":
        """Geometry of a real call; block sizes from :func:`bwd_block_sizes`."""
        bm, bn = bwd_block_sizes(headdim)
        return cls(batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=seqlen_q,
                   seqlen_k=seqlen_q if seqlen_k is None else seqlen_k,
                   block_m=block_m or bm, block_n=block_n or bn,
                   mask="causal" if causal else "full")

    @classmethod
    def model(cls, n: int, m: int, mask: str = "full", block: int = 128, n_q: int | None = None) -> "Geometry":
        """The paper's abstraction: one batch, ``m`` heads, ``n`` KV tiles and
        (by default) ``n`` Q tiles of equal size."""
        nq = n if n_q is None else n_q
        return cls(batch=1, heads=m, heads_kv=m, seqlen_q=nq * block, seqlen_k=n * block,
                   block_m=block, block_n=block, mask=mask)

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def n_q(self) -> int:
        return _cdiv(self.seqlen_q, self.block_m)

    @property
    def n_kv(self) -> int:
        return _cdiv(self.seqlen_k, self.block_n)

    @property
    def group(self) -> int:
        """q-heads per kv head (GQA group size)."""
        return self.heads // self.heads_kv

    @property
    def num_heads_total(self) -> int:
        """batch * heads: the number of independent dQ tensors."""
        return self.batch * self.heads

    @property
    def key(self) -> tuple:
        return (self.batch, self.heads, self.heads_kv, self.seqlen_q, self.seqlen_k,
                self.block_m, self.block_n, self.mask)

    # ------------------------------------------------------- integer formulas
    # These scalar functions use only integer ops with non-negative operands
    # for / and %, so they map 1:1 to C; the device mirrors them.
    def kv_end_of(self, q: int) -> int:
        """Number of KV tiles contributing to Q tile ``q``; they are ``[0, kv_end)``."""
        return kv_end_int(q, self.seqlen_q, self.seqlen_k, self.block_m, self.block_n,
                          self.n_kv, int(self.causal))

    def q_begin_of(self, kv: int) -> int:
        """First Q tile KV tile ``kv`` meets (``n_q`` if none)."""
        return int(self.q_begin[kv])

    # --------------------------------------------------------- derived arrays
    @cached_property
    def q_begin(self) -> np.ndarray:
        """int64 [n_kv]: KV tile kv meets Q tiles [q_begin[kv], n_q)."""
        n_q, n_kv = self.n_q, self.n_kv
        if not self.causal:
            out = np.zeros(n_kv, dtype=np.int64)
        else:
            off = self.seqlen_k - self.seqlen_q
            q = np.arange(n_q, dtype=np.int64)
            last_row = np.minimum((q + 1) * self.block_m, self.seqlen_q) - 1
            reach = last_row + off  # last key column the tile's last row attends
            first_col = np.arange(n_kv, dtype=np.int64) * self.block_n
            out = np.searchsorted(reach, first_col, side="left").astype(np.int64)
        out.setflags(write=False)
        return out

    @cached_property
    def kv_end(self) -> np.ndarray:
        """int64 [n_q]: Q tile q receives contributions from KV tiles [0, kv_end[q])."""
        n_q, n_kv = self.n_q, self.n_kv
        if not self.causal:
            out = np.full(n_q, n_kv, dtype=np.int64)
        else:
            off = self.seqlen_k - self.seqlen_q
            q = np.arange(n_q, dtype=np.int64)
            reach = np.minimum((q + 1) * self.block_m, self.seqlen_q) - 1 + off
            out = np.where(reach < 0, 0, np.minimum(n_kv, reach // self.block_n + 1)).astype(np.int64)
        out.setflags(write=False)
        return out

    @cached_property
    def task_len(self) -> np.ndarray:
        """int64 [n_kv]: steps of the task of each KV tile (0: no task)."""
        out = (self.n_q - self.q_begin).astype(np.int64)
        out.setflags(write=False)
        return out

    @property
    def active_kv(self) -> np.ndarray:
        """KV tiles that have at least one pair (a prefix of range(n_kv))."""
        return np.flatnonzero(self.task_len > 0)

    @property
    def pairs_per_head(self) -> int:
        return int(self.task_len.sum())

    @property
    def num_steps(self) -> int:
        return self.pairs_per_head * self.num_heads_total

    @property
    def num_tasks(self) -> int:
        return int((self.task_len > 0).sum()) * self.num_heads_total

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(kv, q) int64 arrays of every pair one head needs, kv-major."""
        lens = self.task_len
        kv = np.repeat(np.arange(self.n_kv, dtype=np.int64), lens)
        starts = np.cumsum(lens) - lens
        q = np.arange(kv.size, dtype=np.int64) - np.repeat(starts, lens) + np.repeat(self.q_begin, lens)
        return kv, q

    def needed_pairs(self) -> set[tuple[int, int]]:
        """The pair set of one head as Python tuples (for small shapes / tests)."""
        kv, q = self.pairs()
        return set(zip(kv.tolist(), q.tolist()))

    # ------------------------------------------------------ element counts
    def valid_elements(self, kv: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Number of (row, col) elements of tile (kv, q) inside both sequences
        and the mask (int64, same shape as ``kv``)."""
        kv = np.asarray(kv, dtype=np.int64)
        q = np.asarray(q, dtype=np.int64)
        r0 = q * self.block_m
        r1 = np.minimum(r0 + self.block_m, self.seqlen_q)
        c0 = kv * self.block_n
        c1 = np.minimum(c0 + self.block_n, self.seqlen_k)
        w = c1 - c0
        if not self.causal:
            return (r1 - r0) * w
        off = self.seqlen_k - self.seqlen_q
        # row i sees clamp(i + off - c0 + 1, 0, w) columns; sum over i in [r0, r1)
        x0 = r0 + off - c0 + 1
        x1 = r1 + off - c0 + 1
        return _clamp_sum(x1, w) - _clamp_sum(x0, w)

    def valid_rows(self, q: np.ndarray) -> np.ndarray:
        q = np.asarray(q, dtype=np.int64)
        return np.minimum(q * self.block_m + self.block_m, self.seqlen_q) - q * self.block_m

    def describe(self) -> str:
        return (f"b={self.batch} h={self.heads} hkv={self.heads_kv} sq={self.seqlen_q} sk={self.seqlen_k} "
                f"bm={self.block_m} bn={self.block_n} {self.mask} -> {self.n_kv} kv x {self.n_q} q tiles")


def _clamp_sum(X: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_{x < X} clamp(x, 0, w) over integers x (only x >= 0 contribute)."""
    X = np.maximum(X, 0)
    small = X * (X - 1) // 2                     # X <= w + 1: 0 + 1 + ... + (X-1)
    big = w * (w + 1) // 2 + (X - w - 1) * w     # X > w + 1
    return np.where(X <= w + 1, small, big)


def kv_end_int(q: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
               n_kv: int, causal: int) -> int:
    """Scalar, C-mirrorable: number of KV tiles contributing to Q tile q."""
    if not causal:
        return n_kv
    last_row = min((q + 1) * block_m, seqlen_q) - 1
    reach = last_row + seqlen_k - seqlen_q
    if reach < 0:
        return 0
    return min(n_kv, reach // block_n + 1)
