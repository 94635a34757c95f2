"""Validation: a schedule that fails any check is refused (ScheduleError), never run.

Checks, in order:

1. tasks: exactly one task per (batch, q_head, kv_tile), with as many steps as
   the KV tile meets Q tiles (none for a tile a window hides from every query:
   that task only stores dK = dV = 0);
2. coverage: every (kv, q) pair the mask needs is visited exactly once, by the
   task of that KV tile;
3. ranks: for every dQ tile the ranks of its contributions are 0..k-1 (GQA
   dK/dV need no order: each q head stores its own partials);
4. metadata: decoding the int32 task table with the device arithmetic
   (:func:`.metadata.decode_all`) reproduces the visiting orders and ranks
   exactly, and the header/rows are consistent (CTA offsets, counts);
5. deadlock freedom:

   * static dispatch: all ``num_ctas <= num_sms`` CTAs are resident; the graph
     with program order on each CTA (steps, epilogues, task to task) and
     semaphore order (rank k-1 -> rank k per dQ tile) must be acyclic (Kahn's
     algorithm).  A wait on a task queued behind
     a waiting task on the same CTA is such a cycle.
   * dynamic dispatch (fa3/spt/descending): tasks are claimed from a global
     counter in queue order, so a task can be claimed only after every earlier
     one.  We require every wait to target an earlier-claimed task (or an
     earlier step of the same task).  Then the earliest unfinished claimed
     task can always progress, for any number of resident CTAs (even one).
     This is conservative: it does not credit waits on later tasks that happen
     to be resident at the same time.

Collisions (two contributions to one dQ tile that the model would run at the
same time, i.e. a forced semaphore wait) are counted in a unit-cost,
zero-latency model (c = r = 1) and reported, not refused.  For static
schedules the deadlock check's graph evaluation gives them for free; for
dynamic ones they depend on which CTA claims which task, which only the
research model's simulation knows: :func:`.model.simulate.unit_model` (the
contract never imports the model).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import metadata as M
from .contract import SCHEDULES
from .waitgraph import chain_prev_task, evaluate_fused, fused_graph


class ScheduleError(ValueError):
    """A schedule failed validation and must not be executed."""


@dataclass(frozen=True)
class ValidationReport:
    schedule: str
    num_sms: int
    num_ctas: int
    dispatch: str
    num_tasks: int
    num_steps: int
    metadata_bytes: int
    # (collisions, unit makespan) of the unit-cost model; None for dynamic dispatch
    _unit_model: tuple | None = field(repr=False, compare=False)

    @property
    def valid(self) -> bool:
        return True

    @property
    def _unit(self) -> tuple[int, float]:
        if self._unit_model is None:
            raise ValueError(f"{self.schedule!r} is dispatched dynamically: its unit-cost collisions depend on the "
                             "claim order, which dash_fa3.schedule.model.unit_model(schedule) simulates")
        return self._unit_model

    @property
    def collisions(self) -> int:
        """Forced semaphore waits in the unit-cost model (static dispatch)."""
        return self._unit[0]

    @property
    def unit_makespan(self) -> float:
        """Makespan with c = r = 1, no latency (static dispatch)."""
        return self._unit[1]


def _fail(s, what: str):
    raise ScheduleError(f"schedule {s.name!r} on {s.geometry.describe()} with {s.num_sms} SMs: {what}")


def _check_permutation(s, gid: np.ndarray, rank: np.ndarray, what: str):
    if gid.size == 0:
        return
    order = np.lexsort((rank, gid))
    g_sorted, r_sorted = gid[order], rank[order]
    n = gid.size
    pos = np.arange(n, dtype=np.int64)
    new = np.ones(n, dtype=bool)
    new[1:] = g_sorted[1:] != g_sorted[:-1]
    start = np.maximum.accumulate(np.where(new, pos, 0))
    bad = np.flatnonzero(r_sorted != pos - start)
    if bad.size:
        i = bad[0]
        members = r_sorted[start[i]:][g_sorted[start[i]:] == g_sorted[i]]
        _fail(s, f"{what} {int(g_sorted[i])}: ranks {sorted(members.tolist())[:16]} are not a permutation "
                 f"of 0..{members.size - 1}")


class _Named:
    """What an error message names when there is no Schedule object (the kernel path)."""

    def __init__(self, name: str, geometry, num_sms: int):
        self.name, self.geometry, self.num_sms = name, geometry, num_sms


def _check_rows(s, meta, g, num_sms: int) -> None:
    """Header and task-table facts (O(tasks)): the header describes ``g``; one task per (batch,
    q head, KV tile), with as many steps as the tile meets Q tiles; CTA counts and offsets."""
    h, t = meta.header, meta.tasks.astype(np.int64)
    T = t.shape[0]
    if t.ndim != 2 or t.shape[1] != M.NUM_COLS or h.size != M.HEADER_LEN:
        _fail(s, "metadata has the wrong shape")
    dynamic = int(h[M.H_DISPATCH]) == M.DISPATCH_DYNAMIC
    expect = {M.H_MAGIC: M.MAGIC, M.H_VERSION: M.METADATA_VERSION, M.H_NUM_TASKS: T, M.H_NUM_STEPS: g.num_steps,
              M.H_N_Q: g.n_q, M.H_N_KV: g.n_kv, M.H_NUM_COLS: M.NUM_COLS,
              M.H_BATCH: g.batch, M.H_HEADS: g.heads, M.H_HEADS_KV: g.heads_kv,
              M.H_SEQLEN_Q: g.seqlen_q, M.H_SEQLEN_K: g.seqlen_k, M.H_BLOCK_M: g.block_m,
              M.H_BLOCK_N: g.block_n, M.H_MASK: M.MASK_CODES[g.mask], M.H_WINDOW_LEFT: g.window_left,
              M.H_WINDOW_RIGHT: g.window_right}
    for idx, val in expect.items():
        if int(h[idx]) != val:
            _fail(s, f"metadata header field {M.HEADER_FIELDS[idx]} = {int(h[idx])}, expected {val}")
    if not dynamic and int(h[M.H_DISPATCH]) != M.DISPATCH_STATIC:
        _fail(s, f"metadata header field dispatch = {int(h[M.H_DISPATCH])} is neither dynamic nor static")
    batch, head, kv = t[:, M.C_BATCH], t[:, M.C_HEAD], t[:, M.C_KV]
    splits = int(h[M.H_NUM_SPLITS])
    if splits < 1 or np.any((t[:, M.C_SPLIT] < 0) | (t[:, M.C_SPLIT] >= splits)):
        _fail(s, f"dQ split out of range: the header has {splits} splits")
    if np.any((batch < 0) | (batch >= g.batch) | (head < 0) | (head >= g.heads) | (kv < 0) | (kv >= g.n_kv)):
        _fail(s, "task with batch/head/kv_tile out of range")
    if not np.array_equal(t[:, M.C_HEAD_KV], head // g.group):
        _fail(s, "metadata column head_kv disagrees with the task's q head")
    tkey = (batch * g.heads + head) * g.n_kv + kv
    got = np.sort(tkey)
    if got.size != g.num_heads_total * g.n_kv or not np.array_equal(got, np.arange(got.size)):
        dup = got[1:][got[1:] == got[:-1]]
        _fail(s, f"tasks are not one per (batch, head, kv tile): {T} tasks, expected {g.num_heads_total * g.n_kv}"
                 + (f"; duplicate task key {int(dup[0])}" if dup.size else ""))
    bad = np.flatnonzero(t[:, M.C_N_STEPS] != g.task_len[kv])
    if bad.size:
        i = int(bad[0])
        _fail(s, f"task {i} (kv {int(kv[i])}) has {int(t[i, M.C_N_STEPS])} steps, needs {int(g.task_len[kv[i]])}")
    _check_chains(s, h, t, g, dynamic)
    num_ctas = int(h[M.H_NUM_CTAS])
    if num_ctas > num_sms or num_ctas < 1:
        _fail(s, f"{num_ctas} CTAs for {num_sms} SMs: a persistent grid must fit on the device")
    if dynamic:
        if meta.offsets.size != 0 or int(h[M.H_OFFSETS_LEN]) != 0:
            _fail(s, "dynamic schedule with CTA offsets")
    else:
        off = meta.offsets.astype(np.int64)
        if (off.size != num_ctas + 1 or int(h[M.H_OFFSETS_LEN]) != off.size or off[0] != 0
                or off[-1] != T or np.any(np.diff(off) < 0)):
            _fail(s, "CTA offsets do not partition the task table")
        if not np.array_equal(np.repeat(np.arange(num_ctas), np.diff(off)), t[:, M.C_CTA]):
            _fail(s, "CTA offsets disagree with the task->CTA assignment")


def _check_chains(s, h, t, g, dynamic: bool) -> None:
    """Chains (header ``dkv_chained``; :func:`.runs.chains`): a row with ``chain_before`` > 0 runs
    with the K, V and dK/dV registers of the CTA's previous row, so that row must be of the same
    CTA, batch, KV head and KV tile, its query head one lower, and the counts must agree from row
    to row; every chained row has steps (the kernel's path without steps stores at once). GQA
    under a full or causal mask, static dispatch, and a kernel that runs chains (not head dim
    192's: :attr:`.Geometry.kernel_chains`)."""
    chained = int(h[M.H_DKV_CHAINED])
    before, after = t[:, M.C_CHAIN_BEFORE], t[:, M.C_CHAIN_AFTER]
    if chained not in (M.DKV_UNCHAINED, M.DKV_CHAINED_ADD, M.DKV_CHAINED_WHOLE):
        _fail(s, f"metadata header field dkv_chained = {chained} is none of {M.DKV_UNCHAINED}, "
                 f"{M.DKV_CHAINED_ADD}, {M.DKV_CHAINED_WHOLE}")
    if not chained:
        if np.any(before != 0) or np.any(after != 0):
            _fail(s, "task rows carry chain columns, but the header's dkv_chained is 0")
        return
    if dynamic or g.heads == g.heads_kv or g.mask not in ("full", "causal"):
        _fail(s, "chains of a group's heads need a static schedule, GQA and a full or causal mask")
    if not g.kernel_chains:
        _fail(s, f"header dkv_chained = {chained}, but the backward kernel of {g.block_m} x {g.block_n} tiles "
                 f"(three MMA warpgroups) has no chains")
    if np.any(before < 0) or np.any(after < 0):
        _fail(s, "negative chain column")
    T = t.shape[0]
    cont = np.flatnonzero(before > 0)
    if cont.size and cont[0] == 0:
        _fail(s, "the first row continues a chain")
    p = cont - 1
    same = (t[cont][:, [M.C_CTA, M.C_BATCH, M.C_HEAD_KV, M.C_KV]] == t[p][:, [M.C_CTA, M.C_BATCH, M.C_HEAD_KV, M.C_KV]]
            ).all(axis=1)
    ok = same & (t[cont, M.C_HEAD] == t[p, M.C_HEAD] + 1) & (before[p] == before[cont] - 1) & (after[p] == after[cont] + 1)
    if not ok.all():
        i = int(cont[np.flatnonzero(~ok)[0]])
        _fail(s, f"row {i} continues a chain, but the row before it is not the previous query head of its group "
                 f"at the same KV tile on the same CTA, or the chain counts disagree")
    more = np.flatnonzero(after > 0)
    if more.size and (more[-1] == T - 1 or np.any(before[np.minimum(more + 1, T - 1)] != before[more] + 1)):
        _fail(s, "a row says its chain goes on, but the next row does not continue it")
    if np.any(t[(before > 0) | (after > 0), M.C_N_STEPS] <= 0):
        _fail(s, "a chained row has no steps")
    # WHOLE: each chain is its whole group, heads ascending from the group's first, so the
    # chain's last row holds the group's dK/dV and stores them (no accumulator, no slab).
    if chained == M.DKV_CHAINED_WHOLE and (np.any(before + after + 1 != g.group)
                                           or np.any(t[:, M.C_HEAD] % g.group != before)):
        _fail(s, "header dkv_chained = WHOLE, but a row is not in a chain of its whole group, heads ascending")


def _view(s, meta, g):
    """(meta, g) as checked: a grouped schedule's grouped view (:func:`.metadata.grouped_view`), whose
    rows are MHA tasks over a group's virtual Q tiles; anything else as it is."""
    try:
        return M.grouped_view(meta, g)
    except ValueError as e:
        _fail(s, str(e))


def unchained(meta):
    """``meta`` without chains (a new table and header)."""
    header, tasks = meta.header.copy(), meta.tasks.copy()
    header[M.H_DKV_CHAINED] = 0
    tasks[:, M.C_CHAIN_BEFORE] = tasks[:, M.C_CHAIN_AFTER] = 0
    return M.ScheduleMeta(header, meta.offsets, tasks)


def check_structure(s) -> None:
    """Checks 1-4 (everything but deadlock)."""
    T, N = s.num_tasks, s.num_steps
    meta, g = _view(s, s.meta, s.geometry)
    if g != s.geometry:
        _fail(s, f"a grouped schedule's geometry must be its grouped view ({g.describe()}), got "
                 f"{s.geometry.describe()}")
    # 1. tasks (on the metadata, whose columns must then be the schedule's)
    _check_rows(s, meta, g, s.num_sms)
    t = meta.tasks
    cols = {M.C_BATCH: s.task_batch, M.C_HEAD: s.task_head, M.C_KV: s.task_kv, M.C_N_STEPS: s.task_steps}
    for idx, val in cols.items():
        if t.shape[0] != T or not np.array_equal(t[:, idx], val):
            _fail(s, f"metadata column {M.COLUMNS[idx]} disagrees with the schedule")
    if int(meta.header[M.H_NUM_CTAS]) != s.num_ctas or s.dynamic != (int(meta.header[M.H_DISPATCH]) == M.DISPATCH_DYNAMIC):
        _fail(s, "metadata header disagrees with the schedule's CTA count or dispatch")
    if not s.dynamic and not np.array_equal(t[:, M.C_CTA], s.task_cta):
        _fail(s, "CTA offsets disagree with the task->CTA assignment")
    hidx = s.task_batch * g.heads + s.task_head
    # 2. coverage: every needed pair exactly once, by the right task
    q = s.step_q
    st = s.step_task
    if np.any((q < 0) | (q >= g.n_q)):
        _fail(s, "a step visits a Q tile out of range")
    kv = s.task_kv[st]
    outside = (q < g.q_begin[kv]) | (q >= g.q_end[kv])
    if np.any(outside):
        i = int(np.flatnonzero(outside)[0])
        _fail(s, f"task {int(st[i])} visits Q tile {int(q[i])} that KV tile {int(kv[i])} does not need (masked)")
    pair_key = (hidx[st] * g.n_kv + kv) * g.n_q + q
    sk = np.sort(pair_key)
    dup = np.flatnonzero(sk[1:] == sk[:-1])
    if dup.size:
        k = int(sk[dup[0]])
        _fail(s, f"pair (head {k // (g.n_kv * g.n_q)}, kv {k // g.n_q % g.n_kv}, q {k % g.n_q}) visited twice")
    if N != g.num_steps:
        _fail(s, f"{N} steps, the mask needs {g.num_steps}")
    # 3. ranks
    if np.any(s.step_rank < 0):
        _fail(s, "negative rank")
    _check_permutation(s, s.step_dq_tile, s.step_rank, "dQ tile")
    # 4. metadata decodes to the schedule's orders
    row, step, dq, drank = M.decode_all(meta.header, t)
    if not np.array_equal(row, st) or not np.array_equal(step, s.step_index):
        _fail(s, "metadata step counts disagree with the schedule")
    if not np.array_equal(dq, q):
        i = int(np.flatnonzero(dq != q)[0])
        _fail(s, f"metadata decodes task {int(st[i])} step {int(s.step_index[i])} to Q tile {int(dq[i])}, "
                 f"the schedule visits {int(q[i])}")
    if not np.array_equal(drank, s.step_rank):
        i = int(np.flatnonzero(drank != s.step_rank)[0])
        _fail(s, f"metadata decodes task {int(st[i])} step {int(s.step_index[i])} (q {int(q[i])}) to rank "
                 f"{int(drank[i])}, the schedule says {int(s.step_rank[i])}")


#: Steps one thread of :func:`check_metadata` decodes at once (about 0.3 GB of temporaries), and
#: its threads (each also holds two (Q tiles x KV tiles) grids of one head).
CHECK_CHUNK_STEPS = 1 << 21
CHECK_THREADS = 4


def _row_potential(meta, g, num_sms: int) -> tuple[np.ndarray | None, int, bool]:
    """(potential of each row's first step, the width of a row's span, strict): the deadlock
    certificate's potential phi of step s of row r is pot[r] + s. It must rise strictly along every
    CTA's program, and along every dQ tile's rank order rise (strict) or not fall (not strict).

    Dynamic dispatch (queue schedules): phi orders by claim: the row's place in the queue. Only its
    place among its head's rows matters (a wait never leaves its head), which check_metadata
    derives from the table order, so no per-row potential is returned (None).
    ``runs``: the row's planned start within its CTA's run (steps before it there).
    A queue dealt to CTAs ahead of the launch (``groups``): the row's place in the queue
    (:func:`_queue_potential`).
    Static shift schedules: the planned time (wave, step within the unit) they rank dQ adds by
    (:func:`.metadata.planned_wave`); ties in a dQ tile are allowed there, since a cycle would
    need a program-order edge, and those rise strictly."""
    h, t = meta.header, meta.tasks.astype(np.int64)
    if int(h[M.H_DISPATCH]) == M.DISPATCH_DYNAMIC:
        return None, g.n_q + 1, True
    span = 2 * g.n_q + 1
    if int(h[M.H_RANK_KIND]) == M.RANK_RUN:
        return _run_potential(t), span, False
    if int(h[M.H_RANK_KIND]) in (M.RANK_ASC, M.RANK_DESC):
        return _queue_potential(t) * span, span, False
    if int(h[M.H_RANK_KIND]) not in (M.RANK_SHIFT, M.RANK_SPLIT):
        raise ValueError("check_metadata certifies queue schedules dispatched dynamically and the static shift "
                         "schedules; validate other static task lists with build_schedule(...).validate()")
    hidx = t[:, M.C_BATCH] * g.heads + t[:, M.C_HEAD]
    section = int(h[M.H_HEAD_SECTION])
    if section < 0 or (section and int(h[M.H_RANK_KIND]) != M.RANK_SPLIT):
        raise ScheduleError(f"header head_section = {section}: sections are for the SPLIT rank kind only")
    wave = M.planned_wave(hidx, t[:, M.C_UNIT], int(h[M.H_UNITS_PER_HEAD]), num_sms, section, g.num_heads_total)
    return wave * span + M.planned_t0(g, t[:, M.C_ROLE], t[:, M.C_UNIT]), span, False


def _queue_potential(t: np.ndarray) -> np.ndarray:
    """The rows' places in the queue a static table was dealt from by the claim model
    (:func:`.schedules.greedy_assignment`, costs :func:`.schedules.task_claim_cost`; a chain's rows
    claimed as one). The model hands out queue entries in strictly increasing (start, CTA) order,
    so sorting the chains by their planned start on their CTA, then by CTA, recovers the queue;
    a chain's rows follow its first. Where the table was dealt otherwise the potential is still
    some order, and the checks on it fail rather than pass wrongly."""
    T = t.shape[0]
    cost = np.maximum(t[:, M.C_N_STEPS], 1)
    cta = t[:, M.C_CTA]
    i = np.arange(T, dtype=np.int64)
    ends = np.cumsum(cost)
    first_of_cta = np.maximum.accumulate(np.where(np.r_[True, cta[1:] != cta[:-1]], i, 0))
    start = ends - cost - (ends[first_of_cta] - cost[first_of_cta])
    chain_start = start[i - t[:, M.C_CHAIN_BEFORE]]
    order = np.lexsort((t[:, M.C_CHAIN_BEFORE], cta, chain_start))
    pot = np.empty(T, dtype=np.int64)
    pot[order] = i
    return pot


def _turn_predecessors(t: np.ndarray) -> np.ndarray:
    """Per row, the row of the previous query head of its group at its (batch, KV tile): the turn
    its dK/dV add waits for under ``dkv_ordered`` (-1: the group's first head)."""
    order = np.lexsort((t[:, M.C_HEAD], t[:, M.C_KV], t[:, M.C_HEAD_KV], t[:, M.C_BATCH]))
    key = t[order][:, [M.C_BATCH, M.C_HEAD_KV, M.C_KV]]
    same = (key[1:] == key[:-1]).all(axis=1)
    pred = np.full(t.shape[0], -1, dtype=np.int64)
    pred[order[1:][same]] = order[:-1][same]
    return pred


def _run_potential(t: np.ndarray) -> np.ndarray:
    """The rows' potentials of a ``runs`` schedule: a row's planned start in steps. A run's rows
    follow each other; where a group's dK/dV turn comes from another run (a run boundary cuts the
    group: the lower heads sit in later runs), the row starts no earlier than that turn ends, so
    the epilogues' potentials do not fall along the turns (:func:`dkv_order_ok`). Every dQ wait
    of ``runs`` points to an earlier add of the same run. Runs are planned from the last, whose
    rows take no turn from another run."""
    n = np.maximum(t[:, M.C_N_STEPS], 1)
    cta = t[:, M.C_CTA]
    pred = _turn_predecessors(t)
    pot = np.zeros(t.shape[0], dtype=np.int64)
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(cta) != 0) + 1, [t.shape[0]]])
    for lo, hi in reversed(list(zip(bounds[:-1], bounds[1:]))):
        base = np.cumsum(n[lo:hi]) - n[lo:hi]
        p = pred[lo:hi]
        other = (p >= 0) & ((p < lo) | (p >= hi))
        # the start a turn from another run needs (its end, this row's last step level with it)
        need = np.where(other, pot[np.maximum(p, 0)] + n[np.maximum(p, 0)] - n[lo:hi] - base, 0)
        pot[lo:hi] = base + np.maximum.accumulate(np.maximum(need, 0))
    return pot


