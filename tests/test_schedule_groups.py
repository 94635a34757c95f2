"""The groups schedule: a GQA group's query heads at a KV tile as one chain on one CTA, which
stores the group's dK/dV (header dkv_chained = WHOLE); and the non-deterministic auto that picks it."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, build_schedule, resolve_schedule_name
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.groups import chainable
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.policy import GROUPS_MAX_LOAD_RATIO
from dash_fa3.schedule.schedules import build_metadata
from dash_fa3.schedule.validate import ScheduleError, check_metadata

GQA = [
    Geometry(2, 8, 2, 256, 4096, 64, 128, "causal"),
    Geometry(1, 6, 3, 300, 700, 64, 128, "causal"),
    Geometry(3, 4, 1, 128, 2100, 64, 128, "full"),
    Geometry(2, 8, 2, 1000, 1000, 128, 128, "causal"),
]


@pytest.mark.parametrize("num_sms", [132, 7, 1])
@pytest.mark.parametrize("g", GQA, ids=str)
def test_chains_are_whole_groups_on_one_cta(g, num_sms):
    """Every row sits in the chain of its (batch, KV head, KV tile), the group's heads ascending on
    one CTA; the kernel's check and the full validation (orders, ranks, decode) pass."""
    meta = get_kernel_metadata("groups", g, num_sms)
    h, t = meta.header, meta.tasks.astype(np.int64)
    assert int(h[M.H_DKV_CHAINED]) == M.DKV_CHAINED_WHOLE and int(h[M.H_DKV_ORDERED]) == 0
    assert int(h[M.H_DISPATCH]) == M.DISPATCH_STATIC
    first = np.flatnonzero(t[:, M.C_CHAIN_BEFORE] == 0)
    assert first.size == g.batch * g.heads_kv * g.n_kv
    for i in first:
        rows = t[i:i + g.group]
        assert (rows[:, M.C_HEAD] == rows[0, M.C_HEAD_KV] * g.group + np.arange(g.group)).all()
        for c in (M.C_BATCH, M.C_HEAD_KV, M.C_KV, M.C_CTA):
            assert (rows[:, c] == rows[0, c]).all()
        assert (rows[:, M.C_CHAIN_AFTER] == g.group - 1 - np.arange(g.group)).all()
    check_metadata(meta, g, num_sms)
    s = build_schedule("groups", g, num_sms)
    assert np.array_equal(s.meta.tasks, meta.tasks)


def test_without_gqa_or_under_a_window_there_are_no_chains():
    for g in (Geometry(2, 4, 4, 1000, 1000, 64, 128, "causal"),
              Geometry(1, 4, 2, 2048, 2048, 64, 128, "local", 256, 0)):
        assert not chainable(g)
        meta = get_kernel_metadata("groups", g, 20)
        assert int(meta.header[M.H_DKV_CHAINED]) == M.DKV_UNCHAINED
        assert not meta.tasks[:, [M.C_CHAIN_BEFORE, M.C_CHAIN_AFTER]].any()
        build_schedule("groups", g, 20)


def test_refuses_a_whole_flag_on_chains_that_are_not_whole():
    g = GQA[0]
    meta = build_metadata("groups", g, 132)
    t = meta.tasks.copy()
    t[:, M.C_CHAIN_BEFORE] = t[:, M.C_CHAIN_AFTER] = 0    # no chains, header still says WHOLE
    with pytest.raises(ScheduleError, match="WHOLE"):
        check_metadata(M.ScheduleMeta(meta.header, meta.offsets, t), g, 132)
    h = meta.header.copy()
    h[M.H_DKV_ORDERED] = 1
    with pytest.raises(ScheduleError, match="WHOLE with dkv_ordered"):
        check_metadata(M.ScheduleMeta(h, meta.offsets, meta.tasks), g, 132)
    h = meta.header.copy()
    h[M.H_DKV_CHAINED] = 3
    with pytest.raises(ScheduleError, match="dkv_chained = 3"):
        check_metadata(M.ScheduleMeta(h, meta.offsets, meta.tasks), g, 132)


def _busiest(meta) -> int:
    steps = np.maximum(meta.tasks[:, M.C_N_STEPS].astype(np.int64), 1)
    return int(np.add.reduceat(steps, meta.offsets[:-1].astype(np.int64)).max())


@pytest.mark.parametrize("shape,want", [
    ((8, 256, 8192, 16, 2, 128, "causal"), "groups"),   # few queries: chains balance
    ((2, 1024, 8192, 16, 4, 128, "full"), "groups"),
    ((2, 1024, 16384, 32, 1, 128, "causal"), "groups"),  # MQA
    ((2, 8192, 8192, 32, 4, 128, "causal"), "lpt"),     # long causal chains, four per CTA
    ((4, 1024, 4096, 16, 16, 128, "causal"), "lpt"),    # MHA
])
def test_nd_auto_is_groups_where_its_chains_balance(shape, want):
    b, sq, sk, h, hkv, d, mask = shape
    g = Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=d,
                            causal=mask == "causal")
    assert resolve_schedule_name("auto", g, deterministic=False) == want
    assert resolve_schedule_name("auto", g, deterministic=True) != "groups"
    if h != hkv:
        # the rule is the claim model's busiest CTA: groups' static table against lpt's lowering
        ratio = _busiest(get_kernel_metadata("groups", g, 132)) / _busiest(get_kernel_metadata("lpt", g, 132,
                                                                                                 "static"))
        assert (ratio <= GROUPS_MAX_LOAD_RATIO) == (want == "groups")


def test_model_counts_no_dkv_partials_for_whole_groups():
    from dash_fa3.schedule.model.calibration import pre_post_bytes
    g = GQA[0]
    whole = build_metadata("groups", g, 132).header
    lpt = build_metadata("lpt", g, 132).header
    kv_bytes = g.batch * g.seqlen_k * g.heads_kv * 2 * 64 * 4
    for det in (True, False):
        assert pre_post_bytes(g, 64, deterministic=det, header=lpt) - pre_post_bytes(
            g, 64, deterministic=det, header=whole) >= kv_bytes


@pytest.mark.parametrize("name", ["groups", "runs"])
def test_model_stores_dkv_once_per_chain(name):
    """The simulator charges a chain one epilogue (the dK/dV store or add), on its last row: the rows
    before it hand K, V and dK/dV on in registers and the next row starts as their last step ends
    (model.simulate.epilogue_weights). Unchained rows (lpt) each have theirs."""
    from dash_fa3.schedule import CostModel, get_schedule, simulate

    g = GQA[0]
    costs = CostModel(compute=1.0, reduce=0.5, epilogue=3.0, deterministic=False)
    s = get_schedule(name, g, 132)
    after = s.meta.tasks[:, M.C_CHAIN_AFTER].astype(np.int64)
    ends = int((after == 0).sum())
    assert ends < s.num_tasks
    sim = simulate(s, costs, num_sms=132)
    assert sim.work == pytest.approx(s.num_steps + 3.0 * ends)
    inner = np.flatnonzero(after > 0)
    assert np.allclose(sim.task_end[inner], sim.epilogue_start[inner])
    assert np.allclose(sim.task_start[inner + 1], sim.task_end[inner])
    assert np.allclose(sim.task_end[after == 0] - sim.epilogue_start[after == 0], 3.0)
    lpt = get_schedule("lpt", g, 132)
    assert simulate(lpt, costs, num_sms=132).work == pytest.approx(lpt.num_steps + 3.0 * lpt.num_tasks)
