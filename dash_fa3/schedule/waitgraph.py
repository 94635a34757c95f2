"""The wait-for graph of a schedule: one node per step and per task epilogue,
with each node's program-order predecessor (the step before it on its CTA) and
semaphore predecessor (the contribution ranked just before it in its dQ tile).
A task without steps is its epilogue alone, after the task before it.
An epilogue has no semaphore predecessor: it stores dK/dV (with GQA, into its
own q head's fp32 partials, summed by the postprocess), waiting for no other
task.

Validation runs Kahn's algorithm on it (a schedule whose graph has a cycle can
deadlock on the GPU and is refused); the model's static simulator
(:mod:`.model.simulate`) evaluates the same graph with costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def chain_prev_task(schedule) -> np.ndarray:
    """prev_task[t]: the task that runs just before t on t's CTA (-1: first).

    Static schedules: from the CTA rows.  Dynamic schedules: the global claim
    order (every task follows the previously claimed one), which is the
    conservative deadlock model: correct for any number of resident CTAs.
    """
    T = schedule.num_tasks
    prev = np.arange(T, dtype=np.int64) - 1
    if not schedule.dynamic:
        first = schedule.meta.offsets[:-1].astype(np.int64)
        prev[first[first < T]] = -1
    return prev


@dataclass
class FusedGraph:
    """One node per step (0..N-1) and per task epilogue (N..N+T-1).
    ``prog``/``sync`` hold the program-order and semaphore predecessor of each
    node, ``NONE`` (= number of nodes) when there is none (always for
    epilogues)."""

    num_steps: int
    num_tasks: int
    prog: np.ndarray
    sync: np.ndarray

    @property
    def size(self) -> int:
        return self.num_steps + self.num_tasks

    @property
    def NONE(self) -> int:
        return self.size


def fused_graph(schedule, prev_task: np.ndarray) -> FusedGraph:
    N, T = schedule.num_steps, schedule.num_tasks
    n = N + T
    NONE = n
    off = schedule.step_offsets
    prog = np.empty(n, dtype=np.int64)
    prog[:N] = np.arange(N, dtype=np.int64) - 1
    after_prev = np.where(prev_task >= 0, N + prev_task, NONE)
    # A task without steps (a KV tile a window hides from every query) is its epilogue alone.
    has_steps = off[1:] > off[:-1]
    prog[off[:-1][has_steps]] = after_prev[has_steps]
    prog[N:] = np.where(has_steps, off[1:] - 1, after_prev)
    sync = np.full(n, NONE, dtype=np.int64)
    sp = schedule.step_predecessor
    has = np.flatnonzero(sp >= 0)
    sync[has] = sp[has]
    return FusedGraph(N, T, prog, sync)


@dataclass
class FusedTimes:
    done: int               # nodes processed (== graph size iff acyclic)
    start: np.ndarray       # program-order start (compute start / epilogue start)
    ready_start: np.ndarray # start of the post-wait part (reduce / epilogue)
    finish: np.ndarray
    rounds: int


def evaluate_fused(G: FusedGraph, pre: np.ndarray, post: np.ndarray, node_cta: np.ndarray,
                   latency: float = 0.0) -> FusedTimes:
    """Kahn's algorithm, a frontier at a time, computing node times on the way.

    A node starts when its program predecessor finishes; its first part takes
    ``pre`` (compute); its second part (``post``: reduce / epilogue) starts
    once the first is done and the semaphore predecessor has finished (plus
    ``latency`` if that ran on another CTA).  Unprocessed nodes at the end lie
    on or behind a cycle.
    """
    n = G.size
    NONE = n
    fin = np.zeros(n + 2)
    fin[n + 1] = -np.inf
    prog = G.prog
    sync = np.where(G.sync == NONE, n + 1, G.sync)
    cta = np.concatenate([np.asarray(node_cta, dtype=np.int64), [-1, -1]])
    has_p = G.prog < NONE
    has_s = G.sync < NONE
    indeg = has_p.astype(np.int32) + has_s.astype(np.int32)
    psucc = np.full(n, NONE, dtype=np.int64)
    psucc[G.prog[has_p]] = np.flatnonzero(has_p)
    ssucc = np.full(n, NONE, dtype=np.int64)
    ssucc[G.sync[has_s]] = np.flatnonzero(has_s)
    start = np.full(n, np.nan)
    rstart = np.full(n, np.nan)
    front = np.flatnonzero(indeg == 0)
    done = 0
    rounds = 0
    lat = float(latency)
    while front.size:
        rounds += 1
        st = fin[prog[front]]
        ce = st + pre[front]
        sp = sync[front]
        rd = fin[sp]
        if lat:
            rd = rd + np.where(cta[sp] != cta[front], lat, 0.0)
        rs = np.maximum(ce, rd)
        fin[front] = rs + post[front]
        start[front] = st
        rstart[front] = rs
        done += front.size
        ps = psucc[front]
        ps = ps[ps < NONE]
        ss = ssucc[front]
        ss = ss[ss < NONE]
        indeg[ps] -= 1
        indeg[ss] -= 1
        cand = np.concatenate([ps, ss])
        front = np.unique(cand[indeg[cand] == 0])
    return FusedTimes(done, start, rstart, fin[:n], rounds)
