"""Every schedule validates on the bench grid and on many random (awkward) shapes."""


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dash_fa3.schedule import (SCHEDULES, CostModel, Geometry, build_schedule, critical_path, schedules_for,
                               simulate)
from dash_fa3.schedule.export import DEFAULT_GRID, grid_geometries

SMS = (132, 114)   # H100/H200 SXM, H100 PCIe


GRID = list(grid_geometries(DEFAULT_GRID))


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("label,g", GRID, ids=[lbl for lbl, _ in GRID])
def test_bench_grid_validates(label, g, sms):
    for name in SCHEDULES:
        s = build_schedule(name, g, sms)        # raises ScheduleError if any check fails
        assert s.num_ctas <= sms
        assert s.num_steps == g.num_steps


def test_bench_grid_shapes():
    assert len(GRID) == 24
    labels = [lbl for lbl, _ in GRID]
    g = dict(GRID)["hdim64 s16384 full"]
    assert (g.batch, g.heads, g.n_kv, g.n_q, g.num_steps) == (1, 32, 128, 128, 524288)
    g = dict(GRID)["hdim128 s512 causal"]
    assert (g.batch, g.heads, g.block_m, g.block_n) == (32, 16, 64, 128)
    assert "hdim128 s16384 causal" in labels


def random_geometry(rng, max_steps=6000):
    while True:
        bm = int(rng.choice([16, 32, 64, 128]))
        bn = int(rng.choice([16, 32, 64, 128]))
        sq = int(rng.integers(1, 1200))
        sk = int(rng.integers(1, 1200)) if rng.random() < 0.6 else sq
        hkv = int(rng.integers(1, 9))
        grp = int(rng.choice([1, 1, 2, 4]))
        b = int(rng.integers(1, 5))
        mask = "causal" if rng.random() < 0.6 else "full"
        g = Geometry(b, hkv * grp, hkv, sq, sk, bm, bn, mask)
        if 0 < g.num_steps <= max_steps:
            return g


CHUNKS = 10
PER_CHUNK = 100


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_thousand_random_shapes(chunk):
    """1000 random shapes (fixed seed), each with 132 or 114 SMs and a small SM count."""
    rng = np.random.default_rng(1000 + chunk)
    for _ in range(PER_CHUNK):
        g = random_geometry(rng)
        sms = int(rng.choice(SMS)) if rng.random() < 0.5 else int(rng.integers(1, 40))
        for name in SCHEDULES:
            s = build_schedule(name, g, sms)
            assert s.num_ctas <= sms


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 3), hkv=st.integers(1, 4), grp=st.sampled_from([1, 2, 3]),
       sq=st.integers(1, 700), sk=st.integers(1, 700),
       bm=st.sampled_from([16, 32, 64, 128]), bn=st.sampled_from([16, 32, 64, 128]),
       causal=st.booleans(), sms=st.one_of(st.integers(1, 24), st.sampled_from(SMS)))
def test_property_every_schedule_valid_and_simulates(b, hkv, grp, sq, sk, bm, bn, causal, sms):
    g = Geometry(b, hkv * grp, hkv, sq, sk, bm, bn, "causal" if causal else "full")
    if g.num_steps > 8000:
        return
    for name in schedules_for(g):
        s = build_schedule(name, g, sms)
        sim = simulate(s, CostModel(1.0, 0.5, latency=0.3, epilogue=0.2, pipeline="serial"))
        assert sim.makespan >= sim.lower_bound - 1e-9
        assert sim.makespan >= max(s.task_steps) * 1.5 - 1e-9
        assert 0.0 <= sim.sm_idle_fraction < 1.0
        # the kernel's pipeline overlaps the adds with the next computes: a task
        # takes its computes plus the last add at least, and never longer than serially
        w = simulate(s, CostModel(1.0, 0.5, latency=0.0, epilogue=0.2))
        assert w.makespan >= w.lower_bound - 1e-9
        assert w.makespan >= max(s.task_steps) * 1.0 + 0.5 - 1e-9
        assert 0.0 <= w.sm_idle_fraction < 1.0
        serial0 = simulate(s, CostModel(1.0, 0.5, latency=0.0, epilogue=0.2, pipeline="serial"))
        if not s.dynamic:  # a dynamic one runs its lowering (fixed CTA lists), not greedy dispatch
            assert w.makespan <= serial0.makespan + 1e-9


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 4), sq=st.integers(1, 500), sk=st.integers(1, 500),
       bm=st.sampled_from([32, 64]), bn=st.sampled_from([32, 64, 128]), causal=st.booleans(),
       sms=st.integers(1, 12), lat=st.sampled_from([0.0, 0.4]))
def test_property_dag_matches_simulator(b, h, sq, sk, bm, bn, causal, sms, lat):
    g = Geometry(b, h, h, sq, sk, bm, bn, "causal" if causal else "full")
    if g.num_steps > 3000:
        return
    for name in SCHEDULES:
        s = build_schedule(name, g, sms)
        for pipeline in ("serial", "writer"):
            costs = CostModel(1.0, 0.7, latency=lat, read=0.3, masked_compute=1.25, pipeline=pipeline)
            sim = simulate(s, costs)
            cp = critical_path(s, costs, task_cta=sim.task_cta if s.dynamic else None)
            assert abs(cp.length - sim.makespan) <= 1e-9 * max(1.0, sim.makespan)
