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

With the writer pipeline (``CostModel.pipeline == "writer"``, the kernel's;
see :mod:`.simulate`) the DAG has, per step p in CTA-program order, the nodes
C (compute up to the hand-off, ``handoff_at * c``), K (the rest of the
compute), H (hand-off, 0), D (step done, 0), R (the add until it has read
its buffer, ``read``) and X (the rest of the add, ``reduce - read``), and one
E (epilogue) per task.  Edges: D of step p-1 (or the previous task's E) ->
C; C -> H; R of step p-B -> H (B = buffers: the buffer is free); C -> K;
K -> D; H -> D; D -> R; the writer's previous step (X of p-B deterministic,
R of p-B not) -> R; X of the rank predecessor -> R (weight ``latency``,
deterministic only); R -> X; D of a task's last step -> E.  Built here
explicitly, it checks the simulator's recurrences.
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
    pipeline: str = "serial"

    def describe_node(self, v: int) -> str:
        """serial: C<k>, R<k>, E<t>; writer: C, H, R, X, K, D <p> (p = step in program order), E<t>."""
        N = self.num_steps
        kinds = "CR" if self.pipeline == "serial" else "CHRXKD"
        if v < len(kinds) * N:
            return f"{kinds[v // N]}{v % N}" if N else f"E{v}"
        return f"E{v - len(kinds) * N}"


def critical_path(schedule, costs=None, *, task_cta: np.ndarray | None = None) -> CriticalPath:
    """Critical path of the schedule's DAG (compute and reduce as separate nodes).

    Writer pipeline (the default ``CostModel``): the DAG of the module doc on
    the CTA programs the kernel runs (a dynamic schedule lowered as the
    launcher lowers it; ``task_cta`` is not used).  Serial pipeline:

    ``costs`` (a :class:`~.simulate.CostModel`) gives the node weights and the
    weight of cross-CTA semaphore edges (``costs.latency``; the paper's model
    is 0).  Dynamic schedules need a CTA assignment: ``task_cta`` or, by
    default, the one a zero-latency simulation's greedy dispatch produces.
    """
    costs = costs or CostModel()
    if costs.pipeline == "writer":
        return _critical_path_writer(schedule, costs)
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


def _critical_path_writer(schedule, costs) -> CriticalPath:
    from .simulate import kernel_program
    N, T = schedule.num_steps, schedule.num_tasks
    step_perm, task_perm, task_cta = kernel_program(schedule)
    c0, r0 = costs.step_costs(schedule)
    c, r = c0[step_perm], r0[step_perm]
    rd = r * (costs.read_time / costs.reduce if costs.reduce > 0 else 1.0) if costs.read is not None else r
    lens = schedule.task_steps[task_perm]
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    p_task = np.repeat(np.arange(T, dtype=np.int64), lens)
    p_cta = task_cta[task_perm][p_task]
    C, H, R, X, K, D, E = 0, N, 2 * N, 3 * N, 4 * N, 5 * N, 6 * N
    phi = float(costs.handoff_at)
    node_w = np.concatenate([c * phi, np.zeros(N), rd, r - rd, c * (1 - phi), np.zeros(N),
                             np.full(T, float(costs.epilogue))])
    src, dst, w = [], [], []

    def edge(a, b, weight=0.0):
        a = np.asarray(a, dtype=np.int64)
        src.append(a); dst.append(np.asarray(b, dtype=np.int64)); w.append(np.broadcast_to(weight, a.shape))

    p = np.arange(N, dtype=np.int64)
    first = np.zeros(N, dtype=bool)
    first[offs[:-1][lens > 0]] = True
    same1 = np.zeros(N, dtype=bool)
    same1[1:] = p_cta[1:] == p_cta[:-1]
    inner = same1 & ~first
    edge(D + p[inner] - 1, C + p[inner])                          # MMA program order
    # A task follows the previous task of its CTA: its first step (or, without
    # steps, its epilogue) waits for that task's epilogue.
    t_cta = task_cta[task_perm]
    tt = np.arange(T, dtype=np.int64)
    chained = np.zeros(T, dtype=bool)
    chained[1:] = t_cta[1:] == t_cta[:-1]
    with_steps = chained & (lens > 0)
    edge(E + tt[with_steps] - 1, C + offs[:-1][with_steps])       # previous task's epilogue
    without = chained & (lens == 0)
    edge(E + tt[without] - 1, E + tt[without])
    edge(C + p, H + p)
    edge(C + p, K + p)
    edge(K + p, D + p)
    edge(H + p, D + p)
    B = int(costs.buffers)
    pb = p - B
    okb = pb >= 0
    okb[okb] = p_cta[pb[okb]] == p_cta[okb]
    edge(R + pb[okb], H + p[okb])                                 # buffer free
    edge(D + p, R + p)
    edge((X if costs.deterministic else R) + pb[okb], R + p[okb])  # the writer's previous step
    if costs.deterministic and N:
        inv = np.empty(N, dtype=np.int64)
        inv[step_perm] = p
        sp = schedule.step_predecessor
        has = np.flatnonzero(sp >= 0)
        edge(X + inv[sp[has]], R + inv[has], float(costs.latency))
    edge(R + p, X + p)
    last = offs[1:][lens > 0] - 1
    edge(D + last, E + np.arange(T)[lens > 0])
    length, _, path = longest_path(6 * N + T, node_w, np.concatenate(src), np.concatenate(dst),
                                   np.concatenate(w))
    return CriticalPath(length, path, N, T, pipeline="writer")
