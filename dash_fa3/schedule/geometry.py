"""Tile geometry of the attention backward.

The backward runs one *task* per (batch, q_head, kv_tile).  A task walks the Q
tiles its KV tile interacts with; every such (kv_tile, q_tile) *pair* is one
*step*: compute a partial dQ (cost ``c``), then add it into the fp32 dQ tile
(cost ``r``).

Masks (:data:`dash_fa3.variants.MASKS`)
-----
All are FA3's bottom-right aligned windows: with ``off = seqlen_k - seqlen_q``
query row ``i`` attends key ``j`` iff ``i + off - left <= j <= i + off + right``
(a side of -1 unbounded).

``full``
    ``(-1, -1)``: every KV tile meets every Q tile.
``causal``
    ``(-1, 0)``.  With ``seqlen_q > seqlen_k`` the first ``seqlen_q - seqlen_k``
    query rows attend nothing; their Q tiles get no pair and dQ stays zero there.
``local``
    any other ``(left, right)``: a sliding window (or causal with a left bound).

The Q tiles of one KV tile form a contiguous range ``[q_begin[kv], q_end[kv])``
and the KV tiles of one Q tile a contiguous range ``[kv_begin[q], kv_end[q])``
(``q_end = n_q`` and ``kv_begin = 0`` for full and causal).
:class:`TileGeometry` computes these block ranges; it mirrors
``csrc/common/block_range.h``, which both kernels use, formula for formula
(``tests/test_contract_cpp.py`` compares them).  Ragged last tiles (seqlen not
a multiple of the block) are included.  A KV tile whose keys are masked for
every query (a window whose left side hides the first keys from every row)
gets a task without steps: the kernel stores its dK = dV = 0 and computes
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..variants import MASK_WINDOWS, MASKS, fold_causal, mask_of_window
from .contract import BWD_BLOCK_SIZES, bwd_entry, bwd_tiles_chain


def bwd_block_sizes(headdim: int) -> tuple[int, int]:
    """(block_m, block_n) the backward uses for ``headdim`` (:data:`.contract.BWD_BLOCK_SIZES`)."""
    if headdim <= 0:
        raise ValueError(f"headdim must be positive, got {headdim}")
    entry = bwd_entry(headdim)
    if entry is None:
        raise ValueError(f"headdim {headdim} > {max(BWD_BLOCK_SIZES)} is not supported")
    return BWD_BLOCK_SIZES[entry]


def require_kernel_chains(name: str, g: Geometry) -> None:
    """ValueError unless the backward kernel of ``g``'s tiles runs chains (:attr:`.Geometry.kernel_chains`):
    schedule ``name`` chains rows, and is not defined (:data:`.schedules.APPLIES`) for a kernel without them."""
    if not g.kernel_chains:
        dims = [d for d, tiles in BWD_BLOCK_SIZES.items() if tiles == (g.block_m, g.block_n)]
        raise ValueError(f"schedule {name!r} chains a GQA group's heads on one CTA (dK/dV summed in registers), "
                         f"which the backward kernel of head dim {', '.join(map(str, dims))} "
                         f"({g.block_m} x {g.block_n} tiles, three MMA warpgroups) does not run; "
                         f"schedules_for(geometry) lists the schedules it does")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _int(x):
    """Python int for 0-d results (scalar callers), the array otherwise."""
    return int(x) if np.ndim(x) == 0 else x


@dataclass(frozen=True)
class TileGeometry:
    """Block ranges of one (batch, head) problem: which KV tiles a Q tile meets
    and the reverse, and which tiles need the element mask.  The Python mirror
    of ``csrc/common/block_range.h``.

    The mask is FA3's, bottom-right aligned: with ``off = seqlen_k - seqlen_q``
    query row ``i`` sees key ``j < seqlen_k`` iff
    ``i + off - window_left <= j <= i + off + window_right`` (-1: that side
    unbounded); full attention is ``(-1, -1)``, causal ``(-1, 0)``.

    Methods take an int or an int array and return the same kind.  Integer
    formulas only, every ``//`` on non-negative operands (C's truncating
    division agrees).  Ranges are ``(begin, end)``, empty when ``end <= begin``.
    """

    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    window_left: int = -1
    window_right: int = -1

    def __post_init__(self):
        for name in ("window_left", "window_right"):
            w = getattr(self, name)
            # a bool here is an old (..., causal) call: refuse it rather than read True as a window of 1
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < -1:
                raise ValueError(f"TileGeometry.{name} must be an int >= -1 (-1: unbounded), got {w!r}")

    @classmethod
    def of_mask(cls, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> "TileGeometry":
        """Full or causal attention."""
        return cls(seqlen_q, seqlen_k, block_m, block_n, -1, 0 if causal else -1)

    @property
    def causal(self) -> bool:
        """Exactly the causal mask (no left bound)."""
        return self.window_left < 0 and self.window_right == 0

    @property
    def n_q(self) -> int:
        return _cdiv(self.seqlen_q, self.block_m)

    @property
    def n_kv(self) -> int:
        return _cdiv(self.seqlen_k, self.block_n)

    @property
    def _off(self) -> int:
        return self.seqlen_k - self.seqlen_q

    def kv_range(self, q):
        """(begin, end): Q tile ``q`` meets KV tiles [begin, end)."""
        q = np.asarray(q, dtype=np.int64)
        end = np.full_like(q, self.n_kv)
        if self.window_right >= 0:
            # last key the tile's last row attends
            reach = np.minimum((q + 1) * self.block_m, self.seqlen_q) - 1 + self._off + self.window_right
            end = np.where(reach < 0, 0, np.minimum(self.n_kv, np.maximum(reach, 0) // self.block_n + 1))
        begin = np.zeros_like(q)
        if self.window_left >= 0:
            # first key the tile's first row attends
            first = q * self.block_m + self._off - self.window_left
            begin = np.where(first <= 0, 0, np.maximum(first, 0) // self.block_n)
        return _int(begin), _int(end)

    def q_range(self, kv):
        """(begin, end): KV tile ``kv`` meets Q tiles [begin, end)."""
        kv = np.asarray(kv, dtype=np.int64)
        begin = np.zeros_like(kv)
        if self.window_right >= 0:
            # first query row that attends the tile's first key
            first_row = np.maximum(0, kv * self.block_n - self._off - self.window_right)
            begin = np.where(first_row < self.seqlen_q, first_row // self.block_m, self.n_q)
        end = np.full_like(kv, self.n_q)
        if self.window_left >= 0:
            # last query row that attends the tile's last key (< 0: no row sees the tile)
            last_row = np.minimum((kv + 1) * self.block_n, self.seqlen_k) - 1 - self._off + self.window_left
            end = np.where(last_row < 0, 0, np.minimum(self.n_q, np.maximum(last_row, 0) // self.block_m + 1))
        return _int(begin), _int(end)

    def visible(self, rows, keys):
        """Element mask: whether query row ``rows`` sees key ``keys`` (broadcast; not in C++)."""
        i, j = np.broadcast_arrays(np.asarray(rows, dtype=np.int64), np.asarray(keys, dtype=np.int64))
        out = (j >= 0) & (j < self.seqlen_k)
        if self.window_right >= 0:
            out = out & (j <= i + self._off + self.window_right)
        if self.window_left >= 0:
            out = out & (j >= i + self._off - self.window_left)
        return out

    def needs_mask(self, q, kv):
        """Whether tile (q, kv) holds a key past seqlen_k or an element (row < seqlen_q)
        the mask hides (the definition the unmasked ranges below are tested against;
        not in C++)."""
        q, kv = np.broadcast_arrays(np.asarray(q, dtype=np.int64), np.asarray(kv, dtype=np.int64))
        n0 = kv * self.block_n  # the tile's first key
        n1 = n0 + self.block_n - 1  # and last
        r0 = q * self.block_m  # the tile's first row
        r1 = np.minimum(r0 + self.block_m, self.seqlen_q) - 1  # and last below seqlen_q
        out = n1 >= self.seqlen_k
        if self.window_right >= 0:
            out = out | (n1 > r0 + self._off + self.window_right)
        if self.window_left >= 0:
            out = out | (n0 < r1 + self._off - self.window_left)
        return bool(out) if out.ndim == 0 else out

    def kv_unmasked(self, q):
        """(begin, end): KV tiles [begin, end) need no mask with Q tile ``q`` (the forward)."""
        q = np.asarray(q, dtype=np.int64)
        end = np.full_like(q, self.seqlen_k // self.block_n)  # KV tiles without keys past seqlen_k
        if self.window_right >= 0:
            seen = q * self.block_m + self._off + self.window_right + 1  # keys the tile's first row sees
            end = np.minimum(end, np.where(seen <= 0, 0, np.maximum(seen, 0) // self.block_n))
        begin = np.zeros_like(q)
        if self.window_left >= 0:
            # keys below this are hidden from the tile's last row
            lo = np.minimum((q + 1) * self.block_m, self.seqlen_q) - 1 + self._off - self.window_left
            begin = np.where(lo <= 0, 0, (np.maximum(lo, 0) + self.block_n - 1) // self.block_n)
        return _int(begin), _int(end)

    def q_unmasked(self, kv):
        """(begin, end): Q tiles [begin, end) need no mask with KV tile ``kv`` (the backward)."""
        kv = np.asarray(kv, dtype=np.int64)
        key_end = (kv + 1) * self.block_n  # one past the tile's last key
        ragged = key_end > self.seqlen_k
        begin = np.zeros_like(kv)
        if self.window_right >= 0:
            # the tile's last key must be visible to the Q tile's first row
            first_row = key_end - 1 - self._off - self.window_right
            begin = np.where(first_row <= 0, 0,
                             np.minimum(self.n_q, (np.maximum(first_row, 0) + self.block_m - 1) // self.block_m))
        end = np.full_like(kv, self.n_q)
        if self.window_left >= 0:
            # rows below this see the tile's first key; a Q tile needs all its rows below seqlen_q there
            rows = kv * self.block_n - self._off + self.window_left + 1
            end = np.where(rows >= self.seqlen_q, self.n_q, np.where(rows <= 0, 0, np.maximum(rows, 0)
                                                                      // self.block_m))
        return _int(np.where(ragged, self.n_q, begin)), _int(np.where(ragged, self.n_q, end))


@dataclass(frozen=True)
class Geometry:
    """Shape of one backward call, in tiles.  Hashable; used as a cache key.

    ``mask`` is the kernel's mask kind (:data:`MASKS`): ``full`` and ``causal``
    have their fixed windows ``(-1, -1)`` and ``(-1, 0)`` (the fields are
    filled in), ``local`` takes ``window_left`` / ``window_right`` as given.
    """

    batch: int
    heads: int
    heads_kv: int | None
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    mask: str = "full"
    window_left: int = -1
    window_right: int = -1
    #: 2^g > 1: the *grouped* view of a GQA call (:mod:`.grouped`): each head is a KV head that
    #: stands for its group of ``q_interleave`` query heads, and its Q tiles are the group's,
    #: interleaved: tile v is Q tile v // q_interleave of query head v % q_interleave.
    q_interleave: int = 1

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
        for name in ("window_left", "window_right"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < -1:
                raise ValueError(f"Geometry.{name} must be an int >= -1 (-1: unbounded), got {w!r}")
            object.__setattr__(self, name, int(w))
        if self.mask != "local":
            fixed = MASK_WINDOWS[self.mask]
            if self.window_left != -1 or self.window_right not in (-1, fixed[1]):
                raise ValueError(f"Geometry: a {self.mask} mask has the window {fixed}, got "
                                 f"({self.window_left}, {self.window_right}); use mask='local' for other windows")
            object.__setattr__(self, "window_right", fixed[1])
        if self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of heads_kv ({self.heads_kv})")
        qi = self.q_interleave
        if isinstance(qi, bool) or not isinstance(qi, (int, np.integer)) or qi < 1 or qi & (qi - 1):
            raise ValueError(f"Geometry.q_interleave must be a power of two >= 1, got {qi!r}")
        object.__setattr__(self, "q_interleave", int(qi))
        if qi > 1 and self.heads != self.heads_kv:
            raise ValueError("Geometry.q_interleave > 1 is the grouped view of a call: one head per KV head "
                             f"(heads == heads_kv), got {self.heads} / {self.heads_kv}")

    # ------------------------------------------------------------------ shape
    @classmethod
    def from_shape(cls, *, batch: int, heads: int, seqlen_q: int, headdim: int,
                   seqlen_k: int | None = None, heads_kv: int | None = None,
                   causal: bool = False, block_m: int | None = None,
                   block_n: int | None = None, window_size: tuple[int, int] = (-1, -1)) -> "Geometry":
        """Geometry of a real call; block sizes from :func:`bwd_block_sizes`.
        ``window_size`` (left, right) with ``causal`` folded in picks the mask kind
        as the dispatch does (:func:`dash_fa3.variants.mask_of_window`)."""
        bm, bn = bwd_block_sizes(headdim)
        left, right = fold_causal(*(int(w) for w in window_size), causal)
        mask = mask_of_window(left, right)
        return cls(batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=seqlen_q,
                   seqlen_k=seqlen_q if seqlen_k is None else seqlen_k,
                   block_m=block_m or bm, block_n=block_n or bn, mask=mask,
                   window_left=left, window_right=right)

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
    def local(self) -> bool:
        return self.mask == "local"

    @property
    def window(self) -> tuple[int, int]:
        """(left, right), -1 unbounded: (-1, -1) full, (-1, 0) causal."""
        return self.window_left, self.window_right

    @property
    def n_q(self) -> int:
        """Q tiles per head (grouped view: per KV head, its group's)."""
        return self.tiles.n_q * self.q_interleave

    @property
    def n_kv(self) -> int:
        return self.tiles.n_kv

    @property
    def group(self) -> int:
        """q-heads per kv head (GQA group size)."""
        return self.heads // self.heads_kv

    def grouped(self) -> "Geometry":
        """The grouped view of this call (:attr:`q_interleave`): one head per KV head, its group's
        Q tiles interleaved into one range. Needs a power-of-two group."""
        if self.q_interleave > 1:
            return self
        G = self.group
        if G & (G - 1):
            raise ValueError(f"the grouped view needs a power-of-two GQA group, got {self.heads} / {self.heads_kv} "
                             f"query heads per KV head")
        return Geometry(batch=self.batch, heads=self.heads_kv, heads_kv=self.heads_kv, seqlen_q=self.seqlen_q,
                        seqlen_k=self.seqlen_k, block_m=self.block_m, block_n=self.block_n, mask=self.mask,
                        window_left=self.window_left, window_right=self.window_right, q_interleave=G)

    @property
    def kernel_chains(self) -> bool:
        """Whether the backward kernel of these tiles runs chains (schedule columns chain_before /
        chain_after, header dkv_chained): all but head dim 192's three-warpgroup kernel
        (:data:`.contract.BWD_CHAINS`). The chaining schedules (``groups``, ``runs``) need it."""
        return bwd_tiles_chain(self.block_m, self.block_n)

    @property
    def num_heads_total(self) -> int:
        """batch * heads: the number of independent dQ tensors."""
        return self.batch * self.heads

    @property
    def key(self) -> tuple:
        return (self.batch, self.heads, self.heads_kv, self.seqlen_q, self.seqlen_k,
                self.block_m, self.block_n, self.mask, self.window_left, self.window_right, self.q_interleave)

    # ------------------------------------------------------------ block ranges
    @cached_property
    def tiles(self) -> TileGeometry:
        """The per-head block ranges of the query heads (shared with the kernels); the grouped view's
        tile v is their Q tile ``v // q_interleave``."""
        return TileGeometry(self.seqlen_q, self.seqlen_k, self.block_m, self.block_n, self.window_left,
                            self.window_right)

    def real_q(self, q):
        """The query heads' Q tile of tile ``q`` (itself but in the grouped view)."""
        return np.asarray(q, dtype=np.int64) // self.q_interleave if self.q_interleave > 1 else q

    def kv_end_of(self, q: int) -> int:
        """One past the last KV tile contributing to Q tile ``q``; they are ``[kv_begin[q], kv_end)``."""
        return int(self.tiles.kv_range(self.real_q(q))[1])

    def q_begin_of(self, kv: int) -> int:
        """First Q tile KV tile ``kv`` meets (``n_q`` if none)."""
        return int(self.q_begin[kv])

    # --------------------------------------------------------- derived arrays
    @cached_property
    def _q_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        begin, end = self.tiles.q_range(np.arange(self.n_kv, dtype=np.int64))
        end = np.maximum(begin, end)  # an empty range as [b, b)
        begin, end = begin * self.q_interleave, end * self.q_interleave
        begin.setflags(write=False)
        end.setflags(write=False)
        return begin, end

    @cached_property
    def _kv_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        begin, end = self.tiles.kv_range(self.real_q(np.arange(self.n_q, dtype=np.int64)))
        end = np.maximum(begin, end)
        begin.setflags(write=False)
        end.setflags(write=False)
        return begin, end

    @property
    def q_begin(self) -> np.ndarray:
        """int64 [n_kv]: KV tile kv meets Q tiles [q_begin[kv], q_end[kv])."""
        return self._q_ranges[0]

    @property
    def q_end(self) -> np.ndarray:
        """int64 [n_kv]: see :attr:`q_begin` (n_q for full and causal masks)."""
        return self._q_ranges[1]

    @property
    def kv_begin(self) -> np.ndarray:
        """int64 [n_q]: Q tile q receives contributions from KV tiles [kv_begin[q], kv_end[q])
        (0 for full and causal masks)."""
        return self._kv_ranges[0]

    @property
    def kv_end(self) -> np.ndarray:
        """int64 [n_q]: see :attr:`kv_begin`."""
        return self._kv_ranges[1]

    @cached_property
    def task_len(self) -> np.ndarray:
        """int64 [n_kv]: steps of the task of each KV tile (0: its dK = dV = 0, no step)."""
        out = (self.q_end - self.q_begin).astype(np.int64)
        out.setflags(write=False)
        return out

    @property
    def active_kv(self) -> np.ndarray:
        """KV tiles that have at least one pair: all of them, or (a window whose left side
        hides the first keys from every row) a suffix of range(n_kv)."""
        return np.flatnonzero(self.task_len > 0)

    @property
    def pairs_per_head(self) -> int:
        return int(self.task_len.sum())

    @property
    def num_steps(self) -> int:
        return self.pairs_per_head * self.num_heads_total

    @property
    def num_tasks(self) -> int:
        """One task per (batch, head, KV tile), those without pairs included (they store dK = dV = 0)."""
        return self.n_kv * self.num_heads_total

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
        q = np.asarray(self.real_q(q), dtype=np.int64)
        r0 = q * self.block_m
        r1 = np.minimum(r0 + self.block_m, self.seqlen_q)
        c0 = kv * self.block_n
        c1 = np.minimum(c0 + self.block_n, self.seqlen_k)
        w = c1 - c0
        off = self.seqlen_k - self.seqlen_q
        # row i sees the columns [c0, c1) that are <= i + off + right (clamp(i + off + right - c0 + 1, 0, w)
        # of them) minus those < i + off - left (clamp(i + off - left - c0, 0, w)); sum over i in [r0, r1)
        if self.window_right < 0:
            seen = (r1 - r0) * w
        else:
            a = off + self.window_right - c0 + 1
            seen = _clamp_sum(r1 + a, w) - _clamp_sum(r0 + a, w)
        if self.window_left < 0:
            return seen
        a = off - self.window_left - c0
        return seen - (_clamp_sum(r1 + a, w) - _clamp_sum(r0 + a, w))

    def valid_rows(self, q: np.ndarray) -> np.ndarray:
        q = np.asarray(self.real_q(q), dtype=np.int64)
        return np.minimum(q * self.block_m + self.block_m, self.seqlen_q) - q * self.block_m

    def describe(self) -> str:
        mask = f"local{self.window}" if self.local else self.mask
        grouped = f" grouped x{self.q_interleave}" if self.q_interleave > 1 else ""
        return (f"b={self.batch} h={self.heads} hkv={self.heads_kv} sq={self.seqlen_q} sk={self.seqlen_k} "
                f"bm={self.block_m} bn={self.block_n} {mask}{grouped} -> {self.n_kv} kv x {self.n_q} q tiles")


#: Bytes of L2 that heads run side by side in (``interleave``, ``sections``: :func:`head_section`):
#: their Q, dO and fp32 dQ accumulator. 40 MiB of the H100's 50 MB, as FA3's backward scheduler
#: budgets for the same three tensors.
L2_BUDGET = 40 << 20


def head_section(g: "Geometry") -> int:
    """Heads per section of the schedules that run a section's heads side by side: as many as keep
    their Q, dO and fp32 dQ accumulator within L2_BUDGET bytes, in sections of near-equal size."""
    H = g.num_heads_total
    headdim = 64 if g.block_m == 128 else 128  # the tiles' head dim (contract.BWD_BLOCK_SIZES)
    per_head = g.n_q * g.block_m * headdim * (2 + 2 + 4)
    fit = max(1, min(H, L2_BUDGET // max(per_head, 1)))
    sections = -(-H // fit)
    return -(-H // sections)


def _clamp_sum(X: np.ndarray, w: np.ndarray) -> np.ndarray:
    """sum_{x < X} clamp(x, 0, w) over integers x (only x >= 0 contribute)."""
    X = np.maximum(X, 0)
    small = X * (X - 1) // 2                     # X <= w + 1: 0 + 1 + ... + (X-1)
    big = w * (w + 1) // 2 + (X - w - 1) * w     # X > w + 1
    return np.where(X <= w + 1, small, big)

