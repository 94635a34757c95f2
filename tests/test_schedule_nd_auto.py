"""The non-deterministic ``auto`` (dash_fa3/schedule/policy.py): where a Q tile takes few dQ adds it
runs the deterministic backward (no zeroed accumulator), elsewhere the accumulation-free pick."""

import pytest

from dash_fa3.schedule import Geometry, resolve_call, resolve_schedule_name
from dash_fa3.schedule import policy as P
from dash_fa3.schedule.contract import WHOLE_GROUP_SCHEDULES


def geom(b, sq, sk, h, hkv, d, causal, window=None):
    kw = {"window_size": window} if window else {"causal": causal}
    return Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=d, **kw)


def test_adds_per_q_tile_counts_the_steps():
    # Full 512 x 512 at head dim 128 (64 x 128 tiles): every Q tile takes all 4 KV tiles.
    assert P.dq_adds_per_q_tile(geom(32, 512, 512, 16, 16, 128, False)) == 4
    # Causal: KV tile j reaches Q tiles from 2j on, so the 8 Q tiles take 1, 1, 2, 2, 3, 3, 4, 4.
    assert P.dq_adds_per_q_tile(geom(32, 512, 512, 16, 16, 128, True)) == 2.5


@pytest.mark.parametrize("shape", [(32, 512, 512, 16, 16, 128, True), (16, 1024, 1024, 32, 32, 64, True),
                                   (32, 512, 512, 32, 32, 64, False), (32, 256, 256, 32, 8, 128, True)])
def test_few_adds_run_the_deterministic_auto(shape):
    g = geom(*shape)
    assert P.dq_adds_per_q_tile(g) <= P.ND_ORDERED_MAX_ADDS and P.nd_runs_ordered(g, shape[5])
    det = resolve_schedule_name("auto", g, headdim=shape[5])
    assert resolve_call("auto", g, False, headdim=shape[5]) == (det, True)
    assert resolve_schedule_name("auto", g, False, headdim=shape[5]) == det


@pytest.mark.parametrize("shape", [(1, 16384, 16384, 16, 16, 128, False), (4, 4096, 4096, 32, 32, 64, True),
                                   (2, 1024, 8192, 16, 4, 128, True)])
def test_many_adds_keep_the_accumulation_free_pick(shape):
    g = geom(*shape)
    assert P.dq_adds_per_q_tile(g) > P.ND_ORDERED_MAX_ADDS and not P.nd_runs_ordered(g, shape[5])
    assert resolve_call("auto", g, False, headdim=shape[5]) == (P.nd_pick(g), False)


def test_gqa_dkv_turns_lower_the_bound():
    # GQA 4 causal 1024 at head dim 128: 4.5 adds per Q tile; the table picks spt, whose GQA dK/dV
    # adds also take turns, so it stays non-deterministic (measured 0.96 there).
    g = geom(4, 1024, 1024, 16, 4, 128, True)
    assert P.dq_adds_per_q_tile(g) == 4.5
    pick = resolve_schedule_name("auto", g, headdim=128)
    assert pick not in WHOLE_GROUP_SCHEDULES
    assert not P.nd_runs_ordered(g, 128)
    # The same adds with whole-group tasks (no dK/dV turns) run ordered.
    g8 = geom(8, 640, 640, 16, 4, 128, True)
    assert resolve_schedule_name("auto", g8, headdim=128) in WHOLE_GROUP_SCHEDULES
    assert P.nd_runs_ordered(g8, 128)


def test_named_schedules_and_windows_keep_the_callers_mode():
    g = geom(32, 512, 512, 16, 16, 128, True)
    assert resolve_call("lpt", g, False) == ("lpt", False)
    assert resolve_call("spt", g, True) == ("spt", True)
    w = geom(32, 512, 512, 16, 16, 128, False, window=(128, 0))
    assert not P.nd_runs_ordered(w)
    assert resolve_call("auto", w, False) == ("lpt", False)
