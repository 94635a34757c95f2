"""Event simulator: S SMs running a schedule.

Two pipelines (``CostModel.pipeline``):

``"writer"`` (default): what the backward kernel does (docs/design/kernels-bwd.md).
Per CTA two resources run concurrently:

* the MMA warpgroups run the CTA's steps back to back: step j computes its
  partial dQ (cost ``c``; ``masked_compute`` for a tile that needs the causal
  or sequence-end mask), then hands it to the dQ writer through shared-memory
  buffer ``j % buffers`` (2 in the kernel).  The hand-off waits only until
  that buffer is free again, i.e. until the reduce-add of step ``j - buffers``
  has *read* it (``read`` after it started); the wait comes after the
  fraction ``handoff_at`` of the step's compute (the rest, the dK GEMM, runs
  on during it) and the step ends at the later of its compute and the
  hand-off, when the writer may start the add.  A task ends with its epilogue
  (``epilogue``: the dK/dV store; the next task starts after it), except a
  row that hands its chain on (:func:`epilogue_weights`): the chain stores once;
* the dQ writer handles the CTA's steps in order, one buffer's steps per
  writer warp: writer ``b`` takes step j (``j % buffers == b``) once it has
  finished step ``j - buffers``; deterministic mode then waits until the
  contribution ranked just before it (any CTA) has been released, plus
  ``latency`` (the semaphore round trip through L2: it applies to every
  hand-off, also between the two writers of one CTA), and until the MMA
  warps have handed the step over; then it issues the reduce-add.  The add
  has read the buffer after ``read`` and completed after ``reduce``; in
  deterministic mode the writer releases the semaphore at completion and
  only then moves on, in non-deterministic mode (``deterministic=False``) it
  moves on once the buffer is read and never waits for another CTA.

Dynamically dispatched schedules are run as the kernel runs them: lowered to
static CTA lists (:mod:`..lowering`: tasks in queue order to the CTA that frees
first under a cost of one per step).  A CTA is done when its epilogue and its
last add are; the makespan is the latest CTA.  ``work`` is the MMA warps' busy
time (computes + epilogues; the adds overlap it), ``lower_bound = work / S``.

``"serial"``: the DASH paper's DAG (Sec. 3), kept for its closed forms.  A
step is ``compute -> reduce`` on the SM: the reduce may start only after the
step's compute is done AND the previous-ranked contribution to the same dQ
tile has finished its reduce (+ ``latency`` when that ran on another SM); the
SM is busy during compute and reduce and idle while it waits; a task ends with
its epilogue, which waits for no other task.  Dynamic schedules are dispatched
greedily (the next task in queue order to the first SM that becomes free,
ties: lowest SM id); static ones are evaluated on the DAG
(:func:`..waitgraph.evaluate_fused`).  ``work`` counts computes, reduces and
epilogues.

In both, the postprocess that sums a GQA group's dK/dV partials is a separate
kernel after this one and is not modelled.

``scale="constant"`` (default): c and r per step are constants, matching the
kernel, which runs full tiles (TMA pads ragged tiles, masked tiles are
computed then masked; ``masked_compute`` prices the masking).
``scale="elements"``: c scales with the fraction of the tile's elements that
are inside both sequences and the mask, r with the fraction of valid Q rows;
useful to study ragged shapes.

Costs fitted to measured H100 times are in
:mod:`.calibration`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from ..waitgraph import chain_prev_task, evaluate_fused, fused_graph


PIPELINES = ("writer", "serial")


@dataclass(frozen=True)
class CostModel:
    """Costs of the simulated kernel (arbitrary time unit; the calibration's is microseconds).

    compute:        c, one step's MMA work (partial dQ, dK/dV update) on a tile without mask
    reduce:         r, one reduce-add of a partial dQ until it has completed (writer: the
                    semaphore is released then)
    latency:        semaphore hand-off: release -> the waiting writer sees it (writer: every
                    hand-off; serial: only between SMs)
    epilogue:       per task, after its last step: the dK/dV store
    scale:          "constant" or "elements" (see the module doc)
    masked_compute: c of a tile that needs the mask (None: ``compute``)
    read:           writer: from the add's start until it has read its sdQ buffer, which is
                    then free again (None: ``reduce``, the buffer is free at completion)
    buffers:        writer: sdQ buffers = writer warps per CTA (the kernel's kStagesDq, 2)
    deterministic:  writer: False runs the non-deterministic mode (no semaphores, a writer
                    moves on once its buffer is read)
    pipeline:       "writer" (the kernel) or "serial" (the paper's DAG)
    handoff_at:     writer: the fraction of a step's compute after which the MMA warps wait for
                    a free sdQ buffer (the kernel: after the dQ GEMM, with the dK GEMM, the
                    step's last, still running; the step ends at the later of its compute and
                    the hand-off).  1: at the end of the step
    """

    compute: float = 1.0
    reduce: float = 1.0
    latency: float = 0.0
    epilogue: float = 0.0
    scale: str = "constant"   # or "elements"
    masked_compute: float | None = None
    read: float | None = None
    buffers: int = 2
    deterministic: bool = True
    pipeline: str = "writer"
    handoff_at: float = 1.0

    def __post_init__(self):
        if self.scale not in ("constant", "elements"):
            raise ValueError(f"CostModel.scale must be 'constant' or 'elements', got {self.scale!r}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"CostModel.pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        for f in ("compute", "reduce", "latency", "epilogue", "masked_compute", "read"):
            v = getattr(self, f)
            if v is not None and not v >= 0:
                raise ValueError(f"CostModel.{f} must be >= 0")
        if self.read is not None and self.read > self.reduce:
            raise ValueError("CostModel.read must be <= reduce (an add has read its buffer before it completes)")
        if isinstance(self.buffers, bool) or not isinstance(self.buffers, int) or self.buffers < 1:
            raise ValueError(f"CostModel.buffers must be a positive integer, got {self.buffers!r}")
        if not 0.0 < self.handoff_at <= 1.0:
            raise ValueError(f"CostModel.handoff_at must be in (0, 1], got {self.handoff_at!r}")
        if self.pipeline == "serial" and not self.deterministic:
            raise ValueError("the serial (paper) pipeline models the deterministic mode only")

    def replace(self, **kw) -> "CostModel":
        return replace(self, **kw)

    @property
    def read_time(self) -> float:
        return float(self.reduce if self.read is None else self.read)

    def step_costs(self, schedule) -> tuple[np.ndarray, np.ndarray]:
        """(c, r) float arrays, one entry per step of ``schedule``."""
        N = schedule.num_steps
        g = schedule.geometry
        c = np.full(N, float(self.compute))
        if self.masked_compute is not None and N:
            kv = schedule.task_kv[schedule.step_task]
            c[g.tiles.needs_mask(g.real_q(schedule.step_q), kv)] = float(self.masked_compute)
        if self.scale == "constant":
            return c, np.full(N, float(self.reduce))
        kv = schedule.task_kv[schedule.step_task]
        q = schedule.step_q
        c = c * g.valid_elements(kv, q) / float(g.block_m * g.block_n)
        r = self.reduce * g.valid_rows(q) / float(g.block_m)
        return c.astype(float), r.astype(float)


@dataclass
class SimResult:
    schedule: str
    num_sms: int
    makespan: float
    work: float                 # busy time: serial, c + r + epilogues; writer, the MMA warps' c + epilogues
    lower_bound: float          # work / num_sms
    sm_idle_fraction: float     # 1 - work / (num_sms * makespan)
    waits: int                  # adds that waited for their semaphore: collisions
    wait_time: float            # serial: sum of (reduce start - compute end); writer: sum of semaphore waits
    # timeline, one entry per step (schedule step order)
    step_cta: np.ndarray
    step_start: np.ndarray      # compute start
    step_compute_end: np.ndarray
    step_reduce_start: np.ndarray
    step_end: np.ndarray        # the add has completed (writer: semaphore released)
    # one entry per task
    task_cta: np.ndarray
    task_start: np.ndarray
    task_end: np.ndarray        # epilogue end
    epilogue_start: np.ndarray
    pipeline: str = "serial"
    # writer pipeline only (serial: step_handoff = step_reduce_start, no stalls)
    step_handoff: np.ndarray | None = None   # the MMA warps handed the partial dQ over
    buffer_stalls: int = 0                   # steps whose hand-off waited for a free sdQ buffer
    buffer_stall_time: float = 0.0

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else float("nan")

    def summary(self) -> dict:
        return {"schedule": self.schedule, "num_sms": self.num_sms, "makespan": self.makespan,
                "lower_bound": self.lower_bound, "ratio": self.ratio,
                "sm_idle_fraction": self.sm_idle_fraction, "waits": self.waits,
                "wait_time": self.wait_time, "pipeline": self.pipeline,
                "buffer_stalls": self.buffer_stalls, "buffer_stall_time": self.buffer_stall_time}


def simulate(schedule, costs: CostModel | None = None, *, num_sms: int | None = None) -> SimResult:
    """Run ``schedule`` on ``num_sms`` SMs (default: the schedule's) under ``costs``.

    Static schedules need ``num_sms >= schedule.num_ctas`` (all CTAs resident).
    With the writer pipeline a dynamic schedule runs lowered to static CTA
    lists for ``min(num_sms, tasks)`` CTAs, as the kernel launcher lowers it.
    """
    costs = costs or CostModel()
    S = int(num_sms or schedule.num_sms)
    if costs.pipeline == "writer":
        return _simulate_writer(schedule, costs, S)
    c, r = costs.step_costs(schedule)
    e = float(costs.epilogue)
    if schedule.dynamic:
        out = _simulate_dynamic(schedule, c, r, e, costs.latency, S)
    else:
        if S < schedule.num_ctas:
            raise ValueError(f"static schedule needs {schedule.num_ctas} resident CTAs, got {S} SMs")
        out = _simulate_static(schedule, c, r, e, costs.latency)
    (step_cta, st, ce, rs, en, task_cta, t_start, ep_start, t_end) = out
    work = float(c.sum() + r.sum() + e * schedule.num_tasks)
    makespan = float(t_end.max()) if t_end.size else 0.0
    wait_step = rs - ce
    eps = 1e-9 * max(1.0, makespan)
    waits = int((wait_step > eps).sum())
    wait_time = float(wait_step.sum())
    idle = max(0.0, 1.0 - work / (S * makespan)) if makespan > 0 else 0.0
    return SimResult(schedule=schedule.name, num_sms=S, makespan=makespan, work=work,
                     lower_bound=work / S, sm_idle_fraction=idle, waits=waits, wait_time=wait_time,
                     step_cta=step_cta, step_start=st, step_compute_end=ce, step_reduce_start=rs,
                     step_end=en, task_cta=task_cta, task_start=t_start, task_end=t_end,
                     epilogue_start=ep_start, pipeline="serial", step_handoff=rs)


# ------------------------------------------------------------------ writer pipeline
def unit_model(schedule) -> tuple[int, float]:
    """(collisions, makespan) of the paper's unit-cost model (c = r = 1, no latency, the serial
    pipeline): the forced semaphore waits that validation reports for static schedules, for any
    schedule, dynamic ones included."""
    sim = simulate(schedule, CostModel(1.0, 1.0, pipeline="serial"))
    return sim.waits, sim.makespan


def epilogue_counts(lens: np.ndarray, offs: np.ndarray, cta: np.ndarray, num_steps: int, weight=None):
    """Where the task epilogues of a CTA program run (tasks in program order: their
    step counts ``lens``, step offsets ``offs``, CTAs ``cta``): (before, after, only).
    ``before[p]``: epilogues between step p and the CTA's previous step (at a
    task's first step the previous task's, plus those of tasks without steps in
    between; 0 elsewhere); ``after[i]``: for task i with steps, the epilogues
    that end its CTA's program behind its last step if it is the CTA's last task
    with steps (its own and those of tasks without steps after it), else its own;
    ``only``: the most epilogues of a CTA that has no step at all. ``weight``: the
    epilogues each task counts (program order; None: one each)."""
    T = lens.size
    w = np.ones(T) if weight is None else np.asarray(weight, dtype=float)
    before = np.zeros(num_steps)
    after = w.copy()
    only = 0
    pending, last, cur = 0, -1, None

    def close():
        nonlocal only
        if last >= 0:
            after[last] = pending
        else:
            only = max(only, pending)

    for i in range(T):
        if cta[i] != cur:
            if cur is not None:
                close()
            cur, pending, last = cta[i], 0, -1
        if lens[i] > 0:
            before[offs[i]] = pending
            pending, last = w[i], i
        else:
            pending += w[i]
    if cur is not None:
        close()
    return before, after, float(only)


def epilogue_weights(schedule) -> np.ndarray:
    """Epilogues each task counts (task order): 0 for a row that hands its chain on (column
    ``chain_after`` > 0, :mod:`..groups`, :mod:`..runs`): K and V stay in shared memory and dK/dV in
    registers for the chain's next row, which starts at once; only the chain's last row stores or
    adds them. 1 for every other row."""
    from .. import metadata as M
    t = schedule.meta.tasks
    w = np.ones(schedule.num_tasks)
    if int(schedule.meta.header[M.H_DKV_CHAINED]) != M.DKV_UNCHAINED and t.shape[0] == w.size:
        w[t[:, M.C_CHAIN_AFTER] > 0] = 0.0
    return w


def kernel_program(schedule, num_sms: int | None = None):
    """(step_perm, task_perm, task_cta): the CTA programs the kernel runs.

    ``task_perm`` lists the schedule's tasks in CTA-program order (CTA by CTA,
    each CTA's tasks in the order it runs them), ``step_perm`` their steps;
    ``task_cta`` is indexed by the schedule's task.  Static schedules: their own
    table (already grouped by CTA).  Dynamic ones: the launcher's lowering.
    """
    T = schedule.num_tasks
    if schedule.dynamic:
        from ..lowering import lowering_order
        S = int(num_sms or schedule.num_sms)
        task_cta, task_perm = lowering_order(schedule, max(1, min(S, T)))
        lens = schedule.task_steps[task_perm]
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        step_perm = (np.repeat(schedule.step_offsets[task_perm] - offs[:-1], lens)
                     + np.arange(int(offs[-1]), dtype=np.int64))
        return step_perm, task_perm, np.asarray(task_cta, dtype=np.int64)
    task_cta = schedule.task_cta.astype(np.int64)
    if T and np.any(np.diff(task_cta) < 0):
        raise RuntimeError(f"{schedule.name}: static task table not grouped by CTA")
    return (np.arange(schedule.num_steps, dtype=np.int64), np.arange(T, dtype=np.int64), task_cta)


class WriterProgram:
    """The cost-independent part of a writer-pipeline simulation of one
    schedule: the CTA programs, each step's semaphore predecessor and buffer
    predecessor, and the Kahn frontiers of the wait-for graph (topological
    levels: they do not depend on the costs).  :meth:`run` evaluates it for
    per-step costs; calibration runs one program under many costs."""

    def __init__(self, schedule, num_sms: int, buffers: int = 2, deterministic: bool = True):
        N, T = schedule.num_steps, schedule.num_tasks
        self.schedule, self.num_sms = schedule, int(num_sms)
        self.deterministic = bool(deterministic)
        step_perm, task_perm, task_cta = kernel_program(schedule, num_sms)
        self.step_perm, self.task_perm, self.task_cta = step_perm, task_perm, task_cta
        lens = schedule.task_steps[task_perm]
        self.lens = lens
        p_task = np.repeat(np.arange(T, dtype=np.int64), lens)
        p_cta = task_cta[task_perm][p_task]
        self.p_cta = p_cta
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.offs = offs
        same1 = np.zeros(N, dtype=bool)
        same1[1:] = p_cta[1:] == p_cta[:-1]
        # Epilogues on the MMA warps' timeline: before a task's first step, those of
        # the tasks since the CTA's previous step (the previous task's; and with
        # windows tasks without steps, which are an epilogue alone); after a CTA's
        # last step, its last task's and those of the tasks without steps behind it.
        self.task_epilogues = epilogue_weights(schedule)
        self.epi_before, self.epi_after, self.epi_only = epilogue_counts(lens, offs, task_cta[task_perm], N,
                                                                         self.task_epilogues[task_perm])
        inv = np.empty(N, dtype=np.int64)
        inv[step_perm] = np.arange(N, dtype=np.int64)
        self.inv = inv
        pred = np.full(N, -1, dtype=np.int64)
        if self.deterministic and N:
            sp = schedule.step_predecessor
            has = sp >= 0
            pred[inv[has]] = inv[sp[has]]
        B = int(buffers)
        prevB = np.arange(N, dtype=np.int64) - B
        okB = prevB >= 0
        okB[okB] = p_cta[prevB[okB]] == p_cta[okB]
        prevB = np.where(okB, prevB, -1)
        prev1 = np.where(same1, np.arange(N, dtype=np.int64) - 1, -1)
        # Kahn frontiers (at most one step per CTA each)
        has_s = pred >= 0
        indeg = same1.astype(np.int32) + has_s.astype(np.int32)
        psucc = np.full(N, -1, dtype=np.int64)
        psucc[np.flatnonzero(same1) - 1] = np.flatnonzero(same1)
        ssucc = np.full(N, -1, dtype=np.int64)
        ssucc[pred[has_s]] = np.flatnonzero(has_s)
        levels = []
        front = np.flatnonzero(indeg == 0)
        done = 0
        while front.size:
            levels.append(front)
            done += front.size
            ps = psucc[front]
            ps = ps[ps >= 0]
            ss = ssucc[front]
            ss = ss[ss >= 0]
            indeg[ps] -= 1
            indeg[ss] -= 1
            cand = np.concatenate([ps, ss])
            cand = cand[indeg[cand] == 0]
            front = np.unique(cand) if cand.size > 1 else cand
        if done != N:
            raise RuntimeError(f"{schedule.name}: the wait-for graph has a cycle (schedule not validated?)")
        self.levels = levels
        # per level: the gathered predecessor indices (-1 -> the sentinel at N)
        self._lv = [(f, prev1[f], prevB[f], pred[f]) for f in levels]

    def run(self, c, r, rd, epilogue: float, latency: float, handoff_at: float = 1.0):
        """(start, H, end, A, semaphore waits, buffer stalls) in program order, for
        per-step costs ``c``, ``r``, ``rd`` (program order), the epilogue, the
        latency and the hand-off point (:class:`CostModel`)."""
        N = c.size
        pre = self.epi_before * float(epilogue)
        stall = np.zeros(N)
        semw = np.zeros(N)
        St = np.zeros(N)
        Hx = np.zeros(N)
        Ex = np.zeros(N + 1)              # the step's end (sdQ full); Ex[-1] = 0
        Ax = np.zeros(N + 1)
        Rel = np.full(N + 1, -np.inf)     # A + r
        Rdx = np.full(N + 1, -np.inf)     # A + rd
        Wx = np.full(N + 1, -np.inf)      # the writer is done
        det = self.deterministic
        lat = float(latency)
        phi = float(handoff_at)
        for f, p1, pb, sp in self._lv:
            st = Ex[p1] + pre[f]           # Ex[-1] = 0: a CTA's first step starts at 0
            cf = c[f]
            hr = st + cf * phi if phi != 1.0 else st + cf
            h = np.maximum(hr, Rdx[pb])
            stall[f] = h - hr
            end = np.maximum(st + cf, h) if phi != 1.0 else h
            own = np.maximum(end, Wx[pb])
            if det:
                a = np.maximum(own, Rel[sp] + lat)
                semw[f] = a - own
            else:
                a = own
            St[f] = st
            Hx[f] = h
            Ex[f] = end
            Ax[f] = a
            rel = a + r[f]
            rdd = a + rd[f]
            Rel[f] = rel
            Rdx[f] = rdd
            Wx[f] = rel if det else rdd
        return St, Hx, Ex[:N], Ax[:N], semw, stall

    def makespan(self, c, r, rd, epilogue: float, latency: float, handoff_at: float = 1.0) -> float:
        """Only the makespan (program-order costs)."""
        only = self.epi_only * float(epilogue)
        if not c.size:
            return only
        _, _, E, A, _, _ = self.run(c, r, rd, epilogue, latency, handoff_at)
        nz = self.lens > 0
        last = self.offs[1:][nz] - 1
        return float(max((E[last] + self.epi_after[nz] * float(epilogue)).max(), (A + r).max(), only))


def _simulate_writer(schedule, costs: CostModel, S: int) -> SimResult:
    N, T = schedule.num_steps, schedule.num_tasks
    if not schedule.dynamic and S < schedule.num_ctas:
        raise ValueError(f"static schedule needs {schedule.num_ctas} resident CTAs, got {S} SMs")
    prog = WriterProgram(schedule, S, costs.buffers, costs.deterministic)
    c0, r0 = costs.step_costs(schedule)
    frac = costs.read_time / costs.reduce if costs.reduce > 0 else 1.0
    step_perm, task_perm, task_cta = prog.step_perm, prog.task_perm, prog.task_cta
    c, r = c0[step_perm], r0[step_perm]
    rd = r * frac if costs.read is not None else r
    e = float(costs.epilogue)
    start_p, H, E, A, sem_w, stall = prog.run(c, r, rd, e, float(costs.latency), costs.handoff_at)
    lens, offs, inv = prog.lens, prog.offs, prog.inv
    # back to schedule order
    st = np.empty(N); ce = np.empty(N); hs = np.empty(N); rs = np.empty(N); en = np.empty(N)
    st[step_perm] = start_p
    ce[step_perm] = start_p + c
    hs[step_perm] = H
    rs[step_perm] = A
    en[step_perm] = A + r
    t_start = np.zeros(T); ep_start = np.zeros(T); t_end = np.zeros(T)
    nz = lens > 0
    first_p = offs[:-1][nz]
    last_p = offs[1:][nz] - 1
    tp = task_perm[nz]
    t_start[tp] = start_p[first_p]
    ep_start[tp] = E[last_p]
    we = prog.task_epilogues * e
    t_end[tp] = E[last_p] + we[tp]
    if not nz.all():  # tasks without steps: their epilogue follows the previous task's on the CTA
        cta_p = task_cta[task_perm]
        for i in np.flatnonzero(~nz).tolist():
            t = task_perm[i]
            prev = t_end[task_perm[i - 1]] if i > 0 and cta_p[i - 1] == cta_p[i] else 0.0
            t_start[t] = ep_start[t] = prev
            t_end[t] = prev + we[t]
    makespan = float(max(t_end.max() if T else 0.0, (A + r).max() if N else 0.0))
    work = float(c.sum() + we.sum())
    eps = 1e-9 * max(1.0, makespan)
    idle = max(0.0, 1.0 - work / (S * makespan)) if makespan > 0 else 0.0
    return SimResult(schedule=schedule.name, num_sms=S, makespan=makespan, work=work, lower_bound=work / S,
                     sm_idle_fraction=idle, waits=int((sem_w > eps).sum()), wait_time=float(sem_w.sum()),
                     step_cta=prog.p_cta[inv], step_start=st, step_compute_end=ce, step_reduce_start=rs,
                     step_end=en, task_cta=task_cta.copy(), task_start=t_start, task_end=t_end,
                     epilogue_start=ep_start, pipeline="writer", step_handoff=hs,
                     buffer_stalls=int((stall > eps).sum()), buffer_stall_time=float(stall.sum()))


# ------------------------------------------------------------------ serial pipeline (the paper's DAG)
def _simulate_static(schedule, c, r, e, latency):
    N, T = schedule.num_steps, schedule.num_tasks
    G = fused_graph(schedule, chain_prev_task(schedule))
    task_cta = schedule.task_cta.astype(np.int64)
    step_cta = task_cta[schedule.step_task]
    pre = np.concatenate([c, np.zeros(T)])
    post = np.concatenate([r, np.full(T, e)])
    ft = evaluate_fused(G, pre, post, np.concatenate([step_cta, task_cta]), latency)
    if ft.done != G.size:
        raise RuntimeError(f"{schedule.name}: wait-for graph has a cycle (schedule not validated?)")
    st, rs, fin = ft.start[:N], ft.ready_start[:N], ft.finish[:N]
    ce = st + c
    off = schedule.step_offsets
    has_steps = off[1:] > off[:-1]
    t_start = ft.start[N:].copy()  # a task without steps starts with its epilogue
    t_start[has_steps] = st[off[:-1][has_steps]]
    return step_cta, st, ce, rs, fin, task_cta, t_start, ft.ready_start[N:], ft.finish[N:]


def _simulate_dynamic(schedule, c, r, e, latency, S):
    N, T = schedule.num_steps, schedule.num_tasks
    pred = schedule.step_predecessor
    if np.any(pred >= np.arange(N)):
        raise RuntimeError(f"{schedule.name}: a contribution waits on a later-claimed one")

    offs = schedule.step_offsets.tolist()
    cl, rl, pl = c.tolist(), r.tolist(), pred.tolist()
    st = [0.0] * N
    rs = [0.0] * N
    en = [0.0] * N
    scta = [0] * N
    tcta = [0] * T
    tst = [0.0] * T
    eps_ = [0.0] * T
    ten = [0.0] * T
    lat = float(latency)
    heap = [(0.0, i) for i in range(S)]
    heapq.heapify(heap)
    for t in range(T):
        free, cta = heapq.heappop(heap)
        tcta[t] = cta
        tst[t] = free
        cur = free
        for k in range(offs[t], offs[t + 1]):
            st[k] = cur
            ce = cur + cl[k]
            p = pl[k]
            if p >= 0:
                rd = en[p]
                if lat and scta[p] != cta:
                    rd += lat
                if rd > ce:
                    ce_w = rd
                else:
                    ce_w = ce
            else:
                ce_w = ce
            rs[k] = ce_w
            cur = ce_w + rl[k]
            en[k] = cur
            scta[k] = cta
        eps_[t] = cur  # the epilogue follows the last reduce at once: it waits for no other task
        ten[t] = cur + e
        heapq.heappush(heap, (ten[t], cta))
    st_a = np.asarray(st)
    return (np.asarray(scta, dtype=np.int64), st_a, st_a + c, np.asarray(rs), np.asarray(en),
            np.asarray(tcta, dtype=np.int64), np.asarray(tst), np.asarray(eps_), np.asarray(ten))


# ------------------------------------------------------------------ writer pipeline, tasks claimed at run time
def simulate_claims(schedule, costs: CostModel | None = None, *, num_sms: int | None = None) -> SimResult:
    """The writer pipeline with a queue schedule's tasks claimed at run time, as
    the kernel runs them by default (``lowering.KERNEL_DISPATCH == "dynamic"``,
    csrc/kernels/bwd/bwd_tasks.h): each task, in queue order, goes to the CTA
    whose previous task ends first (its epilogue included), so a CTA held up by
    semaphore waits claims later. :func:`simulate` runs the launcher's static
    lowering instead (each task to the CTA free first under a cost of one per
    step, before any wait). The per-step rules are :class:`WriterProgram`'s:
    the MMA warps' hand-off waits for the sdQ buffer of ``buffers`` steps ago,
    the writer for its own previous add of that buffer and, deterministically,
    for the release of the contribution ranked just before (+ ``latency``).
    Static schedules are run by :func:`simulate` unchanged.
    """
    costs = costs or CostModel()
    S = int(num_sms or schedule.num_sms)
    if costs.pipeline != "writer":
        raise ValueError("simulate_claims models the writer pipeline")
    if not schedule.dynamic:
        return simulate(schedule, costs, num_sms=S)
    N, T = schedule.num_steps, schedule.num_tasks
    c, r = costs.step_costs(schedule)
    frac = costs.read_time / costs.reduce if costs.reduce > 0 else 1.0
    rd = r * frac if costs.read is not None else r
    e, lat, B = float(costs.epilogue), float(costs.latency), int(costs.buffers)
    det = costs.deterministic
    pred = schedule.step_predecessor if det else np.full(N, -1, dtype=np.int64)
    offs = schedule.step_offsets.tolist()
    cl, rl, rdl, pl = c.tolist(), r.tolist(), rd.tolist(), pred.tolist()
    st, hs, ce, rs, en = ([0.0] * N for _ in range(5))
    scta = [0] * N
    ncta = max(1, min(S, T))
    tcta, tst, eps_, ten = [0] * T, [0.0] * T, [0.0] * T, [0.0] * T
    heap = [(0.0, i) for i in range(ncta)]
    heapq.heapify(heap)
    last_end = [None] * ncta                      # end of the CTA's last step (its hand-off)
    recent = [[] for _ in range(ncta)]            # (read, writer done) of its last B steps
    semw = stall = 0.0
    waits = stalls = 0
    for t in range(T):
        free, cta = heapq.heappop(heap)
        tcta[t], tst[t] = cta, free
        first = True
        for k in range(offs[t], offs[t + 1]):
            # The previous task's epilogue runs on the MMA warps before this task's first step.
            s0 = free if last_end[cta] is None else last_end[cta] + (e if first else 0.0)
            first = False
            back = recent[cta][0] if len(recent[cta]) == B else (-np.inf, -np.inf)
            ready = s0 + cl[k]
            h = max(ready, back[0])
            if h > ready + 1e-12:
                stalls += 1
                stall += h - ready
            own = max(h, back[1])
            a = own
            if det and pl[k] >= 0:
                a = max(own, en[pl[k]] + lat)
                if a > own + 1e-12:
                    waits += 1
                    semw += a - own
            st[k], ce[k], hs[k], rs[k], en[k], scta[k] = s0, ready, h, a, a + rl[k], cta
            recent[cta].append((a + rdl[k], a + rl[k] if det else a + rdl[k]))
            if len(recent[cta]) > B:
                recent[cta].pop(0)
            last_end[cta] = h
        if offs[t + 1] > offs[t]:
            tst[t] = st[offs[t]]
            eps_[t] = last_end[cta]
        else:  # a task without steps: its epilogue alone
            eps_[t] = free if last_end[cta] is None else last_end[cta] + e
            if last_end[cta] is not None:
                last_end[cta] = eps_[t]  # the next task's first step follows this epilogue
        ten[t] = eps_[t] + e
        heapq.heappush(heap, (ten[t], cta))
    en_a = np.asarray(en)
    makespan = float(max(max(ten) if T else 0.0, en_a.max() if N else 0.0))
    work = float(c.sum() + e * T)
    idle = max(0.0, 1.0 - work / (S * makespan)) if makespan > 0 else 0.0
    return SimResult(schedule=schedule.name, num_sms=S, makespan=makespan, work=work, lower_bound=work / S,
                     sm_idle_fraction=idle, waits=waits, wait_time=semw, step_cta=np.asarray(scta, np.int64),
                     step_start=np.asarray(st), step_compute_end=np.asarray(ce), step_reduce_start=np.asarray(rs),
                     step_end=en_a, task_cta=np.asarray(tcta, np.int64), task_start=np.asarray(tst),
                     task_end=np.asarray(ten), epilogue_start=np.asarray(eps_), pipeline="writer",
                     step_handoff=np.asarray(hs), buffer_stalls=stalls, buffer_stall_time=stall)
