"""The head-parallel plan (dash_fa3/schedule/cp_heads.py) and the kernel property it rests on: a
head's backward bits do not depend on how many heads share the call."""

import dataclasses

import numpy as np
import pytest

from dash_fa3.schedule import SCHEDULES, Geometry, bwd_block_sizes, build_schedule, cp_heads
from dash_fa3.schedule.schedules import POSITION_FREE_SCHEDULES
from dash_fa3.schedule.distributed import G


def dq_add_order(s, heads_kept):
    """(batch, head, q tile, kv tile) -> the step's rank in its dQ tile's add order, for heads < heads_kept."""
    out = {}
    for t in range(len(s.task_kv)):
        b, h, kv = int(s.task_batch[t]), int(s.task_head[t]), int(s.task_kv[t])
        if h >= heads_kept:
            continue
        for i in range(s.step_offsets[t], s.step_offsets[t + 1]):
            out[(b, h, int(s.step_q[i]), kv)] = int(s.step_rank[i])
    return out


def per_head_orders(name, mask, hdim, batch, heads, heads_kv, seqlen, num_sms=132):
    """{(batch, head): {(q tile, kv tile): add rank}} of one schedule."""
    bm, bn = bwd_block_sizes(hdim)
    g = Geometry(batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=seqlen, seqlen_k=seqlen, block_m=bm,
                 block_n=bn, mask=mask)
    per = {}
    for (b, h, q, kv), r in dq_add_order(build_schedule(name, g, num_sms), heads).items():
        per.setdefault((b, h), {})[(q, kv)] = r
    return per


@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.parametrize("name", POSITION_FREE_SCHEDULES)
@pytest.mark.parametrize("hdim", [64, 128])
def test_dq_add_order_of_a_head_is_the_same_in_every_call(name, mask, hdim):
    """The head-parallel algorithm calls the kernel with one rank's heads, renumbered from 0: every
    head must get the order it has in a call with all heads, wherever it sits and whatever the
    number of heads, batch or SMs. 40 960 tokens: a head's tasks outnumber the SMs."""
    want = None
    for batch, heads, heads_kv, sms in ((2, 6, 3, 132), (1, 2, 2, 132), (1, 1, 1, 114), (3, 5, 5, 132)):
        for order in per_head_orders(name, mask, hdim, batch, heads, heads_kv, 40960, sms).values():
            want = want or order
            assert order == want


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - set(POSITION_FREE_SCHEDULES)))
def test_shift_orders_depend_on_the_heads_position(name):
    """Why the head-parallel algorithm does not run the shift orders."""
    orders = list(per_head_orders(name, "causal", 128, 2, 6, 3, 40960).values())
    assert any(o != orders[0] for o in orders[1:])


@pytest.mark.parametrize("P,hk", [(1, 1), (2, 16), (3, 8), (4, 4), (8, 9)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_plan_covers_every_head_and_token_once(P, hk, layout):
    p = cp_heads.plan(P, 2 * P * G * 3, hk * 2, hk, layout, chunks=2)
    heads = sorted(h for lo, hi, _, _ in p.items() for h in range(lo, hi))
    assert heads == list(range(hk))
    per_rank = [sum(hi - lo for lo, hi, r, _ in p.items() if r == rank) for rank in range(P)]
    assert max(per_rank) - min(per_rank) <= 1          # balanced to one KV head
    assert len(p.chunks) == min(2, min(per_rank))
    blocks = sorted(b for pcs in p.pieces for lo, hi in pcs for b in range(lo, hi))
    assert blocks == list(range(p.num_blocks))
    # what a sends b are a's pieces, in a's local order, with their local offsets
    for a in range(P):
        for b in range(P):
            msgs = p.messages(a, b)
            if a == b:
                assert msgs == []
                continue
            offs = np.cumsum([0] + [hi - lo for lo, hi, _ in msgs])[:-1].tolist()
            assert [(lo, hi) for lo, hi, _ in msgs] == list(p.pieces[a]) and [o for *_, o in msgs] == offs


def test_plan_refuses_fewer_kv_heads_than_ranks_and_bad_shapes():
    with pytest.raises(ValueError, match="2 KV heads cannot be shared by 4 ranks"):
        cp_heads.plan(4, 4096, 8, 2, "contiguous")
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        cp_heads.plan(2, 4096, 6, 4, "contiguous")
    with pytest.raises(ValueError, match="multiple of 2\\*P\\*128"):
        cp_heads.plan(2, 4000, 4, 4, "contiguous")
    with pytest.raises(ValueError, match="unknown layout"):
        cp_heads.plan(2, 4096, 4, 4, "ring")


def test_validate_names_a_head_computed_twice_or_never():
    p = cp_heads.plan(2, 4096, 4, 4, "contiguous", chunks=1)
    twice = dataclasses.replace(p, chunks=(((0, 2), (1, 4)),))
    with pytest.raises(ValueError, match="KV head 1 is computed twice"):
        cp_heads.validate(twice)
    never = dataclasses.replace(p, chunks=(((0, 1), (2, 4)),))
    with pytest.raises(ValueError, match=r"KV heads \[1\] are computed by no rank"):
        cp_heads.validate(never)
    lost = dataclasses.replace(p, pieces=(((0, 16),), ((17, 32),)))
    with pytest.raises(ValueError, match="1 token blocks are held by no rank"):
        cp_heads.validate(lost)


def test_model_single_rank_is_the_single_gpu_and_scaling_is_below_linear():
    one = cp_heads.simulate(1, 65536)
    assert one.efficiency == pytest.approx(1.0) and sum(one.exposed_ms) == 0.0
    two = cp_heads.simulate(2, 65536)
    assert 0.8 < two.efficiency < 1.0
    # a longer sequence hides more of the transfers; a faster link shortens them
    assert cp_heads.simulate(2, 262144).efficiency > two.efficiency
    assert cp_heads.simulate(2, 65536, beta_gbs=3500).efficiency > two.efficiency
    # chunks overlap transfers with compute
    assert cp_heads.simulate(2, 65536, chunks=4).efficiency > cp_heads.simulate(2, 65536, chunks=1).efficiency


def test_cli_prints_a_table(capsys):
    assert cp_heads.main(["--P", "2,4", "--seqlen", "64k", "--heads", "32/8"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 0." in out and "| 4 | 0." in out
