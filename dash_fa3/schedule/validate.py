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
dynamic ones they need the research model's greedy-dispatch simulation, run
only when the report's ``collisions`` or ``unit_makespan`` is read (the
kernel path never reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import metadata as M
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
    # (collisions, unit makespan) of the unit-cost model, or a function that computes them
    _unit_model: object = field(repr=False, compare=False)

    @property
    def valid(self) -> bool:
        return True

    @cached_property
    def _unit(self) -> tuple[int, float]:
        return self._unit_model() if callable(self._unit_model) else self._unit_model

    @property
    def collisions(self) -> int:
        """Forced semaphore waits in the unit-cost model."""
        return self._unit[0]

    @property
    def unit_makespan(self) -> float:
        """Makespan with c = r = 1, no latency."""
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


def check_structure(s) -> None:
    """Checks 1-4 (everything but deadlock)."""
    g = s.geometry
    T, N = s.num_tasks, s.num_steps
    # 1. tasks
    hidx = s.task_batch * g.heads + s.task_head
    if np.any((s.task_batch < 0) | (s.task_batch >= g.batch) | (s.task_head < 0) | (s.task_head >= g.heads)
              | (s.task_kv < 0) | (s.task_kv >= g.n_kv)):
        _fail(s, "task with batch/head/kv_tile out of range")
    tkey = hidx * g.n_kv + s.task_kv
    want = np.arange(g.num_heads_total * g.n_kv, dtype=np.int64)
    got = np.sort(tkey)
    if got.size != want.size or not np.array_equal(got, want):
        dup = got[1:][got[1:] == got[:-1]]
        _fail(s, f"tasks are not one per (batch, head, kv tile): {T} tasks, expected {want.size}"
                 + (f"; duplicate task key {int(dup[0])}" if dup.size else ""))
    if np.any(s.task_steps != g.task_len[s.task_kv]):
        bad = int(np.flatnonzero(s.task_steps != g.task_len[s.task_kv])[0])
        _fail(s, f"task {bad} (kv {int(s.task_kv[bad])}) has {int(s.task_steps[bad])} steps, "
                 f"needs {int(g.task_len[s.task_kv[bad]])}")
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
    # 4. metadata
    meta = s.meta
    h = meta.header
    if meta.tasks.shape != (T, M.NUM_COLS) or h.size != M.HEADER_LEN:
        _fail(s, "metadata has the wrong shape")
    expect = {M.H_MAGIC: M.MAGIC, M.H_VERSION: M.METADATA_VERSION, M.H_NUM_TASKS: T, M.H_NUM_STEPS: N,
              M.H_NUM_CTAS: s.num_ctas, M.H_N_Q: g.n_q, M.H_N_KV: g.n_kv, M.H_NUM_COLS: M.NUM_COLS,
              M.H_BATCH: g.batch, M.H_HEADS: g.heads, M.H_HEADS_KV: g.heads_kv,
              M.H_SEQLEN_Q: g.seqlen_q, M.H_SEQLEN_K: g.seqlen_k, M.H_BLOCK_M: g.block_m,
              M.H_BLOCK_N: g.block_n, M.H_MASK: M.MASK_CODES[g.mask], M.H_WINDOW_LEFT: g.window_left,
              M.H_WINDOW_RIGHT: g.window_right,
              M.H_DISPATCH: M.DISPATCH_DYNAMIC if s.dynamic else M.DISPATCH_STATIC}
    for idx, val in expect.items():
        if int(h[idx]) != val:
            _fail(s, f"metadata header field {M.HEADER_FIELDS[idx]} = {int(h[idx])}, expected {val}")
    t = meta.tasks
    cols = {M.C_BATCH: s.task_batch, M.C_HEAD: s.task_head, M.C_KV: s.task_kv, M.C_N_STEPS: s.task_steps,
            M.C_HEAD_KV: s.task_head // g.group}
    for idx, val in cols.items():
        if not np.array_equal(t[:, idx], val):
            _fail(s, f"metadata column {M.COLUMNS[idx]} disagrees with the schedule")
    if s.num_ctas > s.num_sms or s.num_ctas < 1:
        _fail(s, f"{s.num_ctas} CTAs for {s.num_sms} SMs: a persistent grid must fit on the device")
    if s.dynamic:
        if meta.offsets.size != 0 or int(h[M.H_OFFSETS_LEN]) != 0:
            _fail(s, "dynamic schedule with CTA offsets")
    else:
        off = meta.offsets.astype(np.int64)
        if (off.size != s.num_ctas + 1 or int(h[M.H_OFFSETS_LEN]) != off.size or off[0] != 0
                or off[-1] != T or np.any(np.diff(off) < 0)):
            _fail(s, "CTA offsets do not partition the task table")
        cta_of_row = np.repeat(np.arange(s.num_ctas), np.diff(off))
        if not np.array_equal(cta_of_row, s.task_cta) or not np.array_equal(t[:, M.C_CTA], s.task_cta):
            _fail(s, "CTA offsets disagree with the task->CTA assignment")
    row, step, dq, drank = M.decode_all(h, t)
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


def _dynamic_unit_model(s) -> tuple[int, float]:
    from .model.simulate import CostModel, simulate
    sim = simulate(s, CostModel(1.0, 1.0, pipeline="serial"))  # the paper's collisions
    return sim.waits, sim.makespan


def check_deadlock_free(s):
    """Check 5.  Returns the unit-cost model's (collisions, unit makespan), for
    dynamic schedules as a function that computes them."""
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
        return lambda: _dynamic_unit_model(s)
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
