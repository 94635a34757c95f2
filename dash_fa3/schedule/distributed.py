"""Sequence-parallel attention schedules as data (pure Python + numpy).

``dash_fa3.distributed`` runs attention over P ranks that each hold a slice of
the sequence. What it runs is one of the schedules built here; docs/distributed.md
explains the design. In short:

* The sequence is cut into blocks of ``G = 128`` tokens whatever P is.
* A *fold* is one block's complete fp32 reduction: ``fwd_q`` (the output row of a
  query block: online softmax over the key blocks it sees, ascending),
  ``bwd_dq`` (dQ of a query block, ascending key blocks) and ``bwd_dkv`` (dK/dV
  of a key block, ascending query blocks). Every fold runs on ONE rank, so the
  floating-point operations behind each output element are the same for every P:
  that is where the bitwise invariance comes from.
* A schedule is a list of :class:`Work` items -- ``(kind, block, rank, step, lo,
  hi)``: at ``step``, ``rank`` advances the fold ``(kind, block)`` over partner
  blocks ``[lo, hi)`` -- and a list of :class:`Transfer` records -- ``(kind, lo,
  hi, src, dst, step)``: at ``step``, ``src`` sends the data bundle ``kind`` of
  blocks ``[lo, hi)`` to ``dst``.

Step semantics (what :func:`validate` checks and ``dash_fa3.distributed`` runs):
at step t every rank posts the transfers of step t it takes part in, computes
its work items of step t, then waits for those transfers. A work item at step t
may use data its rank owns, produced at a step < t, or received at a step < t;
a transfer at step t may send data the sender holds by then -- or receives in
the same step (a relay), which puts it in a later *wave* of that step: waves
are posted in order, each after the previous one completed. Transfers are
posted by both sides at the same step, so there is no cross-step waiting; a
relay cycle inside one step is the one way to deadlock, and is refused.

Data bundles (per block): ``q`` (forward query), ``kv`` (key and value),
``qrow`` (backward: query, dO, LSE and delta = rowsum(dO * O)), and the
results ``o`` (output and LSE), ``dq``, ``dkv``.

The CLI (``python -m dash_fa3.schedule.distributed --P 8 --seqlen 131072``)
builds, validates and simulates schedules with an alpha-beta communication model.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

G = 128  # block granularity in tokens; fixed so the fold structure never depends on P

PASSES = ("fwd", "bwd")
LAYOUTS = ("contiguous", "zigzag")
ASSIGNMENTS = ("helper_worker", "owner")
# named (layout, assignment) pairs: helper_worker is the default (DistFlashAttn), zigzag the comparison,
# no_balance the unbalanced baseline (every rank computes its own contiguous rows)
PRESETS = {"helper_worker": ("contiguous", "helper_worker"),
           "zigzag": ("zigzag", "owner"),
           "no_balance": ("contiguous", "owner")}
DEFAULT_ASSIGNMENT = {"contiguous": "helper_worker", "zigzag": "owner"}
# Each holder sends one piece of data to at most this many ranks per step; further copies go through
# relay trees one step earlier per level (see _relay_trees). The model prefers 2 at P >= 8.
DEFAULT_FANOUT = 2

FOLD_KINDS = ("fwd_q", "bwd_dq", "bwd_dkv")
PASS_FOLDS = {"fwd": ("fwd_q",), "bwd": ("bwd_dq", "bwd_dkv")}
DATA_KINDS = ("q", "kv", "qrow", "o", "dq", "dkv")
PASS_INPUTS = {"fwd": ("q", "kv"), "bwd": ("kv", "qrow")}
PASS_RESULTS = {"fwd": ("o",), "bwd": ("dq", "dkv")}
OWN = {"fwd_q": "q", "bwd_dq": "qrow", "bwd_dkv": "kv"}        # the fold's own block's data
PARTNER = {"fwd_q": "kv", "bwd_dq": "kv", "bwd_dkv": "qrow"}   # its partner blocks' data
RESULT = {"fwd_q": "o", "bwd_dq": "dq", "bwd_dkv": "dkv"}
GEMMS = {"fwd_q": 2, "bwd_dq": 3, "bwd_dkv": 4}                 # block GEMMs per tile when computed alone
PARTNER_NAME = {"fwd_q": "kv", "bwd_dq": "kv", "bwd_dkv": "q"}  # for messages: "kv block 3" / "q block 3"

_INF = np.iinfo(np.int32).max


class Work(NamedTuple):
    kind: str    # fwd_q | bwd_dq | bwd_dkv
    block: int   # the fold's block: a query block (fwd_q, bwd_dq) or a key block (bwd_dkv)
    rank: int
    step: int
    lo: int      # partner blocks [lo, hi), folded in ascending order
    hi: int


class Transfer(NamedTuple):
    kind: str    # one of DATA_KINDS
    lo: int      # blocks [lo, hi)
    hi: int
    src: int
    dst: int
    step: int


class DistScheduleError(ValueError):
    """A distributed schedule failed validation and must not be executed."""


# ----------------------------------------------------------------------------------------- layouts

def check_seqlen(seqlen, num_ranks, block: int = G) -> int:
    """The number of blocks of a global sequence of ``seqlen`` tokens over ``num_ranks``
    ranks; ValueError (saying which lengths work) unless seqlen is a multiple of 2*P*G."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"the number of ranks must be a positive int, got {num_ranks!r}")
    unit = 2 * int(num_ranks) * block
    if isinstance(seqlen, bool) or not isinstance(seqlen, (int, np.integer)) or seqlen <= 0 or seqlen % unit:
        hint = f"{unit}, {2 * unit}, {3 * unit}, ..."
        if isinstance(seqlen, (int, np.integer)) and seqlen > unit:
            below = seqlen // unit * unit
            hint += f" (nearest: {below} or {below + unit})"
        raise ValueError(f"sequence length {seqlen!r} does not split into whole {block}-token blocks over "
                         f"{num_ranks} ranks: the total length must be a multiple of 2*P*{block} = {unit}: {hint}")
    return int(seqlen) // block


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    return layout


