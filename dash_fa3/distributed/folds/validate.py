"""Validation of a fold schedule (nothing runs that has not passed it), and what each rank runs of
a validated one (:func:`rank_program`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from .plan import (DATA_KINDS, DEFAULT_FANOUT, FOLD_KINDS, NEVER, OWN, PARTNER, PARTNER_NAME, PASS_FOLDS,
                   PASS_INPUTS, PASS_RESULTS, RESULT, DistSchedule, DistScheduleError, Transfer, Work, build,
                   fold_range, kind_codes)

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
    folds = kind_codes(PASS_FOLDS[s.pass_], FOLD_KINDS)
    kinds = kind_codes(PASS_INPUTS[s.pass_] + PASS_RESULTS[s.pass_], DATA_KINDS)
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
    avail = np.full((P, K, nb), NEVER, dtype=np.int64)   # first step at which the rank may use the data
    for name in PASS_INPUTS[s.pass_]:
        avail[s.owner, DATA_KINDS.index(name), np.arange(nb)] = 0
    # results exist on the computing rank from the step after the fold's last item
    o = np.lexsort((w[:, 3], w[:, 1], w[:, 0]))
    ends = np.r_[np.flatnonzero(np.any(w[o][1:, :2] != w[o][:-1, :2], axis=1)), len(w) - 1] if len(w) else []
    last = {(k, b): (r, t) for k, b, r, t in w[o][ends, :4].tolist()}   # a fold's last item
    res_of = kind_codes([RESULT[k] for k in FOLD_KINDS], DATA_KINDS)
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
                if np.any(avail[dst, k, lo:hi] < NEVER):
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
        pk = kind_codes([PARTNER[k] for k in FOLD_KINDS], DATA_KINDS)[kind]
        ok = kind_codes([OWN[k] for k in FOLD_KINDS], DATA_KINDS)[kind]
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
        if avail[s.owner[b], res, b] >= NEVER:
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

