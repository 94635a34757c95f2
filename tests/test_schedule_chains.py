"""No chains in the three-warpgroup kernel (head dim 192): the contract says which kernels run
chains (contract.BWD_CHAINS, read by the kernels as BwdTraits::kChains), and the chaining
schedules (runs, groups) are neither offered, picked nor built for the other ones."""

import numpy as np
import pytest

from dash_fa3.schedule import (Geometry, ScheduleError, build_metadata, build_schedule, get_metadata,
                               resolve_schedule_name, schedules_for)
from dash_fa3.schedule import geometry as geometry_module
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.contract import BWD_BLOCK_SIZES, BWD_CHAINS, BWD_MMA_WARPGROUPS, bwd_tiles_chain
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.policy import nd_pick, table_pick
from dash_fa3.schedule.validate import check_metadata

CHAINING = ("runs", "groups")
# Shapes where head dim 128 runs chains: runs or groups is auto's pick (deterministic or not).
SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv, causal
    (8, 256, 8192, 12, 4, True),     # deterministic auto: runs (a group of 3, 4 Q tiles)
    (8, 256, 8192, 16, 2, True),     # non-deterministic auto: groups
    (2, 1024, 8192, 16, 4, False),
    (2, 1024, 16384, 32, 1, True),   # MQA
    (1, 300, 700, 6, 3, False),
    (2, 2048, 2048, 8, 8, True),     # MHA
]


def geom(shape, headdim):
    b, sq, sk, h, hkv, causal = shape
    return Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=headdim,
                               causal=causal)


def test_three_warpgroup_kernels_have_no_chains():
    assert {d for d, c in BWD_CHAINS.items() if not c} == {d for d, w in BWD_MMA_WARPGROUPS.items() if w == 3} \
        == {192}
    assert not bwd_tiles_chain(*BWD_BLOCK_SIZES[192])
    assert all(bwd_tiles_chain(*BWD_BLOCK_SIZES[d]) for d in BWD_BLOCK_SIZES if d != 192)
    assert bwd_tiles_chain(128, 128) and bwd_tiles_chain(32, 32)  # the model's tiles too


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chaining_schedules_are_offered_only_where_the_kernel_chains(shape):
    for d in BWD_BLOCK_SIZES:
        offered = schedules_for(geom(shape, d))
        assert all((name in offered) == (d != 192) for name in CHAINING), (d, offered)


@pytest.mark.parametrize("num_sms", [132, 7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_auto_never_picks_a_chained_schedule_at_head_dim_192(shape, num_sms):
    g = geom(shape, 192)
    picks = {resolve_schedule_name("auto", g, det, num_sms=num_sms, headdim=192) for det in (True, False)}
    picks |= {table_pick(g, 192, num_sms), nd_pick(g, num_sms)}
    assert not picks & set(CHAINING), picks
    for name in picks:
        meta = get_kernel_metadata(name, g, num_sms)
        assert int(meta.header[M.H_DKV_CHAINED]) == M.DKV_UNCHAINED or int(meta.header[M.H_GROUP_INTERLEAVE_LOG2]) > 0
        assert not meta.tasks[:, [M.C_CHAIN_BEFORE, M.C_CHAIN_AFTER]].any()


def test_head_dim_128_picks_them_on_the_same_shapes():
    """The shapes above do exercise the rule: at head dim 128 auto chains on them."""
    assert resolve_schedule_name("auto", geom(SHAPES[0], 128), headdim=128) == "runs"
    assert resolve_schedule_name("auto", geom(SHAPES[1], 128), deterministic=False) == "groups"


@pytest.mark.parametrize("name", CHAINING)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=["gqa", "mha"])
def test_asking_for_a_chained_schedule_at_head_dim_192_raises(name, shape):
    g = geom(shape, 192)
    assert resolve_schedule_name(name, g) == name  # a name, not yet a table
    for build in (build_schedule, build_metadata, get_metadata, get_kernel_metadata):
        with pytest.raises(ValueError, match=rf"schedule '{name}' .* head dim 192 .* does not run"):
            build(name, g, 132)


def test_kernel_path_refuses_chains_where_the_kernel_has_none(monkeypatch):
    """check_metadata refuses a chained table for tiles whose kernel has no chains (here head dim
    128's tiles, made chain-free for the test)."""
    g = geom(SHAPES[0], 128)
    meta = get_kernel_metadata("runs", g, 132)
    assert int(meta.header[M.H_DKV_CHAINED]) == M.DKV_CHAINED_ADD and meta.tasks[:, M.C_CHAIN_AFTER].any()
    check_metadata(meta, g, 132)
    monkeypatch.setattr(geometry_module, "bwd_tiles_chain", lambda block_m, block_n: False)
    with pytest.raises(ScheduleError, match="has no chains"):
        check_metadata(meta, g, 132)
    # the same rows unchained (each row stores its own dK/dV) pass
    header, tasks = meta.header.copy(), meta.tasks.copy()
    header[M.H_DKV_CHAINED] = header[M.H_DKV_ORDERED] = 0
    tasks[:, [M.C_CHAIN_BEFORE, M.C_CHAIN_AFTER]] = 0
    check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), np.ascontiguousarray(tasks)), g, 132)