def chunk_bounds(layout: str, num_ranks: int, num_blocks: int) -> np.ndarray:
    """Chunk boundaries in blocks (ascending, len C+1). A chunk is one owner's run of blocks and
    the unit of a step: step s+1 folds partner chunk s."""
    _check_layout(layout)
    parts = num_ranks if layout == "contiguous" else 2 * num_ranks
    if num_blocks % parts:
        raise ValueError(f"{num_blocks} blocks do not split into {parts} chunks")
    return np.arange(parts + 1, dtype=np.int64) * (num_blocks // parts)


def chunk_owners(layout: str, num_ranks: int) -> np.ndarray:
    """Owner rank of each chunk: contiguous, rank r owns chunk r; zigzag, rank r owns chunks
    r and 2P-1-r of 2P (each rank gets one early and one late chunk, which balances causal work)."""
    _check_layout(layout)
    if layout == "contiguous":
        return np.arange(num_ranks, dtype=np.int64)
    i = np.arange(2 * num_ranks, dtype=np.int64)
    return np.where(i < num_ranks, i, 2 * num_ranks - 1 - i)


def block_owners(layout: str, num_ranks: int, num_blocks: int) -> np.ndarray:
    cb = chunk_bounds(layout, num_ranks, num_blocks)
    return np.repeat(chunk_owners(layout, num_ranks), np.diff(cb))


def local_blocks(layout: str, num_ranks: int, num_blocks: int, rank: int) -> np.ndarray:
    """The global blocks rank ``rank`` holds, in its local order (ascending)."""
    return np.flatnonzero(block_owners(layout, num_ranks, num_blocks) == rank)


def block_runs(blocks) -> list[tuple[int, int]]:
    """Ascending global blocks as maximal [lo, hi) runs of consecutive ones."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return [(lo, hi) for lo, hi in runs]


def fold_range(kind: str, block: int, num_blocks: int, causal: bool) -> tuple[int, int]:
    """Partner blocks [lo, hi) the fold needs. Causal (seqlen_q == seqlen_k): query block i sees key
    blocks 0..i; key block j is seen by query blocks j..nb-1."""
    if not causal:
        return 0, num_blocks
    return (0, block + 1) if kind in ("fwd_q", "bwd_dq") else (block, num_blocks)


def _fold_ranges(kinds: np.ndarray, blocks: np.ndarray, num_blocks: int, causal: bool):
    if not causal:
        return np.zeros_like(blocks), np.full_like(blocks, num_blocks)
    is_row = kinds != FOLD_KINDS.index("bwd_dkv")
    return np.where(is_row, 0, blocks), np.where(is_row, blocks + 1, num_blocks)


# ---------------------------------------------------------------------------------------- schedule

def _kind_codes(names, table) -> np.ndarray:
    return np.array([table.index(n) for n in names], dtype=np.int64)


@dataclass(eq=False)
class DistSchedule:
    """One pass (fwd or bwd) of a distributed schedule. ``works`` and ``transfers`` are int64
    arrays with one row per record (the kind as an index into FOLD_KINDS / DATA_KINDS);
    :meth:`work_list` / :meth:`transfer_list` give the records as named tuples."""

    pass_: str
    num_ranks: int
    num_blocks: int
    causal: bool
    layout: str
    assignment: str
    works: np.ndarray       # (n, 6): kind, block, rank, step, lo, hi
    transfers: np.ndarray   # (m, 6): kind, lo, hi, src, dst, step
    fanout: int | None = None
    owner: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.works = np.asarray(self.works, dtype=np.int64).reshape(-1, 6)
        self.transfers = np.asarray(self.transfers, dtype=np.int64).reshape(-1, 6)
        self.owner = block_owners(self.layout, self.num_ranks, self.num_blocks)

    @property
    def name(self) -> str:
        for preset, pair in PRESETS.items():
            if pair == (self.layout, self.assignment):
                return preset
        return f"{self.layout}/{self.assignment}"

    @property
    def seqlen(self) -> int:
        return self.num_blocks * G

    @property
    def num_steps(self) -> int:
        last = [a[:, c].max() for a, c in ((self.works, 3), (self.transfers, 5)) if len(a)]
        return int(max(last)) + 1 if last else 0

    def describe(self) -> str:
        return (f"{self.name} {self.pass_} schedule, P={self.num_ranks}, {self.num_blocks} blocks "
                f"({self.seqlen} tokens), {'causal' if self.causal else 'full'}")

    def work_list(self) -> list[Work]:
        return [Work(FOLD_KINDS[k], b, r, s, lo, hi) for k, b, r, s, lo, hi in self.works.tolist()]

    def transfer_list(self) -> list[Transfer]:
        return [Transfer(DATA_KINDS[k], lo, hi, s, d, t) for k, lo, hi, s, d, t in self.transfers.tolist()]

    def with_records(self, works=None, transfers=None) -> "DistSchedule":
        """A copy with other works / transfers (lists of Work / Transfer, or arrays)."""
        def arr(x, table, kind_col):
            if x is None or isinstance(x, np.ndarray):
                return x
            rows = [list(r) for r in x]
            for r in rows:
                r[kind_col] = table.index(r[kind_col]) if isinstance(r[kind_col], str) else r[kind_col]
            return np.array(rows, dtype=np.int64).reshape(-1, 6)
        return replace(self, works=self.works if works is None else arr(works, FOLD_KINDS, 0),
                       transfers=self.transfers if transfers is None else arr(transfers, DATA_KINDS, 0))


def _assign(pass_: str, num_ranks: int, num_blocks: int, causal: bool, layout: str, assignment: str):
    """(kinds, blocks, ranks) of every fold. ``owner``: each fold on its block's owner.
    ``helper_worker`` (DistFlashAttn's load balancing at fold granularity): rank a and rank P-1-a
    form a pair (the middle rank of an odd P stays alone); the more loaded one hands whole folds
    -- largest first -- to its partner while that narrows the gap. The helper computes the
    complete fold and sends the finished result back."""
    kinds = np.repeat(_kind_codes(PASS_FOLDS[pass_], FOLD_KINDS), num_blocks)
    blocks = np.tile(np.arange(num_blocks, dtype=np.int64), len(PASS_FOLDS[pass_]))
    owner = block_owners(layout, num_ranks, num_blocks)
    ranks = owner[blocks].copy()
    if assignment == "owner":
        return kinds, blocks, ranks
    lo, hi = _fold_ranges(kinds, blocks, num_blocks, causal)
    gemms = np.array([GEMMS[k] for k in FOLD_KINDS], dtype=np.int64)[kinds]
    cost = (hi - lo) * gemms
    load = np.bincount(ranks, weights=cost, minlength=num_ranks).astype(np.int64)
    for a in range(num_ranks // 2):
        b = num_ranks - 1 - a
        heavy, light = (a, b) if load[a] >= load[b] else (b, a)
        cand = np.flatnonzero(ranks == heavy)
        cand = cand[np.argsort(-cost[cand], kind="stable")]
        for f in cand:  # moves that narrow the gap without overshooting
            c = cost[f]
            if load[light] + c <= load[heavy] - c:
                ranks[f] = light
                load[heavy] -= c
                load[light] += c
        rest = cand[ranks[cand] == heavy]
        if len(rest):  # one last move may overshoot if it still lowers the pair's maximum
            new_max = np.maximum(load[heavy] - cost[rest], load[light] + cost[rest])
            f = rest[int(np.argmin(new_max))]
            if new_max.min() < load[heavy]:
                ranks[f] = light
                load[heavy] -= cost[f]
                load[light] += cost[f]
        _swap_to_balance(a, b, ranks, owner[blocks], cost, load)
    return kinds, blocks, ranks


def _swap_to_balance(a: int, b: int, ranks, owner, cost, load, rounds: int = 4):
    """When the gap left is below any single fold's cost, exchange two of the pair's folds (one each
    way; a fold may go back to its owner) whose cost difference is closest to half the gap."""
    for _ in range(rounds):
        heavy, light = (a, b) if load[a] >= load[b] else (b, a)
        gap = load[heavy] - load[light]
        pair = (owner == a) | (owner == b)
        hs = np.flatnonzero((ranks == heavy) & pair)
        ls = np.flatnonzero((ranks == light) & pair)
        if gap <= 1 or not len(hs) or not len(ls):
            return
        ls = ls[np.argsort(cost[ls], kind="stable")]
        lc = cost[ls]
        want = cost[hs] - gap / 2.0                 # the light fold's ideal cost for each heavy fold
        j = np.clip(np.searchsorted(lc, want), 1, len(lc)) - 1
        j = np.where((j + 1 < len(lc)) & (np.abs(lc[np.minimum(j + 1, len(lc) - 1)] - want) < np.abs(lc[j] - want)),
                     j + 1, j)
        delta = cost[hs] - lc[j]                    # what moves from heavy to light
        new_gap = np.abs(gap - 2 * delta)
        best = int(np.argmin(new_gap))
        if new_gap[best] >= gap:
            return
        f, g = hs[best], ls[j[best]]
        ranks[f], ranks[g] = light, heavy
        load[heavy] -= delta[best]
        load[light] += delta[best]


def _runs(keys: np.ndarray, blocks: np.ndarray):
    """Group sorted rows into runs of consecutive blocks with equal keys: (first row, lo, hi) per run."""
    n = len(blocks)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    brk = np.ones(n, dtype=bool)
    brk[1:] = (np.diff(blocks) != 1) | np.any(keys[1:] != keys[:-1], axis=1)
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], n)
    return starts, blocks[starts], blocks[ends - 1] + 1


def build(num_ranks: int, seqlen: int, *, causal: bool, pass_: str, layout: str = "contiguous",
          assignment: str | None = None, fanout: int | None = DEFAULT_FANOUT) -> DistSchedule:
    """Build one pass of a distributed schedule (not validated: see :func:`get_schedule`).

    Steps: the partner blocks of chunk s (see :func:`chunk_bounds`) are folded at step s+1 by
    every rank that needs them, and sent at step s (the step before, so the transfer overlaps
    the compute of the previous chunk). Step 0 only moves data. A result computed away from its
    block's owner goes back the step after the fold's last item. ``fanout`` caps how many ranks
    one holder sends the same data to per step: further copies are relayed along a tree whose
    levels run in earlier steps (:func:`_relay_trees`); None sends every copy from the owner.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    _check_layout(layout)
    assignment = DEFAULT_ASSIGNMENT[layout] if assignment is None else assignment
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"unknown assignment {assignment!r}; choose from {', '.join(ASSIGNMENTS)}")
    if fanout is not None and (isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1):
        raise ValueError(f"fanout must be a positive int or None, got {fanout!r}")
    nb = check_seqlen(seqlen, num_ranks)
    P = num_ranks
    owner = block_owners(layout, P, nb)
    cb = chunk_bounds(layout, P, nb)

    kinds, blocks, ranks = _assign(pass_, P, nb, causal, layout, assignment)
    flo, fhi = _fold_ranges(kinds, blocks, nb, causal)
    # one work item per (fold, partner chunk it touches)
    c0 = np.searchsorted(cb, flo, side="right") - 1
    c1 = np.searchsorted(cb, fhi - 1, side="right") - 1
    n = c1 - c0 + 1
    rep = np.repeat(np.arange(len(kinds)), n)
    ci = np.repeat(c0, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
    works = np.stack([kinds[rep], blocks[rep], ranks[rep], ci + 1,
                      np.maximum(flo[rep], cb[ci]), np.minimum(fhi[rep], cb[ci + 1])], axis=1)
    first_step = c0 + 1
    last_step = c1 + 1

    # need[r, kind, block]: the first step rank r uses that block's data
    need = np.full((P, len(DATA_KINDS), nb), _INF, dtype=np.int64)
    pk = _kind_codes([PARTNER[k] for k in FOLD_KINDS], DATA_KINDS)[works[:, 0]]
    order = np.lexsort((works[:, 4], works[:, 3], pk, works[:, 2]))
    w = works[order]
    gkey = np.stack([w[:, 2], pk[order], w[:, 3]], axis=1)
    gstart = np.flatnonzero(np.r_[True, np.any(gkey[1:] != gkey[:-1], axis=1)])
    glo = np.minimum.reduceat(w[:, 4], gstart)
    ghi = np.maximum.reduceat(w[:, 5], gstart)
    # every (rank, kind, step) group's ranges must be one interval (they are: within one chunk, row
    # ranges share their start and column ranges their end), so [min lo, max hi) sends nothing extra
    gid = np.repeat(np.arange(len(gstart)), np.diff(np.r_[gstart, len(w)]))
    runmax = np.maximum.accumulate(w[:, 5] + gid * (nb + 1))
    assert np.all((w[1:, 4] + gid[1:] * (nb + 1) <= runmax[:-1]) | (gid[1:] != gid[:-1]))
    for (r, k, s), lo, hi in zip(gkey[gstart].tolist(), glo.tolist(), ghi.tolist()):
        np.minimum(need[r, k, lo:hi], s, out=need[r, k, lo:hi])
    own_k = _kind_codes([OWN[k] for k in FOLD_KINDS], DATA_KINDS)[kinds]
    away = ranks != owner[blocks]
    np.minimum.at(need, (ranks[away], own_k[away], blocks[away]), first_step[away])

    r_idx, k_idx, b_idx = np.nonzero(need < _INF)
    keep = owner[b_idx] != r_idx
    r_idx, k_idx, b_idx = r_idx[keep], k_idx[keep], b_idx[keep]
    src, step = owner[b_idx], need[r_idx, k_idx, b_idx] - 1
    order = np.lexsort((b_idx, step, src, k_idx, r_idx))
    keys = np.stack([r_idx, k_idx, src, step], axis=1)[order]
    starts, lo, hi = _runs(keys, b_idx[order])
    inputs = np.stack([keys[starts, 1], lo, hi, keys[starts, 2], keys[starts, 0], keys[starts, 3]], axis=1)

    res_k = _kind_codes([RESULT[k] for k in FOLD_KINDS], DATA_KINDS)[kinds]
    order = np.lexsort((blocks[away], (last_step + 1)[away], owner[blocks][away], ranks[away], res_k[away]))
    keys = np.stack([res_k[away], ranks[away], owner[blocks][away], (last_step + 1)[away]], axis=1)[order]
    starts, lo, hi = _runs(keys, blocks[away][order])
    results = np.stack([keys[starts, 0], lo, hi, keys[starts, 1], keys[starts, 2], keys[starts, 3]], axis=1)

    transfers = np.concatenate([inputs, results]).reshape(-1, 6)
    if fanout is not None:
        transfers = _relay_trees(transfers, fanout)
    transfers = transfers[np.lexsort((transfers[:, 1], transfers[:, 0], transfers[:, 4], transfers[:, 3],
                                      transfers[:, 5]))]
    works = works[np.lexsort((works[:, 1], works[:, 0], works[:, 3], works[:, 2]))]
    return DistSchedule(pass_, P, nb, bool(causal), layout, assignment, works, transfers, fanout)


def _relay_trees(transfers: np.ndarray, fanout: int) -> np.ndarray:
    """Replace each group of identical sends (same data, source and step) to more than ``fanout``
    ranks by a broadcast tree: at each level every holder sends to at most ``fanout`` new ranks.
    Level L of a depth-D tree runs D-1-L steps before the original step, so the last level
    arrives in time and each rank forwards about ``fanout`` copies per step instead of the owner
    sending all of them at once; levels that would fall before step 0 run in step 0 as waves."""
    if not len(transfers):
        return transfers
    out = []
    key = transfers[:, [0, 1, 2, 3, 5]]
    order = np.lexsort((transfers[:, 4],) + tuple(key[:, i] for i in range(4, -1, -1)))
    t = transfers[order]
    brk = np.flatnonzero(np.r_[True, np.any(key[order][1:] != key[order][:-1], axis=1)])
    for s, e in zip(brk.tolist(), np.r_[brk[1:], len(t)].tolist()):
        kind, lo, hi, src, _, step = t[s].tolist()
        dsts = t[s:e, 4].tolist()
        levels, holders, i = [], [src], 0
        while i < len(dsts):
            level = []
            for h in list(holders):
                for _ in range(fanout):
                    if i < len(dsts):
                        level.append((h, dsts[i]))
                        holders.append(dsts[i])
                        i += 1
            levels.append(level)
        for L, level in enumerate(levels):
            at = max(step - (len(levels) - 1 - L), 0)
            out.extend([kind, lo, hi, h, d, at] for h, d in level)
    return np.array(out, dtype=np.int64).reshape(-1, 6)


# -------------------------------------------------------------------------------------- validation

@dataclass(frozen=True)
class DistReport:
    num_steps: int
    num_works: int
    num_transfers: int
    num_messages: int      # packed (src, dst, step, wave) messages
    max_wave: int
    waves: np.ndarray = field(repr=False)   # wave of each transfer row


def _fail(s: DistSchedule, what: str):
    raise DistScheduleError(f"{s.describe()}: {what}")


def _blocks(lo: int, hi: int) -> str:
    return f"block {lo}" if hi == lo + 1 else f"blocks [{lo}, {hi})"


def _check_structure(s: DistSchedule):
    P, nb = s.num_ranks, s.num_blocks
    folds = _kind_codes(PASS_FOLDS[s.pass_], FOLD_KINDS)
    kinds = _kind_codes(PASS_INPUTS[s.pass_] + PASS_RESULTS[s.pass_], DATA_KINDS)
    w, tr = s.works, s.transfers
    bad = np.flatnonzero(~np.isin(w[:, 0], folds))
    if len(bad):
        _fail(s, f"work {w[bad[0]].tolist()}: kind must be one of {PASS_FOLDS[s.pass_]} in a {s.pass_} schedule")
    bad = np.flatnonzero(~((w[:, 1] >= 0) & (w[:, 1] < nb) & (w[:, 2] >= 0) & (w[:, 2] < P) & (w[:, 3] >= 0)
                           & (w[:, 4] >= 0) & (w[:, 4] < w[:, 5]) & (w[:, 5] <= nb)))
    if len(bad):
        _fail(s, f"work {s.work_list()[bad[0]]} is out of range (ranks 0..{P - 1}, blocks 0..{nb - 1}, "
                 f"steps >= 0, lo < hi)")
    bad = np.flatnonzero(~np.isin(tr[:, 0], kinds))
    if len(bad):
        _fail(s, f"transfer {tr[bad[0]].tolist()}: kind must be one of "
                 f"{PASS_INPUTS[s.pass_] + PASS_RESULTS[s.pass_]} in a {s.pass_} schedule")
    bad = np.flatnonzero(~((tr[:, 1] >= 0) & (tr[:, 1] < tr[:, 2]) & (tr[:, 2] <= nb) & (tr[:, 3] >= 0)
                           & (tr[:, 3] < P) & (tr[:, 4] >= 0) & (tr[:, 4] < P) & (tr[:, 5] >= 0)))
    if len(bad):
        _fail(s, f"transfer {s.transfer_list()[bad[0]]} is out of range")
    bad = np.flatnonzero(tr[:, 3] == tr[:, 4])
    if len(bad):
        _fail(s, f"transfer {s.transfer_list()[bad[0]]} sends to its own rank")


def _check_coverage(s: DistSchedule):
    """Every needed fold exists, runs on one rank, and its items cover the needed partner blocks
    exactly once, in ascending order over strictly increasing steps."""
    nb = s.num_blocks
    w = s.works[np.lexsort((s.works[:, 4], s.works[:, 3], s.works[:, 1], s.works[:, 0]))]
    want = [(FOLD_KINDS.index(k), b) for k in PASS_FOLDS[s.pass_] for b in range(nb)]
    fkey = w[:, 0] * nb + w[:, 1]
    starts = np.flatnonzero(np.r_[True, fkey[1:] != fkey[:-1]])
    ends = np.r_[starts[1:], len(w)]
    have = dict(zip(fkey[starts].tolist(), zip(starts.tolist(), ends.tolist())))
    for k, b in want:
        kind = FOLD_KINDS[k]
        if k * nb + b not in have:
            _fail(s, f"no work computes fold {kind} of block {b}")
        i, e = have[k * nb + b]
        items = w[i:e]
        pn = PARTNER_NAME[kind]
        if np.any(items[:, 2] != items[0, 2]):
            _fail(s, f"fold {kind} of block {b} is split over ranks {sorted(set(items[:, 2].tolist()))}; "
                     f"a fold must run on one rank")
        lo, hi = fold_range(kind, b, nb, s.causal)
        by_lo = items[np.argsort(items[:, 4], kind="stable")]
        pos = lo
        for _, _, _, t, a, z in by_lo.tolist():
            if a < lo or z > hi:
                x, y = (a, min(z, lo)) if a < lo else (max(a, hi), z)
                _fail(s, f"fold {kind} of block {b} covers {pn} {_blocks(x, y)}, which the "
                         f"{'causal' if s.causal else 'full'} mask excludes (step {t})")
            if a > pos:
                _fail(s, f"fold {kind} of block {b} misses {pn} {_blocks(pos, a)}")
            if a < pos:
                _fail(s, f"fold {kind} of block {b} covers {pn} {_blocks(a, min(pos, z))} twice (step {t})")
            pos = z
        if pos < hi:
            _fail(s, f"fold {kind} of block {b} misses {pn} {_blocks(pos, hi)}")
        # exact cover; now the order: ascending partners must come at strictly increasing steps
        steps = by_lo[:, 3]
        if np.any(np.diff(steps) <= 0):
            k_ = int(np.flatnonzero(np.diff(steps) <= 0)[0])
            _fail(s, f"fold {kind} of block {b} folds {pn} {_blocks(int(by_lo[k_ + 1, 4]), int(by_lo[k_ + 1, 5]))} "
                     f"at step {int(steps[k_ + 1])}, not after {_blocks(int(by_lo[k_, 4]), int(by_lo[k_, 5]))} "
                     f"(step {int(steps[k_])}): a fold must visit its partners in ascending order")


def _range_max_table(a: np.ndarray) -> list[np.ndarray]:
    table = [a]
    k = 1
    while 2 * k <= a.shape[-1]:
        prev = table[-1]
        table.append(np.maximum(prev[..., :-k], prev[..., k:]))
        k *= 2
    return table


def _range_max(table, flat_base: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max of the rows' [lo, hi) on the flattened (row, block) arrays of ``table`` (sparse table)."""
    length = hi - lo
    lvl = np.floor(np.log2(length)).astype(np.int64)
    out = np.empty(len(lo), dtype=table[0].dtype)
    for L in np.unique(lvl).tolist():
        m = lvl == L
        t = table[L]
        rows = flat_base[m]
        out[m] = np.maximum(t[rows, lo[m]], t[rows, hi[m] - (1 << L)])
    return out


def _find_cycle(edges: dict[int, list[int]]) -> list[int] | None:
    color, stack_pos, path = {}, {}, []

    def dfs(u):
        color[u] = 1
        stack_pos[u] = len(path)
        path.append(u)
        for v in edges.get(u, ()):
            if color.get(v) == 1:
                return path[stack_pos[v]:]
            if color.get(v) is None:
                c = dfs(v)
                if c:
                    return c
        path.pop()
        color[u] = 2
        return None

    for u in edges:
        if color.get(u) is None:
            c = dfs(u)
            if c:
                return c
    return None


def validate(s: DistSchedule) -> DistReport:
    """Refuse (DistScheduleError) a schedule that would compute wrong results, lose one, or hang:

    1. structure: kinds belong to the pass; ranks, blocks, steps in range; no self-sends;
    2. coverage: every fold of the pass exists and runs on ONE rank; its items cover exactly the
       partner blocks the mask needs, each once (no missing pair, no duplicate, no masked one), in
       ascending order over increasing steps;
    3. data: every transfer's sender holds the data at that step (owned, produced or received at
       an earlier step, or relayed to it in an earlier wave of the same step); nobody receives data
       it already holds; relays inside a step form no cycle (a cycle is a deadlock: each rank
       waits for the other to forward first);
    4. every work item's inputs are at its rank at the start of its step;
    5. every result (o, dq, dkv) ends at its block's owner.

    Returns a DistReport with each transfer's wave (what the runtime posts together).
    """
    _check_structure(s)
    _check_coverage(s)
    P, nb, K = s.num_ranks, s.num_blocks, len(DATA_KINDS)
    w, tr = s.works, s.transfers
    avail = np.full((P, K, nb), _INF, dtype=np.int64)   # first step at which the rank may use the data
    for name in PASS_INPUTS[s.pass_]:
        avail[s.owner, DATA_KINDS.index(name), np.arange(nb)] = 0
    # results exist on the computing rank from the step after the fold's last item
    o = np.lexsort((w[:, 3], w[:, 1], w[:, 0]))
    ends = np.r_[np.flatnonzero(np.any(w[o][1:, :2] != w[o][:-1, :2], axis=1)), len(w) - 1] if len(w) else []
    last = {(k, b): (r, t) for k, b, r, t in w[o][ends, :4].tolist()}   # a fold's last item
    res_of = _kind_codes([RESULT[k] for k in FOLD_KINDS], DATA_KINDS)
    for (k, b), (r, t) in last.items():
        avail[r, res_of[k], b] = t + 1

    waves = np.zeros(len(tr), dtype=np.int64)
    order = np.argsort(tr[:, 5], kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(tr[order, 5]) != 0, True]) if len(tr) else np.zeros(1, np.int64)
    for gs, ge in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        idx = order[gs:ge].tolist()
        t = int(tr[idx[0], 5])
        pending, wave = idx, 0
        while pending:
            ready = [i for i in pending
                     if np.all(avail[tr[i, 3], tr[i, 0], tr[i, 1]:tr[i, 2]] <= t)]
            if not ready:
                _explain_stuck(s, tr, pending, avail, t)
            for i in ready:
                k, lo, hi, _, dst, _ = tr[i].tolist()
                if np.any(avail[dst, k, lo:hi] < _INF):
                    _fail(s, f"transfer {s.transfer_list()[i]}: rank {dst} already holds or receives "
                             f"{DATA_KINDS[k]} of {_blocks(lo, hi)}")
                waves[i] = wave
                avail[dst, k, lo:hi] = t   # a relay may forward it in the next wave
            done = set(ready)
            pending = [i for i in pending if i not in done]
            wave += 1
        for i in idx:   # what arrived at step t is usable from step t + 1
            k, lo, hi, _, dst, _ = tr[i].tolist()
            avail[dst, k, lo:hi] = t + 1

    # 4: work inputs, vectorised with a sparse table of range maxima over avail
    if len(w):
        kind = w[:, 0]
        pk = _kind_codes([PARTNER[k] for k in FOLD_KINDS], DATA_KINDS)[kind]
        ok = _kind_codes([OWN[k] for k in FOLD_KINDS], DATA_KINDS)[kind]
        flat = avail.reshape(P * K, nb)
        table = _range_max_table(flat)
        got_partner = _range_max(table, w[:, 2] * K + pk, w[:, 4], w[:, 5])
        got_own = flat[w[:, 2] * K + ok, w[:, 1]]
        bad = np.flatnonzero((got_partner > w[:, 3]) | (got_own > w[:, 3]))
        if len(bad):
            k, b, r, t, lo, hi = w[bad[0]].tolist()
            kname = FOLD_KINDS[k]
            if got_own[bad[0]] > t:
                _fail(s, f"rank {r} computes {kname} of block {b} at step {t} but lacks its {OWN[kname]} block "
                         f"(not owned, not received before step {t})")
            miss = np.flatnonzero(flat[r * K + pk[bad[0]], lo:hi] > t) + lo
            _fail(s, f"rank {r} computes {kname} of block {b} at step {t} but lacks {PARTNER[kname]} of "
                     f"{_blocks(int(miss[0]), int(miss[-1]) + 1)} (not owned, not received before step {t})")

    # 5: results at their owners
    for (k, b), (r, _) in sorted(last.items()):
        res = DATA_KINDS.index(RESULT[FOLD_KINDS[k]])
        if avail[s.owner[b], res, b] >= _INF:
            _fail(s, f"the result of {FOLD_KINDS[k]} of block {b} (computed on rank {r}) never reaches "
                     f"its owner, rank {int(s.owner[b])}")

    msgs = {(int(a), int(d), int(t), int(v)) for (a, d, t), v in zip(tr[:, 3:6].tolist(), waves.tolist())}
    return DistReport(num_steps=s.num_steps, num_works=len(w), num_transfers=len(tr), num_messages=len(msgs),
                      max_wave=int(waves.max()) if len(waves) else 0, waves=waves)


def _explain_stuck(s: DistSchedule, tr: np.ndarray, pending: list[int], avail: np.ndarray, t: int):
    """No pending transfer of step t can start: report a relay cycle if there is one, else the
    transfer whose sender never gets its data."""
    lst = s.transfer_list()
    edges = {}
    for i in pending:
        k, lo, hi, src, _, _ = tr[i].tolist()
        missing = avail[src, k, lo:hi] > t
        for j in pending:
            k2, lo2, hi2, _, dst2, _ = tr[j].tolist()
            if dst2 == src and k2 == k and np.any(missing[max(lo2, lo) - lo:max(min(hi2, hi) - lo, 0)]):
                edges.setdefault(i, []).append(j)
    cycle = _find_cycle(edges)
    if cycle:
        desc = "; ".join(f"rank {lst[i].src} -> rank {lst[i].dst} ({lst[i].kind} of {_blocks(lst[i].lo, lst[i].hi)})"
                         for i in cycle)
        _fail(s, f"cyclic wait at step {t}: each of these transfers waits for the next to relay its data: {desc}")
    for i in pending:
        if i not in edges:
            x = lst[i]
            _fail(s, f"transfer {x}: rank {x.src} lacks {x.kind} of {_blocks(x.lo, x.hi)} at step {t} "
                     f"(not owned, not produced or received before step {t}, not relayed to it within the step)")
    _fail(s, f"transfers of step {t} wait on each other")  # unreachable: a graph without sinks has a cycle


@functools.lru_cache(maxsize=64)
def get_schedule(num_ranks: int, seqlen: int, causal: bool, pass_: str, layout: str = "contiguous",
                 assignment: str | None = None, fanout: int | None = DEFAULT_FANOUT) -> tuple[DistSchedule, DistReport]:
    """Build and validate (cached): the runtime only executes validated schedules."""
    s = build(num_ranks, seqlen, causal=causal, pass_=pass_, layout=layout, assignment=assignment, fanout=fanout)
    return s, validate(s)


# ---------------------------------------------------------------------------------- rank programs

@dataclass(frozen=True)
class Message:
    peer: int
    step: int
    wave: int
    transfers: tuple[Transfer, ...]   # in packing order: (kind, lo)


@dataclass(frozen=True)
class StepProgram:
    step: int
    works: tuple[Work, ...]
    waves: tuple[tuple[tuple[Message, ...], tuple[Message, ...]], ...]   # waves[v]: (sends, recvs) of wave v


def rank_program(s: DistSchedule, report: DistReport, rank: int) -> list[StepProgram]:
    """What ``rank`` does, step by step: its work items (by kind, block) and, per wave, one packed
    message per peer and direction. Sender and receiver derive the same packing from the schedule."""
    works = [x for x in s.work_list() if x.rank == rank]
    by_step: dict[int, list] = {}
    for x in works:
        by_step.setdefault(x.step, []).append(x)
    msgs: dict[tuple, list] = {}
    for x, wave in zip(s.transfer_list(), report.waves.tolist()):
        if x.src == rank:
            msgs.setdefault((x.step, wave, "send", x.dst), []).append(x)
        elif x.dst == rank:
            msgs.setdefault((x.step, wave, "recv", x.src), []).append(x)
    prog = []
    for t in range(s.num_steps):
        waves = []
        for v in range(report.max_wave + 1):
            pair = []
            for d in ("send", "recv"):
                peers = sorted(p for (st, wv, dd, p) in msgs if st == t and wv == v and dd == d)
                pair.append(tuple(Message(p, t, v, tuple(sorted(msgs[(t, v, d, p)],
                                                                key=lambda x: (DATA_KINDS.index(x.kind), x.lo))))
                                  for p in peers))
            waves.append(tuple(pair))
        while waves and not (waves[-1][0] or waves[-1][1]):   # keep waves[v] == wave v; drop the empty tail
            waves.pop()
        ws = tuple(sorted(by_step.get(t, []), key=lambda x: (FOLD_KINDS.index(x.kind), x.block)))
        prog.append(StepProgram(t, ws, tuple(waves)))
    return prog


# ----------------------------------------------------------------------------------------- simulator

@dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 16
    heads_kv: int = 16
    headdim: int = 128
    dtype_bytes: int = 2

    def __post_init__(self):
        for f in ("batch", "heads", "heads_kv", "headdim", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Shape.{f} must be a positive int, got {v!r}")
        if self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of heads_kv ({self.heads_kv})")

    def kind_bytes(self, kind: str) -> int:
        """Bytes of one block of a data bundle."""
        b, h, hk, d, e = self.batch, self.heads, self.heads_kv, self.headdim, self.dtype_bytes
        row = b * G * h * d * e
        stats = b * h * G * 4
        return {"q": row, "kv": 2 * b * G * hk * d * e, "qrow": 2 * row + 2 * stats, "o": row + stats,
                "dq": row, "dkv": 2 * b * G * hk * d * e}[kind]

    def gemm_flops(self) -> float:
        """FLOPs of one (G x d) @ (d x G) block GEMM over all heads."""
        return 2.0 * G * G * self.headdim * self.heads * self.batch


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta model of one GPU per rank. ``fwd_tflops`` is the forward kernel's rate and
    ``bwd_tflops`` the backward's (standard FLOP counts: 2 and 5 block GEMMs per tile); a block
    GEMM costs the same inside a fold. ``diag``: cost of a causal diagonal tile relative to a full
    one. A message costs ``alpha_us`` + bytes / ``beta_gbs``; each rank sends one message and
    receives one at a time. ``launch_us`` per step with compute (kernel launch, event waits)."""

    fwd_tflops: float = 650.0
    bwd_tflops: float = 500.0
    diag: float = 1.0
    alpha_us: float = 15.0
    beta_gbs: float = 350.0
    launch_us: float = 5.0

    def __post_init__(self):
        for f in ("fwd_tflops", "bwd_tflops", "beta_gbs"):
            if not getattr(self, f) > 0:
                raise ValueError(f"CostModel.{f} must be > 0")
        for f in ("diag", "alpha_us", "launch_us"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"CostModel.{f} must be >= 0")

    def gemm_seconds(self, shape: Shape, pass_: str) -> float:
        """Seconds of one block GEMM at the pass's kernel rate."""
        return shape.gemm_flops() / ((self.fwd_tflops if pass_ == "fwd" else self.bwd_tflops) * 1e12)


@dataclass
class PassSim:
    time: float              # seconds until the last rank finishes
    single: float            # one GPU running the pass's kernel on the whole sequence
    compute: np.ndarray      # per-rank compute seconds
    bytes_sent: np.ndarray   # per rank
    messages: int
    gemms: float             # block GEMMs done (diagonal tiles weighted), all ranks
    gemms_single: float      # what one GPU's kernel does


@dataclass
class SimResult:
    schedule: str
    num_ranks: int
    seqlen: int
    causal: bool
    fwd: PassSim
    bwd: PassSim

    @property
    def time(self) -> float:
        return self.fwd.time + self.bwd.time

    @property
    def single(self) -> float:
        return self.fwd.single + self.bwd.single

    @property
    def efficiency(self) -> float:
        """T1 / (P * TP), T1 = one GPU's kernels on the whole sequence."""
        return self.single / (self.num_ranks * self.time)

    def as_dict(self) -> dict:
        d = {"schedule": self.schedule, "P": self.num_ranks, "seqlen": self.seqlen, "causal": self.causal,
             "time_ms": 1e3 * self.time, "single_gpu_ms": 1e3 * self.single, "efficiency": self.efficiency}
        for name, p in (("fwd", self.fwd), ("bwd", self.bwd)):
            d[name] = {"time_ms": 1e3 * p.time, "single_gpu_ms": 1e3 * p.single,
                       "efficiency": p.single / (self.num_ranks * p.time),
                       "max_rank_compute_ms": 1e3 * float(p.compute.max()),
                       "max_rank_sent_mb": float(p.bytes_sent.max()) / 1e6, "messages": p.messages,
                       "gemm_ratio": p.gemms / p.gemms_single}
        return d


def _step_gemms(s: DistSchedule, diag: float) -> np.ndarray:
    """(P, steps) weighted block-GEMM counts. In the backward, a pair whose dQ fold and dK/dV fold
    are on the same rank at the same step is computed once (5 GEMMs, not 3 + 4): the runtime
    shares S, P and dS between the two folds, which gives the same bits."""
    P, T, nb = s.num_ranks, s.num_steps, s.num_blocks
    out = np.zeros((P, T))
    w = s.works
    tiles = (w[:, 5] - w[:, 4]).astype(float)
    if s.causal:
        on_diag = (w[:, 1] >= w[:, 4]) & (w[:, 1] < w[:, 5])
        tiles -= (1.0 - diag) * on_diag
    gemms = np.array([GEMMS[k] for k in FOLD_KINDS], dtype=float)[w[:, 0]]
    np.add.at(out, (w[:, 2], w[:, 3]), tiles * gemms)
    if s.pass_ == "bwd" and len(w):
        dq_k = FOLD_KINDS.index("bwd_dq")
        o = np.lexsort((w[:, 0], w[:, 3], w[:, 2]))
        ws = w[o]
        brk = np.flatnonzero(np.r_[True, np.any(ws[1:, 2:4] != ws[:-1, 2:4], axis=1), True])
        for a, z in zip(brk[:-1].tolist(), brk[1:].tolist()):
            g = ws[a:z]
            dq, dkv = g[g[:, 0] == dq_k], g[g[:, 0] != dq_k]
            if not len(dq) or not len(dkv):
                continue
            # pair (i, j) is shared when row i's dQ item covers j and column j's dK/dV item covers i
            both = ((dkv[None, :, 1] >= dq[:, None, 4]) & (dkv[None, :, 1] < dq[:, None, 5])
                    & (dq[:, None, 1] >= dkv[None, :, 4]) & (dq[:, None, 1] < dkv[None, :, 5]))
            shared = float(both.sum())
            if s.causal:
                shared -= (1.0 - diag) * float((both & (dq[:, None, 1] == dkv[None, :, 1])).sum())
            out[g[0, 2], g[0, 3]] -= 2.0 * shared
    return out


def simulate_pass(s: DistSchedule, report: DistReport, shape: Shape, cost: CostModel) -> PassSim:
    """Event simulation of one pass: each rank runs its steps in order; a step starts when the
    rank's previous step (compute and that step's transfers) is done; wave 0 transfers run during
    the step's compute, later waves after it; a message starts once both ranks posted it and the
    sender's outgoing and the receiver's incoming link are free."""
    P, T = s.num_ranks, s.num_steps
    gem = _step_gemms(s, cost.diag)
    g_sec = cost.gemm_seconds(shape, s.pass_)
    comp = gem * g_sec + (gem > 0) * cost.launch_us * 1e-6
    kb = np.array([shape.kind_bytes(k) for k in DATA_KINDS], dtype=float)
    tr = s.transfers
    nbytes = (tr[:, 2] - tr[:, 1]) * kb[tr[:, 0]]
    msgs: dict[tuple, float] = {}
    for (src, dst, t), v, nb_ in zip(tr[:, 3:6].tolist(), report.waves.tolist(), nbytes.tolist()):
        msgs[(t, v, src, dst)] = msgs.get((t, v, src, dst), 0.0) + nb_
    by_step: dict[int, list] = {}
    for key in sorted(msgs):
        by_step.setdefault(key[0], []).append(key)
    end = np.zeros(P)
    send_free, recv_free = np.zeros(P), np.zeros(P)
    sent = np.zeros(P)
    for t in range(T):
        start = end.copy()
        comp_end = start + comp[:, t]
        done = comp_end.copy()
        posted = start.copy()
        cur_wave = 0
        for (_, v, src, dst) in by_step.get(t, []):
            if v != cur_wave:   # a later wave is posted after the compute and the previous wave
                posted = done.copy()
                cur_wave = v
            begin = max(posted[src], posted[dst], send_free[src], recv_free[dst])
            fin = begin + cost.alpha_us * 1e-6 + msgs[(t, v, src, dst)] / (cost.beta_gbs * 1e9)
            send_free[src] = recv_free[dst] = fin
            done[src] = max(done[src], fin)
            done[dst] = max(done[dst], fin)
            sent[src] += msgs[(t, v, src, dst)]
        end = done
    nb = s.num_blocks
    tiles = nb * (nb + 1) / 2 - (1.0 - cost.diag) * nb if s.causal else float(nb * nb)
    single_gemms = tiles * (2 if s.pass_ == "fwd" else 5)
    return PassSim(time=float(end.max()), single=single_gemms * g_sec, compute=comp.sum(axis=1),
                   bytes_sent=sent, messages=len(msgs), gemms=float(gem.sum()), gemms_single=single_gemms)


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, schedule: str = "helper_worker",
             shape: Shape | None = None, cost: CostModel | None = None,
             fanout: int | None = DEFAULT_FANOUT) -> SimResult:
    """Predicted forward + backward time and efficiency T1 / (P * TP) of a preset schedule
    (validated first)."""
    if schedule not in PRESETS:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(PRESETS)}")
    layout, assignment = PRESETS[schedule]
    shape = shape or Shape()
    cost = cost or CostModel()
    passes = {}
    for p in PASSES:
        s, rep = get_schedule(num_ranks, seqlen, bool(causal), p, layout, assignment, fanout)
        passes[p] = simulate_pass(s, rep, shape, cost)
    return SimResult(schedule, num_ranks, seqlen, bool(causal), passes["fwd"], passes["bwd"])


# ------------------------------------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _heads_pair(text: str) -> tuple[int, int]:
    """'32/8' -> (32, 8); '16' -> (16, 16): a CLI's --heads."""
    h, _, hk = text.partition("/")
    if not h.strip().isdigit() or not (hk.strip() or h).isdigit():
        raise argparse.ArgumentTypeError(f"expected heads as H or H/H_KV, got {text!r}")
    return int(h), int(hk or h)


def _int_list(text: str) -> list[int]:
    """'8' or '2,4,8' or '64k,1m' (k = 1024, m = 1048576)."""
    vals = []
    for x in (t.strip().lower() for t in text.split(",")):
        mult = {"k": 1024, "m": 1048576}.get(x[-1:], 1)
        digits = x[:-1] if mult > 1 else x
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"expected a comma list of positive ints (64k, 1m allowed), got {text!r}")
        vals.append(int(digits) * mult)
    return vals


