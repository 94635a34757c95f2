"""The paper's closed forms (n KV tiles = n SMs, m heads) and the DAG/simulator agreement.

The closed forms are properties of the paper's serial DAG (compute -> reduce on
the SM), so those tests run ``pipeline="serial"``; the default pipeline is the
kernel's (a dQ writer per sdQ buffer overlapping the adds with the MMA work),
tested in tests/test_schedule_writer.py."""

import math

import numpy as np
import pytest

from dash_fa3.schedule import (SCHEDULES, CostModel, Geometry, critical_path, get_schedule,
                               paper_makespan, simulate)

MS = range(1, 9)
NS = range(2, 17)
COSTS = [(1.0, 0.5), (1.0, 1.0), (2.0, 0.3), (1.0, 2.0)]


def run(mask, name, n, m, c, r, **kw):
    s = get_schedule(name, Geometry.model(n, m, mask), n)
    return s, simulate(s, CostModel(c, r, pipeline="serial", **kw))


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


@pytest.mark.parametrize("c,r", COSTS)
def test_full_fa3_exact(c, r):
    for n in NS:
        for m in MS:
            _, sim = run("full", "fa3", n, m, c, r)
            assert close(sim.makespan, m * n * (c + r) + (n - 1) * r), (n, m)
            assert close(sim.makespan, paper_makespan("full", "fa3", n, m, c, r))


@pytest.mark.parametrize("c,r", COSTS)
@pytest.mark.parametrize("name", ["shift", "symmetric_shift"])
def test_full_shift_exact_and_optimal(name, c, r):
    for n in NS:
        for m in MS:
            s, sim = run("full", name, n, m, c, r)
            assert close(sim.makespan, m * n * (c + r)), (n, m)
            assert close(sim.makespan, sim.lower_bound) and sim.waits == 0
            assert sim.sm_idle_fraction < 1e-12


@pytest.mark.parametrize("c,r", COSTS)
def test_causal_fa3(c, r):
    """Paper: about m*(n(c+r) + (n-1)r) (one bubble per head).  Our greedy dispatch
    lets the next head start on the SM that finished the longest task, so only
    the first head's (n-1)r staircase shows: exactly m*n*(c+r) + (n-1)*r."""
    for n in NS:
        for m in MS:
            _, sim = run("causal", "fa3", n, m, c, r)
            paper = paper_makespan("causal", "fa3", n, m, c, r)
            exact = m * n * (c + r) + (n - 1) * r
            assert close(sim.makespan, exact), (n, m)
            assert sim.makespan <= paper + 1e-9
            assert close(paper - sim.makespan, (m - 1) * (n - 1) * r)


@pytest.mark.parametrize("c,r", COSTS)
def test_causal_descending(c, r):
    """Paper (m even): about m(n+1)(c+r)/2 + (n-1)r.  Exact in our model when
    r <= c; when r > c the short tasks' staircase adds (m/2-1)(n-1)(r-c) at most."""
    for n in NS:
        for m in MS:
            _, sim = run("causal", "descending", n, m, c, r)
            lb = m * n * (n + 1) / 2 * (c + r) / n
            assert close(sim.lower_bound, lb)
            if m % 2 == 0:
                paper = paper_makespan("causal", "descending", n, m, c, r)
                if r <= c:
                    assert close(sim.makespan, paper), (n, m)
                else:
                    assert paper - 1e-9 <= sim.makespan <= paper + (m / 2 - 1) * (n - 1) * (r - c) + 1e-9, (n, m)
            else:
                # odd m: the last head runs alone; bounded by the form for m + 1
                assert lb - 1e-9 <= sim.makespan
                assert sim.makespan <= paper_makespan("causal", "descending", n, m + 1, c, r) \
                    + (m + 1) / 2 * (n - 1) * max(0.0, r - c) + 1e-9, (n, m)


