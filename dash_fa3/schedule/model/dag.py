"""The DAG model of a schedule and its critical path.

Nodes (the paper's model, DASH Sec. 3): every step of every task is a chain
``compute -> reduce``; a task's steps run back to back on one SM; a task ends
with an epilogue (its dK/dV store; with GQA into its q head's own fp32
partials, so no epilogue waits for another).  Edges:

* program order: reduce of step s -> compute of step s+1; last reduce ->
  epilogue; epilogue -> first compute of the next task on the same CTA;
* accumulation order: reduce of the rank k-1 contribution to a dQ tile ->
  reduce of the rank k contribution (weight = semaphore latency when the two
  run on different CTAs, 0 in the paper's model).

The makespan of a static schedule is the longest path.  For a dynamically
dispatched schedule the program order is the CTA assignment that the greedy
dispatch produced (taken from a simulation).

The fused wait-for graph (one node per step) and its evaluation are the
contract's (:mod:`..waitgraph`, shared by validation and the static
simulator); here is :func:`longest_path`, a generic node-and-edge-weighted
longest path that :func:`critical_path` uses as an independent check of the
simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..waitgraph import chain_prev_task, fused_graph
from .simulate import CostModel, simulate


def prev_task_from_assignment(task_cta: np.ndarray) -> np.ndarray:
    """prev_task for tasks run in index order on the CTAs given by ``task_cta``."""
    T = task_cta.size
    order = np.lexsort((np.arange(T), task_cta))
    prev = np.full(T, -1, dtype=np.int64)
    same = task_cta[order][1:] == task_cta[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return prev


# ------------------------------------------------------------- generic longest path
def longest_path(num_nodes: int, node_w: np.ndarray, src: np.ndarray, dst: np.ndarray,
                 edge_w: np.ndarray):
    """Longest path of a DAG with node and edge weights.

    finish[v] = max(0, max over edges (u, v) of finish[u] + w(u, v)) + node_w[v].
    Returns (length, finish, path) where path lists the nodes of one critical
    path; raises ValueError on a cycle.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    edge_w = np.asarray(edge_w, dtype=float)
    order = np.argsort(src, kind="stable")
    s_src, s_dst, s_w = src[order], dst[order], edge_w[order]
    indptr = np.searchsorted(s_src, np.arange(num_nodes + 1))
    indeg = np.bincount(dst, minlength=num_nodes).astype(np.int64)
    begin = np.zeros(num_nodes)
    finish = np.zeros(num_nodes)
    front = np.flatnonzero(indeg == 0)
    done = 0
    while front.size:
        finish[front] = begin[front] + node_w[front]
        done += front.size
        lo, hi = indptr[front], indptr[front + 1]
        cnt = hi - lo
        tot = int(cnt.sum())
        if tot == 0:
            break
        e = np.repeat(lo - np.cumsum(cnt) + cnt, cnt) + np.arange(tot)
        d = s_dst[e]
        np.maximum.at(begin, d, finish[s_src[e]] + s_w[e])
        np.subtract.at(indeg, d, 1)
        front = np.unique(d[indeg[d] == 0])
    if done != num_nodes:
        raise ValueError(f"graph has a cycle ({num_nodes - done} nodes unreachable by Kahn)")
    # one critical path, walking back along tight edges
    in_order = np.argsort(dst, kind="stable")
    i_src, i_dst, i_w = src[in_order], dst[in_order], edge_w[in_order]
    in_ptr = np.searchsorted(i_dst, np.arange(num_nodes + 1))
    v = int(np.argmax(finish)) if num_nodes else 0
    path = [v]
    while begin[v] > 0:
        a, b = in_ptr[v], in_ptr[v + 1]
        cand = np.flatnonzero(np.isclose(finish[i_src[a:b]] + i_w[a:b], begin[v], rtol=1e-12, atol=1e-9))
        if cand.size == 0:
            break
        v = int(i_src[a + cand[0]])
        path.append(v)
    path.reverse()
    length = float(finish.max()) if num_nodes else 0.0
    return length, finish, np.asarray(path, dtype=np.int64)


@dataclass
class CriticalPath:
    length: float
    path: np.ndarray          # split-node ids of one critical path (see describe_node)
    num_steps: int
    num_tasks: int

    def describe_node(self, v: int) -> str:
        N = self.num_steps
        if v < N:
            return f"C{v}"
        if v < 2 * N:
            return f"R{v - N}"
        return f"E{v - 2 * N}"


def critical_path(schedule, costs=None, *, task_cta: np.ndarray | None = None) -> CriticalPath:
    """Critical path of the schedule's DAG (compute and reduce as separate nodes).

    ``costs`` (a :class:`~.simulate.CostModel`) gives the node weights and the
    weight of cross-CTA semaphore edges (``costs.latency``; the paper's model
    is 0).  Dynamic schedules need a CTA assignment: ``task_cta`` or, by
    default, the one a zero-latency simulation's greedy dispatch produces.
    """
    costs = costs or CostModel()
    if schedule.dynamic:
        if task_cta is None:
            task_cta = simulate(schedule, costs.replace(latency=0.0)).task_cta
        prev = prev_task_from_assignment(np.asarray(task_cta))
        tc = np.asarray(task_cta, dtype=np.int64)
    else:
        prev = chain_prev_task(schedule)
        tc = schedule.task_cta
    c, r = costs.step_costs(schedule)
    e = np.full(schedule.num_tasks, float(costs.epilogue))
    N, T = schedule.num_steps, schedule.num_tasks
    G = fused_graph(schedule, prev)
    NONE = G.NONE
    node_w = np.concatenate([c, r, e])
    step_cta = tc[schedule.step_task]
    node_cta = np.concatenate([step_cta, step_cta, tc])
    # split ids: C_k = k, R_k = N + k, E_t = 2N + t.  A fused node f (step k = f, or
    # epilogue t = f - N) finishes when split node N + f does (R_k, resp. E_t).
    def fin_id(f):
        return N + f
    src, dst, w = [], [], []
    k = np.arange(N, dtype=np.int64)
    src.append(k); dst.append(N + k); w.append(np.zeros(N))             # C -> R
    has = G.prog[:N] < NONE                                               # prev -> C
    src.append(fin_id(G.prog[:N][has])); dst.append(k[has]); w.append(np.zeros(int(has.sum())))
    t = np.arange(T, dtype=np.int64)
    has = G.prog[N:] < NONE                                # last R (or the previous E) -> E
    src.append(fin_id(G.prog[N:][has])); dst.append(2 * N + t[has]); w.append(np.zeros(int(has.sum())))
    lat = float(costs.latency)
    for lo, hi in ((0, N), (N, N + T)):
        idx = np.arange(lo, hi, dtype=np.int64)
        sp = G.sync[lo:hi]
        has = sp < NONE
        a, b = fin_id(sp[has]), fin_id(idx[has])
        src.append(a); dst.append(b)
        w.append(np.where(node_cta[a] != node_cta[b], lat, 0.0))
    length, _, path = longest_path(2 * N + T, node_w, np.concatenate(src), np.concatenate(dst),
                                   np.concatenate(w))
    return CriticalPath(length, path, N, T)
