"""Lowering dynamic schedules to the static task lists the kernel runs (CPU)."""

import numpy as np
import pytest

from dash_fa3.schedule import SCHEDULES, Geometry, build_schedule, get_schedule
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule import policy
from dash_fa3.schedule.lowering import get_kernel_metadata, greedy_assignment, lower_to_static
from test_schedule_validation import GRID, SMS


def per_task_orders(s):
    """{(batch, head, kv): (Q visiting order, ranks)}: what lowering must not change."""
    return {
        (int(s.task_batch[t]), int(s.task_head[t]), int(s.task_kv[t])): (tuple(s.visiting_order(t)), tuple(s.ranks(t)))
        for t in range(s.num_tasks)
    }


def test_greedy_assignment_is_list_scheduling():
    # costs 5,1,1,1 on 2 CTAs: task 0 -> CTA 0; tasks 1..3 -> CTA 1 (frees at 1, 2, 3 < 5)
    assert greedy_assignment(np.array([5, 1, 1, 1]), 2).tolist() == [0, 1, 1, 1]
    assert greedy_assignment(np.array([2, 2, 2, 2]), 2).tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("name", ["fa3", "spt", "descending"])
@pytest.mark.parametrize("shape", [(2, 3, 1, 1000, 777, True), (1, 4, 4, 512, 2048, False), (3, 2, 2, 300, 300, True)])
def test_lowering_keeps_orders_and_validates(name, shape):
    b, h, hkv, sq, sk, causal = shape
    g = Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=128, causal=causal)
    s = build_schedule(name, g, 7)
    low = lower_to_static(s)
    assert not low.dynamic and low.meta.header[M.H_DISPATCH] == M.DISPATCH_STATIC
    assert per_task_orders(low) == per_task_orders(s)
    # each CTA runs its tasks in queue order
    queue_pos = {(int(b_), int(h_), int(k_)): i for i, (b_, h_, k_) in enumerate(zip(s.task_batch, s.task_head, s.task_kv))}
    for cta in range(low.num_ctas):
        pos = [queue_pos[(int(low.task_batch[t]), int(low.task_head[t]), int(low.task_kv[t]))] for t in low.cta_tasks(cta)]
        assert pos == sorted(pos)


def test_static_schedules_are_not_changed():
    g = Geometry.model(8, 4, "causal")
    s = build_schedule("symmetric_shift", g, 8)
    assert lower_to_static(s) is s


@pytest.mark.parametrize("sms", SMS)
def test_kernel_metadata_on_the_bench_grid(sms):
    for _, g in GRID:
        for name in SCHEDULES:
            static = get_kernel_metadata(name, g, sms, "static")
            assert static.header[M.H_DISPATCH] == M.DISPATCH_STATIC
            assert static.header[M.H_NUM_CTAS] <= sms
            # Dynamic dispatch runs a queue schedule's own table (queue order, no CTA lists).
            dynamic = get_kernel_metadata(name, g, sms, "dynamic")
            queue = get_schedule(name, g, sms).dynamic
            assert dynamic.dynamic == queue and dynamic.header[M.H_NUM_CTAS] <= sms
            if queue:
                assert dynamic.header[M.H_OFFSETS_LEN] == 0
                assert np.array_equal(dynamic.tasks, get_schedule(name, g, sms).meta.tasks)
            else:
                assert dynamic is static


def test_kernel_dispatch_is_checked():
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=512, headdim=128, causal=True)
    with pytest.raises(ValueError, match="dispatch"):
        get_kernel_metadata("spt", g, 132, "greedy")


def test_kernel_metadata_is_cached():
    g = Geometry.from_shape(batch=8, heads=16, seqlen_q=2048, headdim=128, causal=True)
    assert policy.get_kernel_metadata("auto", g, 132) is get_kernel_metadata("spt", g, 132)
    with pytest.raises(ValueError, match="'auto' is resolved"):   # the contract takes concrete names
        get_kernel_metadata("auto", g, 132)
    assert get_kernel_metadata("descending", g, 132) is not get_kernel_metadata("fa3", g, 132)
    assert get_schedule("spt", g, 132).dynamic