def dkv_order_ok(meta, geometry, num_sms: int) -> bool:
    """Whether the kernel may add a GQA group's dK/dV in turns (header ``dkv_ordered``): at each
    (batch, KV head, KV tile) the group's query heads store or add in ascending head order, each
    task's epilogue waiting for the previous head's. Deadlock-free when each such wait points to a
    task that finishes no later in the certificate of :func:`check_metadata`: the epilogue of a
    row has the potential of its last step (ordered after that step, before the next row's first
    on its CTA), and it must not fall from one head to the next (queue order: rise). Full and
    causal masks with GQA only, every task with steps."""
    g = geometry
    if g.heads == g.heads_kv or g.mask not in ("full", "causal"):
        return False
    t = meta.tasks.astype(np.int64)
    n_steps = t[:, M.C_N_STEPS]
    if t.shape[0] == 0 or (n_steps <= 0).any():
        return False
    pot, _, strict = _row_potential(meta, g, num_sms)
    # dynamic dispatch: the queue (table) order; static: the last step's potential
    end = np.arange(t.shape[0], dtype=np.int64) if pot is None else pot + n_steps - 1
    order = np.lexsort((t[:, M.C_HEAD], t[:, M.C_KV], t[:, M.C_HEAD_KV], t[:, M.C_BATCH]))
    key = t[order][:, [M.C_BATCH, M.C_HEAD_KV, M.C_KV]]
    same = (key[1:] == key[:-1]).all(axis=1)
    e = end[order]
    bad = same & ((e[1:] <= e[:-1]) if strict else (e[1:] < e[:-1]))
    return not bool(bad.any())