@pytest.mark.parametrize("c,r", COSTS)
def test_causal_symmetric_shift(c, r):
    """Paper (m even): m(n+1)(c+r)/2, exact and bubble-free for even n.  Odd n
    leaves the middle KV tile unpaired (half-length unit): valid, bounded by
    whole waves of (n+1) steps; units of unequal length desynchronise the waves,
    so a few semaphore waits can appear across waves."""
    for n in NS:
        for m in MS:
            s, sim = run("causal", "symmetric_shift", n, m, c, r)
            if n % 2 == 0 or m * (n + 1) // 2 <= n:
                assert sim.waits == 0, (n, m)   # collision-free (odd n: within one wave)
            paper = paper_makespan("causal", "symmetric_shift", n, m, c, r)
            if n % 2 == 0 and m % 2 == 0:
                assert close(sim.makespan, paper), (n, m)
                assert close(sim.makespan, sim.lower_bound) and sim.sm_idle_fraction < 1e-12
            elif n % 2 == 0:
                assert close(sim.makespan, math.ceil(m / 2) * (n + 1) * (c + r)), (n, m)
            else:
                units = m * (n + 1) // 2
                waves = math.ceil(units / n)
                assert paper - 1e-9 <= sim.makespan <= waves * (n + 1) * (c + r) + 1e-9, (n, m)


def test_shift_survives_latency_up_to_compute():
    # collision-free: a semaphore latency <= c hides behind the next compute
    for n, m in [(4, 2), (8, 3), (16, 4)]:
        _, sim = run("full", "shift", n, m, 1.0, 0.5, latency=1.0)
        assert close(sim.makespan, m * n * 1.5)
        _, sim = run("causal", "symmetric_shift", 2 * (n // 2), 2 * m, 1.0, 0.5, latency=1.0)
        assert close(sim.makespan, m * (n + 1) * 1.5)
        _, fa3 = run("full", "fa3", n, m, 1.0, 0.5, latency=1.0)
        assert fa3.makespan > m * n * 1.5 + (n - 1) * 0.5


@pytest.mark.parametrize("pipeline", ["serial", "writer"])
@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_critical_path_equals_simulation(name, mask, pipeline):
    """Two independent evaluations of one DAG: the simulator and a generic longest path."""
    rng = np.random.default_rng(3)
    for n, m, S in [(4, 2, 4), (7, 3, 5), (8, 4, 8), (5, 5, 3)]:
        g = Geometry.model(n, m, mask)
        s = get_schedule(name, g, S)
        for lat in (0.0, 0.7):
            costs = CostModel(float(rng.uniform(0.5, 2)), float(rng.uniform(0.1, 2)), latency=lat,
                              epilogue=0.25, pipeline=pipeline)
            if pipeline == "writer":
                costs = costs.replace(read=costs.reduce * float(rng.uniform(0.2, 1)),
                                      masked_compute=costs.compute * 1.2)
            sim = simulate(s, costs)
            cp = critical_path(s, costs, task_cta=sim.task_cta if s.dynamic else None)
            assert close(cp.length, sim.makespan), (n, m, S, lat)
            assert sim.makespan >= sim.lower_bound - 1e-9
            assert cp.path.size > 0


def test_model_idle_fraction_and_timeline():
    s, sim = run("causal", "fa3", 8, 2, 1.0, 0.5)
    busy = (sim.step_compute_end - sim.step_start).sum() + (sim.step_end - sim.step_reduce_start).sum()
    assert close(1 - busy / (8 * sim.makespan), sim.sm_idle_fraction)
    # each SM runs one thing at a time
    for cta in range(8):
        idx = np.flatnonzero(sim.step_cta == cta)
        o = idx[np.argsort(sim.step_start[idx])]
        assert np.all(sim.step_start[o][1:] >= sim.step_end[o][:-1] - 1e-9)
    # a reduce never starts before its compute, nor before its rank predecessor's reduce ends
    assert np.all(sim.step_reduce_start >= sim.step_compute_end - 1e-12)
    gid, rank = s.step_dq_tile, s.step_rank
    o = np.lexsort((rank, gid))
    same = gid[o][1:] == gid[o][:-1]
    assert np.all(sim.step_reduce_start[o][1:][same] >= sim.step_end[o][:-1][same] - 1e-9)


@pytest.mark.parametrize("pipeline", ["serial", "writer"])
def test_elements_cost_scaling(pipeline):
    g = Geometry(1, 2, 2, 1000, 1000, 128, 128, "causal")
    s = get_schedule("symmetric_shift", g, 8)
    c, r = CostModel(1.0, 1.0, scale="elements").step_costs(s)
    assert np.all(c <= 1) and np.all(c > 0) and np.all(r <= 1)
    assert c.min() < 0.6          # diagonal / ragged tiles are cheaper
    sim = simulate(s, CostModel(1.0, 1.0, scale="elements", pipeline=pipeline))
    assert sim.makespan < simulate(s, CostModel(1.0, 1.0, pipeline=pipeline)).makespan
