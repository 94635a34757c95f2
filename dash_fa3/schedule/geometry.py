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
``[0, kv_end[q])``.  :class:`TileGeometry` computes these block ranges; it
mirrors ``csrc/common/block_range.h``, which both kernels use, formula for
formula (``tests/test_contract_cpp.py`` compares them).  Ragged last tiles (seqlen not a multiple of the block) are
included.  A KV tile whose keys are masked for every query gets no pair and no
task (with a bottom-right causal mask that cannot happen: the last query row
sees every key).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .contract import BWD_BLOCK_SIZES

MASKS = ("full", "causal")


def bwd_block_sizes(headdim: int) -> tuple[int, int]:
    """(block_m, block_n) the backward uses for ``headdim`` (:data:`.contract.BWD_BLOCK_SIZES`)."""
    if headdim <= 0:
        raise ValueError(f"headdim must be positive, got {headdim}")
    for hd in sorted(BWD_BLOCK_SIZES):
        if headdim <= hd:
            return BWD_BLOCK_SIZES[hd]
    raise ValueError(f"headdim {headdim} > {max(BWD_BLOCK_SIZES)} is not supported")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _int(x):
    """Python int for 0-d results (scalar callers), the array otherwise."""
    return int(x) if np.ndim(x) == 0 else x


@dataclass(frozen=True)
class TileGeometry:
    """Block ranges of one (batch, head) problem: which KV tiles a Q tile meets
    and the reverse.  The Python mirror of ``csrc/common/block_range.h``.

    Methods take an int or an int array and return the same kind.  Integer
    formulas only, every ``//`` on non-negative operands (C's truncating
    division agrees).  A mask is described by which keys each query row sees;
    a sliding window or documents would change the range begins and ends here
    and nowhere else.
    """

    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    causal: bool

    @property
    def n_q(self) -> int:
        return _cdiv(self.seqlen_q, self.block_m)

    @property
    def n_kv(self) -> int:
        return _cdiv(self.seqlen_k, self.block_n)

    def kv_range(self, q):
        """(begin, end): Q tile ``q`` meets KV tiles [begin, end); empty when end <= begin."""
        q = np.asarray(q, dtype=np.int64)
        begin = np.zeros_like(q)
        if not self.causal:
            return _int(begin), _int(np.full_like(q, self.n_kv))
        # last key column the tile's last row attends
        reach = np.minimum((q + 1) * self.block_m, self.seqlen_q) - 1 + self.seqlen_k - self.seqlen_q
        end = np.where(reach < 0, 0, np.minimum(self.n_kv, np.maximum(reach, 0) // self.block_n + 1))
        return _int(begin), _int(end)

    def q_range(self, kv):
        """(begin, end): KV tile ``kv`` meets Q tiles [begin, end); empty when end <= begin."""
        kv = np.asarray(kv, dtype=np.int64)
        end = np.full_like(kv, self.n_q)
        if not self.causal:
            return _int(np.zeros_like(kv)), _int(end)
        # first query row that attends the tile's first key
        first_row = np.maximum(0, kv * self.block_n - (self.seqlen_k - self.seqlen_q))
        begin = np.where(first_row < self.seqlen_q, first_row // self.block_m, self.n_q)
        return _int(begin), _int(end)

    def needs_mask(self, q, kv):
        """Whether tile (q, kv) holds a key past seqlen_k or an element the mask hides
        (the definition the two prefixes below are tested against; not in C++)."""
        q, kv = np.broadcast_arrays(np.asarray(q, dtype=np.int64), np.asarray(kv, dtype=np.int64))
        n0 = kv * self.block_n  # the tile's first key
        out = n0 + self.block_n > self.seqlen_k
        if self.causal:
            out = out | (n0 + self.block_n - 1 > q * self.block_m + (self.seqlen_k - self.seqlen_q))
        return bool(out) if out.ndim == 0 else out

    def kv_unmasked_end(self, q):
        """KV tiles [0, end) need no mask with Q tile ``q`` (the forward)."""
        q = np.asarray(q, dtype=np.int64)
        whole = self.seqlen_k // self.block_n  # KV tiles without keys past seqlen_k
        if not self.causal:
            return _int(np.full_like(q, whole))
        seen = q * self.block_m + self.seqlen_k - self.seqlen_q + 1  # keys the tile's first row sees
        return _int(np.minimum(whole, np.where(seen <= 0, 0, np.maximum(seen, 0) // self.block_n)))

    def q_unmasked_begin(self, kv):
        """Q tiles [begin, n_q) need no mask with KV tile ``kv`` (the backward)."""
        kv = np.asarray(kv, dtype=np.int64)
        key_end = (kv + 1) * self.block_n  # one past the tile's last key
        if not self.causal:
            return _int(np.where(key_end > self.seqlen_k, self.n_q, 0))
        # the tile's last key must be visible to the Q tile's first row
        first_row = key_end - 1 - (self.seqlen_k - self.seqlen_q)
        begin = np.where(first_row <= 0, 0, np.minimum(self.n_q, (np.maximum(first_row, 0) + self.block_m - 1)
                                                       // self.block_m))
        return _int(np.where(key_end > self.seqlen_k, self.n_q, begin))


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
        return self.tiles.n_q

    @property
    def n_kv(self) -> int:
        return self.tiles.n_kv

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

    # ------------------------------------------------------------ block ranges
    @cached_property
    def tiles(self) -> TileGeometry:
        """The per-head block ranges (shared with the kernels)."""
        return TileGeometry(self.seqlen_q, self.seqlen_k, self.block_m, self.block_n, self.causal)

    def kv_end_of(self, q: int) -> int:
        """Number of KV tiles contributing to Q tile ``q``; they are ``[0, kv_end)``."""
        return self.tiles.kv_range(q)[1]

    def q_begin_of(self, kv: int) -> int:
        """First Q tile KV tile ``kv`` meets (``n_q`` if none)."""
        return int(self.q_begin[kv])

    # --------------------------------------------------------- derived arrays
    @cached_property
    def q_begin(self) -> np.ndarray:
        """int64 [n_kv]: KV tile kv meets Q tiles [q_begin[kv], n_q)."""
        out = self.tiles.q_range(np.arange(self.n_kv, dtype=np.int64))[0]
        out.setflags(write=False)
        return out

    @cached_property
    def kv_end(self) -> np.ndarray:
        """int64 [n_q]: Q tile q receives contributions from KV tiles [0, kv_end[q])."""
        out = self.tiles.kv_range(np.arange(self.n_q, dtype=np.int64))[1]
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