#: Q tiles per head from which ``sections`` adds a GQA group's dK/dV in turns (:func:`dkv_order_pays`).
SECTIONS_TURNS_MIN_Q_TILES = 16


def dkv_order_pays(meta, geometry, num_sms: int) -> bool:
    """Whether adding a GQA group's dK/dV in turns is expected to cost no time against the slabs
    (it always saves (group - 1) / group of their bytes), by the H100 A/B behind this rule
    (docs/journal/rect-bwd.md): a static schedule (a queue claims a group's equal tasks side by
    side, so each waits for the one before: 10-17% slower), steps of at most 64 query rows (the
    head dims from 96 on; at 64, whose 128-row steps halve the tasks, turns were 1-5% slower),
    and consecutive heads of every KV tile planned at most a wave apart, so the accumulator is
    still in L2 when the next head adds into it (two waves apart: 2-5% slower). ``runs``
    always: it places a group's heads of a KV tile one after the other on one CTA for the
    turns. ``sections``, a queue, from ``SECTIONS_TURNS_MIN_Q_TILES`` Q tiles per head: it
    queues a group's heads one place apart, a place being a KV tile of every head of its L2
    section, and tasks that long end before the next head's task of the tile reaches its
    epilogue. Presumes :func:`dkv_order_ok`."""
    g = geometry
    if int(meta.header[M.H_RANK_KIND]) == M.RANK_RUN:
        return True  # a group's heads of a KV tile follow each other on one CTA (.runs)
    if g.block_m > 64:
        return False
    if int(meta.header[M.H_DISPATCH]) != M.DISPATCH_STATIC:
        # sections queues a group's heads one place apart (schedules._dynamic_tasks); with
        # tasks of few steps the group's tasks of a KV tile still run side by side and each
        # waits for the adds before its own (journal/rect-bwd.md, run 10)
        return (SCHEDULES[int(meta.header[M.H_SCHEDULE])] == "sections"
                and g.n_q >= SECTIONS_TURNS_MIN_Q_TILES)
    pot, span, _ = _row_potential(meta, g, num_sms)
    t = meta.tasks.astype(np.int64)
    order = np.lexsort((t[:, M.C_HEAD], t[:, M.C_KV], t[:, M.C_HEAD_KV], t[:, M.C_BATCH]))
    key = t[order][:, [M.C_BATCH, M.C_HEAD_KV, M.C_KV]]
    same = (key[1:] == key[:-1]).all(axis=1)
    p = pot[order]
    return bool((np.abs(p[1:] - p[:-1])[same] <= span).all())