def main(argv=None) -> int:
    p = _Parser(prog="python -m dash_fa3.schedule.distributed",
                description="Build, validate and simulate sequence-parallel attention schedules "
                            "(alpha-beta model); prints predicted time and efficiency T1/(P*TP).")
    p.add_argument("--P", type=_int_list, default=[8], help="rank counts, comma list (default 8)")
    p.add_argument("--seqlen", type=_int_list, default=[131072],
                   help="total tokens, comma list; 64k = 65536, 1m = 1048576 (default 131072)")
    p.add_argument("--schedule", default="helper_worker,zigzag",
                   help=f"comma list of {', '.join(PRESETS)}, or all (default helper_worker,zigzag)")
    mask = p.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True, help="causal mask (default)")
    mask.add_argument("--full", dest="causal", action="store_false", help="no mask")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=None, help="default: heads")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--fanout", type=int, default=DEFAULT_FANOUT,
                   help=f"copies one holder sends per step before relays take over; 0: the owner sends "
                        f"every copy (default {DEFAULT_FANOUT})")
    defaults = CostModel()
    for f, help_ in (("fwd_tflops", "forward kernel TFLOP/s"),
                     ("bwd_tflops", "backward kernel TFLOP/s (5-GEMM count)"),
                     ("diag", "diagonal tile cost / full tile"), ("alpha_us", "per-message latency, us"),
                     ("beta_gbs", "P2P bandwidth per direction per rank, GB/s"),
                     ("launch_us", "per-step overhead, us")):
        p.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(defaults, f),
                       help=f"{help_} (default {getattr(defaults, f)})")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    names = list(PRESETS) if args.schedule == "all" else [x.strip() for x in args.schedule.split(",") if x.strip()]
    for n in names:
        if n not in PRESETS:
            p.error(f"unknown schedule {n!r}; choose from {', '.join(PRESETS)} or all")
    try:
        shape = Shape(args.batch, args.heads, args.heads_kv or args.heads, args.headdim, args.dtype_bytes)
        cost = CostModel(args.fwd_tflops, args.bwd_tflops, args.diag, args.alpha_us, args.beta_gbs, args.launch_us)
        if args.fanout < 0:
            raise ValueError(f"--fanout must be >= 0, got {args.fanout}")
        fanout = args.fanout or None
        for P in args.P:
            if P > 64:
                raise ValueError(f"--P {P}: the model is meant for P <= 64")
            for n in args.seqlen:
                check_seqlen(n, P)
    except ValueError as e:
        p.error(str(e))
    if not args.json:
        print(f"{'schedule':<14} {'P':>3} {'seqlen':>8} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} "
              f"{'1-GPU ms':>9} {'eff':>6} {'eff fwd':>7} {'eff bwd':>7} {'bwd GEMMs':>9} {'MB/rank':>8}")
    for n in args.seqlen:
        for P in args.P:
            for name in names:
                r = simulate(P, n, causal=args.causal, schedule=name, shape=shape, cost=cost, fanout=fanout)
                d = r.as_dict()
                if args.json:
                    print(json.dumps(d))
                    continue
                print(f"{name:<14} {P:>3} {n:>8} {d['fwd']['time_ms']:>9.3f} {d['bwd']['time_ms']:>9.3f} "
                      f"{d['time_ms']:>9.3f} {d['single_gpu_ms']:>9.3f} {d['efficiency']:>6.3f} "
                      f"{d['fwd']['efficiency']:>7.3f} {d['bwd']['efficiency']:>7.3f} "
                      f"{d['bwd']['gemm_ratio']:>9.3f} "
                      f"{(d['fwd']['max_rank_sent_mb'] + d['bwd']['max_rank_sent_mb']):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
