"""Event simulator: S SMs running a schedule.

Cost model (per step of a task):

* compute ``c``: the partial dQ (and the dK/dV update) of one (kv, q) tile;
* reduce ``r``: adding it into the fp32 dQ tile.  It may start only after the
  step's compute is done AND the previous-ranked contribution to the same dQ
  tile has finished its reduce (+ ``latency`` when that ran on another SM: the
  semaphore signal crosses L2, 200 to 500+ cycles per the paper);
* the SM is busy during compute and reduce and idle while it waits;
* a task ends with an epilogue of cost ``epilogue`` (default 0): its dK/dV
  store (with GQA, into its own q head's fp32 partials), which waits for no
  other task.  The postprocess that sums a GQA group's partials is a separate
  kernel after this one and is not modelled.

``scale="constant"`` (default): c and r per step are constants, matching the
kernel, which runs full tiles (TMA pads ragged tiles, masked tiles are
computed then masked).  ``scale="elements"``: c scales with the fraction of the
tile's elements that are inside both sequences and the mask, r with the
fraction of valid Q rows; useful to study ragged shapes.

Static schedules are evaluated on the DAG (:func:`..waitgraph.evaluate_fused`);
dynamic ones (``fa3``, ``spt``, ``descending``) are dispatched the way the
hardware dispatches a grid: the next task in queue order goes to the first SM
that becomes free (ties: lowest SM id).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from ..waitgraph import chain_prev_task, evaluate_fused, fused_graph


@dataclass(frozen=True)
class CostModel:
    compute: float = 1.0
    reduce: float = 1.0
    latency: float = 0.0
    epilogue: float = 0.0
    scale: str = "constant"   # or "elements"

    def __post_init__(self):
        if self.scale not in ("constant", "elements"):
            raise ValueError(f"CostModel.scale must be 'constant' or 'elements', got {self.scale!r}")
        for f in ("compute", "reduce", "latency", "epilogue"):
            if getattr(self, f) < 0:
                raise ValueError(f"CostModel.{f} must be >= 0")

    def replace(self, **kw) -> "CostModel":
        return replace(self, **kw)

    def step_costs(self, schedule) -> tuple[np.ndarray, np.ndarray]:
        """(c, r) float arrays, one entry per step of ``schedule``."""
        N = schedule.num_steps
        if self.scale == "constant":
            return np.full(N, float(self.compute)), np.full(N, float(self.reduce))
        g = schedule.geometry
        kv = schedule.task_kv[schedule.step_task]
        q = schedule.step_q
        c = self.compute * g.valid_elements(kv, q) / float(g.block_m * g.block_n)
        r = self.reduce * g.valid_rows(q) / float(g.block_m)
        return c.astype(float), r.astype(float)


@dataclass
class SimResult:
    schedule: str
    num_sms: int
    makespan: float
    work: float
    lower_bound: float          # work / num_sms
    sm_idle_fraction: float     # 1 - work / (num_sms * makespan)
    waits: int                  # reduces that had to wait: collisions
    wait_time: float
    # timeline, one entry per step (schedule step order)
    step_cta: np.ndarray
    step_start: np.ndarray      # compute start
    step_compute_end: np.ndarray
    step_reduce_start: np.ndarray
    step_end: np.ndarray
    # one entry per task
    task_cta: np.ndarray
    task_start: np.ndarray
    task_end: np.ndarray        # epilogue end
    epilogue_start: np.ndarray

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else float("nan")

    def summary(self) -> dict:
        return {"schedule": self.schedule, "num_sms": self.num_sms, "makespan": self.makespan,
                "lower_bound": self.lower_bound, "ratio": self.ratio,
                "sm_idle_fraction": self.sm_idle_fraction, "waits": self.waits,
                "wait_time": self.wait_time}


def simulate(schedule, costs: CostModel | None = None, *, num_sms: int | None = None) -> SimResult:
    """Run ``schedule`` on ``num_sms`` SMs (default: the schedule's) under ``costs``.

    Static schedules need ``num_sms >= schedule.num_ctas`` (all CTAs resident).
    """
    costs = costs or CostModel()
    S = int(num_sms or schedule.num_sms)
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
                     epilogue_start=ep_start)


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
    gid, rank = schedule.step_dq_tile, schedule.step_rank
    order = np.lexsort((rank, gid))
    same = gid[order][1:] == gid[order][:-1]
    pred = np.full(N, -1, dtype=np.int64)
    pred[order[1:][same]] = order[:-1][same]
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