def with_dkv_order(meta, geometry, num_sms: int):
    """``meta`` with its header's ``dkv_ordered`` set where the turns are safe
    (:func:`dkv_order_ok`) and pay (:func:`dkv_order_pays`) (a new header). Chains go between
    turns, so a table whose turns are not safe loses its chains (:func:`unchained`)."""
    if int(meta.header[M.H_DKV_CHAINED]) == M.DKV_CHAINED_WHOLE:
        return meta  # a whole group's chain stores its dK/dV: no turns to order
    ordered = dkv_order_ok(meta, geometry, num_sms) and dkv_order_pays(meta, geometry, num_sms)
    if not ordered and int(meta.header[M.H_DKV_CHAINED]):
        meta = unchained(meta)
    header = meta.header.copy()
    header[M.H_DKV_ORDERED] = int(ordered)
    return M.ScheduleMeta(header, meta.offsets, meta.tasks)


def check_metadata(meta, geometry, num_sms: int) -> None:
    """The kernel path's validation of a built-in schedule's metadata (:func:`.schedules.build_metadata`),
    on what the kernel decodes, in bounded memory. Raises :class:`ScheduleError`.

    What it proves, from the decoded steps alone: every (kv, q) pair the mask needs is visited
    exactly once, by its KV tile's task; every dQ tile's ranks are 0..k-1; and the wait-for graph
    is acyclic, by a potential (:func:`_row_potential`) that rises along program order and does not
    fall along any semaphore wait. Heads whose rows are alike (the decode reads no head index) are
    decoded once. It does not compare the orders with the schedule's definition: that is
    :meth:`.schedules.Schedule.validate` (checks 3-4), which the tests run against this path."""
    s = _Named(SCHEDULES[int(meta.header[M.H_SCHEDULE])] if 0 <= int(meta.header[M.H_SCHEDULE]) < len(SCHEDULES)
               else "?", geometry, num_sms)
    meta, g = _view(s, meta, geometry)
    h = meta.header
    _check_rows(s, meta, g, num_sms)
    t = meta.tasks.astype(np.int64)
    pot, span, strict = _row_potential(meta, g, num_sms)
    n_steps = t[:, M.C_N_STEPS]
    if int(h[M.H_DKV_ORDERED]) not in (0, 1) or (int(h[M.H_DKV_ORDERED]) and not dkv_order_ok(meta, g, num_sms)):
        _fail(s, f"header dkv_ordered = {int(h[M.H_DKV_ORDERED])}, but dK/dV turns need GQA under a full or causal "
                 f"mask, every task with steps, and each head of a group finishing no earlier than the one before")
    if int(h[M.H_DKV_CHAINED]) == M.DKV_CHAINED_ADD and not int(h[M.H_DKV_ORDERED]):
        _fail(s, "header dkv_chained = ADD without dkv_ordered: a chain adds its dK/dV in the turn of its first head")
    if int(h[M.H_DKV_CHAINED]) == M.DKV_CHAINED_WHOLE and int(h[M.H_DKV_ORDERED]):
        _fail(s, "header dkv_chained = WHOLE with dkv_ordered: a whole group's chain stores, it takes no turn")
    if int(h[M.H_DISPATCH]) == M.DISPATCH_STATIC:
        # program order: each CTA runs its rows in table order, each row its steps in order
        has = np.flatnonzero(n_steps > 0)
        first, last, cta = pot[has], pot[has] + n_steps[has] - 1, t[has, M.C_CTA]
        same = cta[1:] == cta[:-1]
        bad = np.flatnonzero(same & (first[1:] <= last[:-1]))
        if bad.size:
            r = int(has[bad[0] + 1])
            _fail(s, f"deadlock risk: row {r} on CTA {int(t[r, M.C_CTA])} is not planned after the row before it")
    # per head: its rows in table order; heads alike up to their index and a shift of the potential
    H, n_kv, n_q = g.num_heads_total, g.n_kv, g.n_q
    order = np.argsort(t[:, M.C_BATCH] * g.heads + t[:, M.C_HEAD], kind="stable")
    rows = t[order].reshape(H, n_kv, M.NUM_COLS)
    if strict:   # queue order: a row's place among its head's rows (stable sort: in the queue's order)
        hpot = np.broadcast_to(np.arange(n_kv, dtype=np.int64) * span, (H, n_kv))
    else:        # planned time, from the head's first wave
        hpot = pot[order].reshape(H, n_kv)
        hpot = hpot - (hpot.min(axis=1, keepdims=True) // span) * span
    if hpot.size and int(hpot.max()) + span >= np.iinfo(np.int32).max:
        raise OverflowError("schedule potential does not fit in int32")
    keep = [c for c in range(M.NUM_COLS) if c not in (M.C_BATCH, M.C_HEAD, M.C_HEAD_KV, M.C_CTA)]
    sig = np.concatenate([rows[:, :, keep].reshape(H, -1), hpot], axis=1)
    _, reps = np.unique(sig, axis=0, return_index=True)
    kvb, kve = g.kv_begin, g.kv_end
    n_sp = int(h[M.H_NUM_SPLITS])

    def check_head(head: int) -> None:
        R, P = rows[head], hpot[head]
        # contributions per (dQ split, dQ tile) of this head: the split's KV tiles [sb, se) that
        # meet the tile (a split whose tiles are not contiguous makes the count check below fail)
        sb, se = np.full(n_sp, n_kv, dtype=np.int64), np.zeros(n_sp, dtype=np.int64)
        np.minimum.at(sb, R[:, M.C_SPLIT], R[:, M.C_KV])
        np.maximum.at(se, R[:, M.C_SPLIT], R[:, M.C_KV] + 1)
        contrib = np.maximum(0, np.minimum(kve[None, :], se[:, None]) - np.maximum(kvb[None, :], sb[:, None]))
        pair_seen = np.zeros(n_kv * n_q, dtype=bool)
        phi = np.full(n_sp * n_q * n_kv, -1, dtype=np.int32)  # potential of the add of rank r into (split, q)
        bounds = np.searchsorted(np.cumsum(R[:, M.C_N_STEPS]), np.arange(0, int(R[:, M.C_N_STEPS].sum()),
                                                                         CHECK_CHUNK_STEPS), side="right")
        bounds = np.unique(np.concatenate([[0], bounds, [n_kv]]))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            row, step, q, rank = M.decode_all(h, R[lo:hi])
            kv = R[lo:hi, M.C_KV][row]
            ok = (q >= g.q_begin[kv]) & (q < g.q_end[kv])
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                _fail(s, f"head {head}: KV tile {int(kv[i])} step {int(step[i])} visits Q tile {int(q[i])}, "
                         f"which the mask does not pair with it")
            cell = R[lo:hi, M.C_SPLIT][row] * n_q + q
            okr = (rank >= 0) & (rank < contrib.reshape(-1)[cell])
            if not okr.all():
                i = int(np.flatnonzero(~okr)[0])
                _fail(s, f"head {head}: dQ tile {int(q[i])} gets rank {int(rank[i])} of "
                         f"{int(contrib.reshape(-1)[cell[i]])}")
            pair_seen[kv * n_q + q] = True
            phi[cell * n_kv + rank] = P[lo:hi][row] + step
        # as many distinct cells as steps: no pair twice, and ranks 0..k-1 of every dQ tile
        if np.count_nonzero(pair_seen) != g.num_steps // H or np.count_nonzero(phi >= 0) != g.num_steps // H:
            _fail(s, f"head {head}: a (kv, q) pair is visited twice or a dQ tile's ranks are not 0..k-1")
        grid = phi.reshape(n_sp * n_q, n_kv)
        waits = np.arange(1, n_kv) < contrib.reshape(-1)[:, None]  # ((split, q), rank r >= 1) exists
        before, after = grid[:, :-1], grid[:, 1:]
        bad = waits & ((before >= after) if strict else (before > after))
        if bad.any():
            cell, r = (int(x[0]) for x in np.nonzero(bad))
            qq = cell % n_q
            _fail(s, f"deadlock risk: in head {head}, dQ tile {qq} (split {cell // n_q})'s add of rank {r + 1} "
                     f"may wait on one the schedule runs later (potential {int(before[cell, r])} -> {int(after[cell, r])})")

    heads = sorted(reps.tolist())
    workers = min(CHECK_THREADS, len(heads), os.cpu_count() or 1)
    if workers <= 1:
        for head in heads:
            check_head(head)
        return
    # numpy's array operations release the GIL: heads check side by side (the first failing head,
    # in order, is the one reported)
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(check_head, heads):
            pass


def check_deadlock_free(s):
    """Check 5.  Returns the unit-cost model's (collisions, unit makespan) of a static
    schedule, None for a dynamic one (:func:`.model.simulate.unit_model` gives them)."""
    N, T = s.num_steps, s.num_tasks
    if s.dynamic:
        G = fused_graph(s, chain_prev_task(s))
        idx = np.arange(G.size)
        has = G.sync < G.NONE
        bad = np.flatnonzero(has & (G.sync >= idx))
        if bad.size:
            v = int(bad[0])  # a step: epilogues wait on no other task
            _fail(s, f"deadlock risk: task {int(s.step_task[v])} (claimed #{int(s.step_task[v])}) waits on "
                     f"task {int(s.step_task[G.sync[v]])}, which is claimed later")
        return None
    G = fused_graph(s, chain_prev_task(s))
    task_cta = s.task_cta.astype(np.int64)
    node_cta = np.concatenate([task_cta[s.step_task], task_cta])
    pre = np.concatenate([np.ones(N), np.zeros(T)])
    post = np.concatenate([np.ones(N), np.zeros(T)])
    ft = evaluate_fused(G, pre, post, node_cta, 0.0)
    if ft.done != G.size:
        stuck = np.flatnonzero(np.isnan(ft.start))
        v = int(stuck[0])
        desc = (f"task {int(s.step_task[v])} step {int(s.step_index[v])} (CTA {int(task_cta[s.step_task[v]])})"
                if v < N else f"epilogue of task {v - N}")
        _fail(s, f"deadlock: the wait-for graph has a cycle; {stuck.size} of {G.size} nodes can never run, "
                 f"e.g. {desc}")
    ce = ft.start[:N] + 1.0
    waits = int((ft.ready_start[:N] > ce + 1e-9).sum())
    return waits, float(ft.finish.max()) if G.size else 0.0


def validate(s) -> ValidationReport:
    """Run every check; raise :class:`ScheduleError` on the first failure."""
    check_structure(s)
    unit_model = check_deadlock_free(s)
    return ValidationReport(schedule=s.name, num_sms=s.num_sms, num_ctas=s.num_ctas, dispatch=s.dispatch,
                            num_tasks=s.num_tasks, num_steps=s.num_steps, metadata_bytes=s.meta.nbytes,
                            _unit_model=unit_model)
