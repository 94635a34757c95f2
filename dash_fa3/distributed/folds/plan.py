"""The fold schedules as data: which rank advances which fold at which step, and which blocks move.

A *fold* is one block's complete fp32 reduction: ``fwd_q`` (the output row of a query block: online
softmax over the key blocks it sees, ascending), ``bwd_dq`` (dQ of a query block, ascending key
blocks) and ``bwd_dkv`` (dK/dV of a key block, ascending query blocks). Every fold runs on ONE rank,
so the floating-point operations behind each output element are the same for every P: that is where
the bitwise invariance comes from.

One pass of a schedule is a list of :class:`Work` items -- ``(kind, block, rank, step, lo, hi)``: at
``step``, ``rank`` advances the fold ``(kind, block)`` over partner blocks ``[lo, hi)`` -- and a list
of :class:`Transfer` records -- ``(kind, lo, hi, src, dst, step)``: at ``step``, ``src`` sends the
data bundle ``kind`` of blocks ``[lo, hi)`` to ``dst``. Data bundles (per block): ``q`` (forward
query), ``kv`` (key and value), ``qrow`` (backward: query, dO, LSE and delta = rowsum(dO * O)), and
the results ``o`` (output and LSE), ``dq``, ``dkv``.

Step semantics (what ``validate.py`` checks and ``runtime.py`` runs): at step t every rank posts the
transfers of step t it takes part in, computes its work items of step t, then waits for those
transfers. A work item at step t may use data its rank owns, produced at a step < t, or received at
a step < t; a transfer at step t may send data the sender holds by then -- or receives in the same
step (a relay), which puts it in a later *wave* of that step: waves are posted in order, each after
the previous one completed. Transfers are posted by both sides at the same step, so there is no
cross-step waiting; a relay cycle inside one step is the one way to deadlock, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ..layout import G, block_owners, chunk_bounds, check_layout, check_seqlen

PASSES = ("fwd", "bwd")
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

NEVER = np.iinfo(np.int32).max


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



def kind_codes(names, table) -> np.ndarray:
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
    kinds = np.repeat(kind_codes(PASS_FOLDS[pass_], FOLD_KINDS), num_blocks)
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
    check_layout(layout)
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
    need = np.full((P, len(DATA_KINDS), nb), NEVER, dtype=np.int64)
    pk = kind_codes([PARTNER[k] for k in FOLD_KINDS], DATA_KINDS)[works[:, 0]]
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
    own_k = kind_codes([OWN[k] for k in FOLD_KINDS], DATA_KINDS)[kinds]
    away = ranks != owner[blocks]
    np.minimum.at(need, (ranks[away], own_k[away], blocks[away]), first_step[away])

    r_idx, k_idx, b_idx = np.nonzero(need < NEVER)
    keep = owner[b_idx] != r_idx
    r_idx, k_idx, b_idx = r_idx[keep], k_idx[keep], b_idx[keep]
    src, step = owner[b_idx], need[r_idx, k_idx, b_idx] - 1
    order = np.lexsort((b_idx, step, src, k_idx, r_idx))
    keys = np.stack([r_idx, k_idx, src, step], axis=1)[order]
    starts, lo, hi = _runs(keys, b_idx[order])
    inputs = np.stack([keys[starts, 1], lo, hi, keys[starts, 2], keys[starts, 0], keys[starts, 3]], axis=1)

    res_k = kind_codes([RESULT[k] for k in FOLD_KINDS], DATA_KINDS)[kinds]
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

