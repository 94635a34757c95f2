"""Schedules on sliding-window (local) geometries: every schedule validates
(coverage, rank permutations, metadata decode, deadlock freedom), simulates,
and covers the KV tiles a window hides from every query with tasks without
steps (they store dK = dV = 0)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dash_fa3.schedule import (SCHEDULES, CostModel, Geometry, build_schedule, critical_path, schedules_for,
                               resolve_schedule_name, simulate)
from dash_fa3.schedule.lowering import get_kernel_metadata, lower_to_static

SMS = (132, 114)


def window_side(rng, seqlen):
    return int(rng.choice([-1, 0, int(rng.integers(0, 200)), int(rng.integers(0, 2 * seqlen + 2))]))


def random_window_geometry(rng, max_steps=6000):
    while True:
        bm = int(rng.choice([16, 32, 64, 128]))
        bn = int(rng.choice([16, 32, 64, 128]))
        sq = int(rng.integers(1, 1500))
        sk = int(rng.integers(1, 1500)) if rng.random() < 0.6 else sq
        hkv = int(rng.integers(1, 5))
        grp = int(rng.choice([1, 1, 2, 4]))
        left, right = window_side(rng, max(sq, sk)), window_side(rng, max(sq, sk))
        g = Geometry(int(rng.integers(1, 4)), hkv * grp, hkv, sq, sk, bm, bn, "local", left, right)
        if 0 < g.num_steps <= max_steps:
            return g


@pytest.mark.parametrize("chunk", range(6))
def test_random_window_shapes_validate(chunk):
    """600 random window geometries (fixed seed), each with 132 or 114 SMs or a small count."""
    rng = np.random.default_rng(2000 + chunk)
    for _ in range(100):
        g = random_window_geometry(rng)
        sms = int(rng.choice(SMS)) if rng.random() < 0.5 else int(rng.integers(1, 40))
        for name in schedules_for(g):
            s = build_schedule(name, g, sms)  # raises ScheduleError on any failed check
            assert s.num_tasks == s.geometry.num_tasks and s.num_steps == g.num_steps
            lowered = lower_to_static(s)  # what the kernel runs, validated again
            assert lowered.num_steps == g.num_steps


EDGES = [
    # (sq, sk, bm, bn, left, right)
    (1000, 1000, 64, 128, 0, 0),        # only the diagonal
    (1000, 1000, 128, 128, 0, 0),
    (1000, 1000, 64, 128, 256, -1),     # left only
    (1000, 1000, 64, 128, -1, 256),     # right only
    (1000, 1000, 64, 128, 256, 0),      # causal + left
    (1000, 1000, 64, 128, 100, 300),    # both
    (300, 1000, 64, 128, 100, 0),       # seqlen_q < seqlen_k: the first KV tiles are seen by no query
    (1000, 300, 64, 128, 30, 5),        # seqlen_q > seqlen_k: the first Q tiles see no key
    (500, 700, 64, 128, 5000, 5000),    # wider than the sequence: full
    (500, 700, 64, 128, 5000, 0),       # causal
    (1, 1, 64, 128, 0, 0),
    (4096, 4096, 64, 128, 1024, 0),
]


@pytest.mark.parametrize("sms", (132, 7, 1))
@pytest.mark.parametrize("shape", EDGES, ids=[str(e) for e in EDGES])
@pytest.mark.parametrize("heads", ((2, 2), (4, 2)))
def test_window_edge_cases_validate(shape, heads, sms):
    sq, sk, bm, bn, left, right = shape
    g = Geometry(2, heads[0], heads[1], sq, sk, bm, bn, "local", left, right)
    for name in schedules_for(g):
        s = build_schedule(name, g, sms)
        inactive = np.flatnonzero(g.task_len == 0)
        for kv in inactive:  # a tile no query sees: a task without steps (grouped_*: of the grouped view)
            assert s.task_steps[s.find_task(1, s.geometry.heads - 1, int(kv))] == 0
        sim = simulate(s, CostModel(1.0, 0.5, latency=0.3, epilogue=0.2, pipeline="serial"))
        assert sim.makespan >= sim.lower_bound - 1e-9
        w = simulate(s, CostModel(1.0, 0.5, latency=0.0, epilogue=0.2))  # the kernel's writer pipeline
        assert w.makespan >= w.lower_bound - 1e-9
        meta = get_kernel_metadata(name, g, sms)
        assert meta.num_tasks == s.geometry.num_tasks


def test_first_kv_tiles_without_queries_get_empty_tasks():
    g = Geometry(1, 2, 2, 300, 1000, 64, 128, "local", 100, 0)
    # keys below 1000 - 300 - 100 = 600 are seen by no query: KV tiles 0..3
    assert list(np.flatnonzero(g.task_len == 0)) == [0, 1, 2, 3]
    for name in SCHEDULES:
        s = build_schedule(name, g, 5)
        assert sorted(zip(s.task_head.tolist(), s.task_kv.tolist())) == [(h, kv) for h in range(2)
                                                                           for kv in range(g.n_kv)]


def test_auto_on_windows():
    g = Geometry(1, 8, 8, 4096, 4096, 64, 128, "local", 1024, 0)
    assert resolve_schedule_name("auto", g) == "spt"
    assert resolve_schedule_name("auto", g, deterministic=False) == "lpt"


def test_shift_on_a_band_adds_down_the_kv_tiles_of_a_wave():
    """No rectangle under a bounded left side: each task walks its Q range up, and the
    KV tiles of one wave add into a Q tile from the last down (the order they reach it)."""
    g = Geometry(1, 1, 1, 2048, 2048, 64, 128, "local", 256, 0)
    s = build_schedule("shift", g, 132)  # one wave
    for q in range(g.n_q):
        order = s.accumulation_order(0, 0, q)
        assert list(order) == sorted(order, reverse=True)
    for t in range(s.num_tasks):
        vis = s.visiting_order(t)
        assert list(vis) == list(range(g.q_begin[s.task_kv[t]], g.q_end[s.task_kv[t]]))


def test_lpt_on_a_window_whose_first_tiles_are_shorter():
    """Right-bounded windows cut the first KV tiles' Q ranges at 0 (shorter tasks first):
    lpt still claims a lower KV tile of a head no later (its dQ order is ascending)."""
    g = Geometry(2, 4, 4, 2048, 2048, 64, 128, "local", 64, 512)
    lens = g.task_len
    assert lens[0] < lens.max()
    s = build_schedule("lpt", g, 16)
    for h in range(4):
        kvs = [int(kv) for b, hh, kv in zip(s.task_batch, s.task_head, s.task_kv) if b == 0 and hh == h]
        assert kvs == sorted(kvs)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 3), hkv=st.integers(1, 3), grp=st.sampled_from([1, 2]),
       sq=st.integers(1, 800), sk=st.integers(1, 800),
       bm=st.sampled_from([16, 32, 64, 128]), bn=st.sampled_from([16, 32, 64, 128]),
       left=st.one_of(st.just(-1), st.integers(0, 900)), right=st.one_of(st.just(-1), st.integers(0, 900)),
       sms=st.one_of(st.integers(1, 24), st.sampled_from(SMS)), pipeline=st.sampled_from(["serial", "writer"]))
def test_property_window_schedules_valid_and_simulate(b, hkv, grp, sq, sk, bm, bn, left, right, sms, pipeline):
    g = Geometry(b, hkv * grp, hkv, sq, sk, bm, bn, "local", left, right)
    if g.num_steps > 8000:
        return
    for name in SCHEDULES:
        s = build_schedule(name, g, sms)
        costs = CostModel(1.0, 0.5, latency=0.3 if pipeline == "serial" else 0.0, epilogue=0.2, pipeline=pipeline)
        sim = simulate(s, costs)
        assert sim.makespan >= sim.lower_bound - 1e-9
        assert 0.0 <= sim.sm_idle_fraction < 1.0
        cp = critical_path(s, costs, task_cta=sim.task_cta if s.dynamic else None)
        assert abs(cp.length - sim.makespan) <= 1e-9 * max(1.0, sim.makespan)
