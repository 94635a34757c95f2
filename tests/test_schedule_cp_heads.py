"""The head-parallel plan (dash_fa3/distributed/heads.py) and what its backward rests on: the whole
problem's schedule restricted to a rank's heads (metadata.restrict_heads) gives each of them the dQ
add order it has in the whole call."""

import dataclasses

import numpy as np
import pytest

from dash_fa3.distributed import heads as cp_heads
from dash_fa3.distributed.layout import G
from dash_fa3.schedule import SCHEDULES, Geometry, bwd_block_sizes, build_schedule
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.validate import dkv_order_ok


def decoded(meta):
    """{(batch, head, q tile, kv tile): rank} of every step of a kernel schedule."""
    row, step, q, rank = meta.decode_all()
    t = meta.tasks
    lg = meta.field("group_interleave_log2")  # grouped rows: virtual tile v is (head + v % group, v // group)
    return {(int(t[r, M.C_BATCH]), int(t[r, M.C_HEAD]) + (int(qq) & ((1 << lg) - 1)), int(qq) >> lg,
             int(t[r, M.C_KV])): int(k)
            for r, qq, k in zip(row, q, rank)}


@pytest.mark.parametrize("dispatch", ["static", "dynamic"])
@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_restricted_schedule_gives_each_head_its_order_in_the_whole_call(name, mask, dispatch):
    """12 query heads on 4 KV heads, batch 2, 5120 tokens (a head's units straddle waves of 132 CTAs,
    so the shift orders differ from head to head): every kept step decodes to the whole call's
    (q, rank), heads renumbered from 0; CTAs keep their rows' order."""
    bm, bn = bwd_block_sizes(128)
    grp = 2 if name.startswith("grouped_") else 3  # grouped_*: power-of-two groups
    g = Geometry(batch=2, heads=4 * grp, heads_kv=4, seqlen_q=5120, seqlen_k=5120, block_m=bm, block_n=bn, mask=mask)
    full = get_kernel_metadata(name, g, 132, dispatch)
    whole = decoded(full)
    for lo, hi in ((0, 1), (1, 3), (3, 4), (0, 4)):
        part = M.restrict_heads(full, lo, hi)
        assert part.field("heads") == grp * (hi - lo) and part.field("heads_kv") == hi - lo
        assert part.num_tasks == 2 * (1 if name.startswith("grouped_") else grp) * (hi - lo) * g.n_kv
        assert part.field("num_steps") == int(part.tasks[:, M.C_N_STEPS].sum())
        want = {(b, h - grp * lo, q, kv): r for (b, h, q, kv), r in whole.items() if grp * lo <= h < grp * hi}
        assert decoded(part) == want
        if not part.dynamic:
            assert part.offsets[0] == 0 and part.offsets[-1] == part.num_tasks
            assert part.field("num_ctas") + 1 == part.field("offsets_len") == part.offsets.size
            assert np.all(np.diff(part.offsets) > 0)      # no CTA without rows
            for c in range(part.field("num_ctas")):
                rows = part.tasks[part.cta_rows(c)]
                assert np.all(rows[:, M.C_CTA] == c)
        flat = part.as_int32_array()
        assert M.ScheduleMeta.from_int32_array(flat).num_tasks == part.num_tasks
        # the dK/dV turns keep their flag and stay certified on the kept heads
        assert part.field("dkv_ordered") == full.field("dkv_ordered")
        if part.field("dkv_ordered"):
            assert dkv_order_ok(part, dataclasses.replace(g, heads=3 * (hi - lo), heads_kv=hi - lo), 132)


def test_shift_orders_differ_between_heads():
    """Why a call with some of the heads needs the restricted schedule: on its own it would give
    them other orders."""
    bm, bn = bwd_block_sizes(128)
    g = Geometry(batch=2, heads=12, heads_kv=4, seqlen_q=5120, seqlen_k=5120, block_m=bm, block_n=bn,
                 mask="causal")
    full = decoded(get_kernel_metadata("symmetric_shift", g, 132))
    per_head = {}
    for (b, h, q, kv), r in full.items():
        per_head.setdefault((b, h), {})[(q, kv)] = r
    orders = list(per_head.values())
    assert any(o != orders[0] for o in orders[1:])


def test_restrict_heads_refuses_heads_out_of_range():
    g = Geometry(batch=1, heads=4, heads_kv=2, seqlen_q=512, seqlen_k=512, block_m=64, block_n=128, mask="causal")
    meta = get_kernel_metadata("spt", g, 132)
    with pytest.raises(ValueError, match=r"KV heads \[1, 3\) are not within the schedule's 2"):
        M.restrict_heads(meta, 1, 3)


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
    # the model's pipeline lets chunks overlap transfers with compute (on two H200s they did not:
    # heads.CHUNKS is 1)
    assert cp_heads.simulate(2, 65536, chunks=4).efficiency > cp_heads.simulate(2, 65536, chunks=1).efficiency


def test_cli_prints_a_table(capsys):
    from dash_fa3.distributed import cli

    assert cli.main(["plan", "--algorithm", "heads", "--P", "2,4", "--seqlen", "64k", "--heads", "32/8"]) == 0
    out = capsys.readouterr().out
    assert "| heads | contiguous | 2 | 65536 |" in out and "| heads | zigzag | 4 | 65536 |" in out
