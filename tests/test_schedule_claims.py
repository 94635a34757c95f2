"""simulate_claims: the writer pipeline with queue schedules claimed at run time (CPU)."""

import numpy as np
import pytest

from dash_fa3.schedule import CostModel, Geometry, build_schedule, simulate
from dash_fa3.schedule.model.simulate import simulate_claims

COSTS = CostModel(1.0, 0.7, latency=0.3, read=0.3, epilogue=0.5)


def test_equal_tasks_without_waits_claim_like_the_lowering():
    # Non-deterministic, full mask: every task has the same length and nothing waits,
    # so the CTA free first at claim time is the one the lowering's cost model picks.
    g = Geometry.from_shape(batch=2, heads=3, seqlen_q=1000, headdim=128, causal=False)
    s = build_schedule("fa3", g, 7)
    nd = CostModel(1.0, 0.7, latency=0.3, read=0.3, epilogue=0.5, deterministic=False)
    a, b = simulate(s, nd), simulate_claims(s, nd)
    assert b.makespan == pytest.approx(a.makespan) and np.array_equal(a.task_cta, b.task_cta)


@pytest.mark.parametrize("name", ["fa3", "spt", "descending", "lpt"])
def test_every_add_follows_its_predecessor(name):
    g = Geometry.from_shape(batch=2, heads=4, heads_kv=2, seqlen_q=900, seqlen_k=1100, headdim=64, causal=True)
    s = build_schedule(name, g, 9)
    sim = simulate_claims(s, COSTS)
    gid, rank = s.step_dq_tile, s.step_rank
    order = np.lexsort((rank, gid))
    same = gid[order][1:] == gid[order][:-1]
    prev, nxt = order[:-1][same], order[1:][same]
    assert np.all(sim.step_reduce_start[nxt] >= sim.step_end[prev] + COSTS.latency - 1e-9)
    # each CTA runs its tasks one after another, in queue order
    for cta in np.unique(sim.task_cta):
        tasks = np.flatnonzero(sim.task_cta == cta)
        assert np.all(np.diff(tasks) > 0) and np.all(sim.task_start[tasks[1:]] >= sim.task_end[tasks[:-1]] - 1e-9)
    assert sim.makespan >= sim.lower_bound - 1e-9


def test_one_cta_per_task_is_the_lowering():
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=640, headdim=64, causal=True)
    s = build_schedule("fa3", g, 64)   # 10 tasks, 64 SMs: every task its own CTA either way
    assert simulate_claims(s, COSTS).makespan == pytest.approx(simulate(s, COSTS).makespan)


def test_static_schedules_keep_their_cta_lists():
    """Nothing is claimed in a static schedule: every task runs on the CTA the schedule gives it,
    each CTA's tasks in table order, and the dQ adds still follow the ranks."""
    g = Geometry.from_shape(batch=1, heads=4, seqlen_q=1024, headdim=128, causal=True)
    s = build_schedule("symmetric_shift", g, 16)
    sim = simulate_claims(s, COSTS)
    assert np.array_equal(sim.task_cta, s.task_cta)
    for cta in range(s.num_ctas):
        tasks = s.cta_tasks(cta)
        assert np.all(sim.task_start[tasks[1:]] >= sim.task_end[tasks[:-1]] - 1e-9)
    pred = s.step_predecessor
    has = pred >= 0
    assert np.all(sim.step_reduce_start[has] >= sim.step_end[pred[has]] + COSTS.latency - 1e-9)
