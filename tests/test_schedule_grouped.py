"""The grouped_* schedules: a schedule built on the grouped view of a GQA call (one head per KV
head, its group's Q tiles interleaved), whose rows are whole groups (header group_interleave_log2,
dkv_chained = WHOLE). Checked here in the call's own terms: the steps, read back as (query head,
Q tile) the way the kernel reads them, cover every pair the mask needs once, and every dQ tile's
ranks are 0..k-1."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, build_schedule
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.contract import SCHEDULES
from dash_fa3.schedule.grouped import BASES, PREFIX
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.metadata import restrict_heads
from dash_fa3.schedule.schedules import build_metadata
from dash_fa3.schedule.validate import ScheduleError, check_metadata

NAMES = [PREFIX + b for b in BASES]
GQA = [
    Geometry(2, 16, 2, 256, 8192, 64, 128, "causal"),   # few queries, group 8
    Geometry(1, 8, 2, 300, 1700, 64, 128, "causal"),    # ragged tiles
    Geometry(3, 4, 1, 128, 2100, 64, 128, "full"),      # MQA
    Geometry(2, 8, 4, 1000, 1000, 128, 128, "causal"),  # square, group 2
    Geometry(1, 8, 2, 2048, 2048, 64, 128, "local", 256, 0),
]


def _real_steps(meta):
    """Every step as the kernel reads it: (row, batch, query head, KV tile, Q tile, rank)."""
    h, t = meta.header, meta.tasks.astype(np.int64)
    row, _, v, rank = M.decode_all(h, t)
    lg = int(h[M.H_GROUP_INTERLEAVE_LOG2])
    head = t[row, M.C_HEAD] + (v & ((1 << lg) - 1))
    return row, t[row, M.C_BATCH], head, t[row, M.C_KV], v >> lg, rank


@pytest.mark.parametrize("num_sms", [132, 5])
@pytest.mark.parametrize("g", GQA, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_rows_are_whole_groups_and_cover_the_call(name, g, num_sms):
    meta = get_kernel_metadata(name, g, num_sms)
    h, t = meta.header, meta.tasks.astype(np.int64)
    assert int(h[M.H_SCHEDULE]) == SCHEDULES.index(name)
    assert (1 << int(h[M.H_GROUP_INTERLEAVE_LOG2])) == g.group
    assert int(h[M.H_DKV_CHAINED]) == M.DKV_CHAINED_WHOLE and int(h[M.H_DKV_ORDERED]) == 0
    assert (int(h[M.H_HEADS]), int(h[M.H_HEADS_KV])) == (g.heads, g.heads_kv)
    assert np.array_equal(t[:, M.C_HEAD], t[:, M.C_HEAD_KV] * g.group)
    assert not t[:, [M.C_CHAIN_BEFORE, M.C_CHAIN_AFTER]].any()
    assert t.shape[0] == g.batch * g.heads_kv * g.n_kv
    row, b, head, kv, q, rank = _real_steps(meta)
    # every (batch, query head, KV tile, Q tile) the mask needs, once
    key = ((b * g.heads + head) * g.n_kv + kv) * g.n_q + q
    assert np.unique(key).size == key.size == g.num_steps
    assert np.all((q >= g.q_begin[kv]) & (q < g.q_end[kv]))
    assert np.array_equal(t[row, M.C_HEAD_KV], head // g.group)
    # every dQ tile (split, batch, query head, Q tile): ranks 0..k-1, k its KV tiles
    tile = ((t[row, M.C_SPLIT] * g.batch + b) * g.heads + head) * g.n_q + q
    order = np.lexsort((rank, tile))
    first = np.r_[True, tile[order][1:] != tile[order][:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(tile.size), 0))
    assert np.array_equal(rank[order], np.arange(tile.size) - start)
    # the full validation on the view (orders from the definition, decode, deadlock)
    s = build_schedule(name, g, num_sms)
    assert s.geometry == g.grouped()
    assert np.array_equal(s.meta.tasks, meta.tasks)


@pytest.mark.parametrize("name", NAMES)
def test_without_gqa_it_is_its_base(name):
    g = Geometry(2, 4, 4, 1000, 3000, 64, 128, "causal")
    base = name[len(PREFIX):]
    meta, ref = build_metadata(name, g, 40), build_metadata(base, g, 40)
    assert np.array_equal(meta.tasks, ref.tasks) and np.array_equal(meta.offsets, ref.offsets)
    differ = np.flatnonzero(meta.header != ref.header)
    assert differ.tolist() == [M.H_SCHEDULE]
    check_metadata(get_kernel_metadata(name, g, 40), g, 40)


def test_a_group_that_is_not_a_power_of_two_is_refused():
    g = Geometry(1, 12, 4, 512, 4096, 64, 128, "causal")
    with pytest.raises(ValueError, match="power-of-two GQA group"):
        get_kernel_metadata("grouped_sections", g, 132)


def test_tampered_metadata_is_refused():
    g = GQA[0]
    meta = build_metadata("grouped_shift", g, 132)
    check_metadata(meta, g, 132)

    def refused(header=None, tasks=None, match=""):
        bad = M.ScheduleMeta(meta.header.copy() if header is None else header, meta.offsets,
                             meta.tasks.copy() if tasks is None else tasks)
        with pytest.raises(ScheduleError, match=match):
            check_metadata(bad, g, 132)

    t = meta.tasks.copy()
    t[0, M.C_HEAD] += 1                     # not the group's first query head
    refused(tasks=t, match="first query head")
    h = meta.header.copy()
    h[M.H_GROUP_INTERLEAVE_LOG2] -= 1       # a group of 4 for a call of 8
    refused(header=h, match="group_interleave_log2")
    h = meta.header.copy()
    h[M.H_DKV_CHAINED] = M.DKV_UNCHAINED    # the host would write fp32 partials nobody sums
    refused(header=h, match="WHOLE")
    t = meta.tasks.copy()
    t[0, M.C_CHAIN_AFTER] = 1
    refused(tasks=t, match="not chained")


def test_head_parallel_restriction_stays_valid():
    """Context parallelism by heads keeps a KV head's rows whole (metadata.restrict_heads)."""
    g = Geometry(2, 16, 4, 512, 4096, 64, 128, "causal")
    meta = get_kernel_metadata("grouped_sections", g, 132)
    part = restrict_heads(meta, 1, 3)
    sub = Geometry(2, 8, 2, 512, 4096, 64, 128, "causal")
    check_metadata(part, sub, 132)
    assert np.array_equal(part.tasks[:, M.C_HEAD], part.tasks[:, M.C_HEAD_KV] * 4)


def test_auto_for_fp32_dkv_partials_is_never_a_whole_group_schedule():
    """ops.bwd_dkv_fp32 (context parallelism's partials) needs fp32 dK/dV, which whole-group rows
    do not write: its auto leaves them out, and naming one is an error, not a silent substitute."""
    from dash_fa3.schedule import resolve_schedule_name
    from dash_fa3.schedule.policy import WHOLE_GROUP_SCHEDULES

    for g in GQA[:4]:
        assert resolve_schedule_name("auto", g, dkv_fp32=True) not in WHOLE_GROUP_SCHEDULES
    g = GQA[0]
    assert resolve_schedule_name("auto", g) in WHOLE_GROUP_SCHEDULES  # the plain call takes them
    for name in WHOLE_GROUP_SCHEDULES:
        with pytest.raises(ValueError, match="no fp32 dK/dV"):
            resolve_schedule_name(name, g, dkv_fp32=True)
    mha = Geometry(2, 4, 4, 256, 4096, 64, 128, "causal")
    assert resolve_schedule_name("grouped_sections", mha, dkv_fp32=True) == "grouped_sections"


def test_auto_takes_them_only_where_measured():
    """The deterministic auto picks a grouped schedule for few queries under a power-of-two GQA group
    with the tiles of head dims up to 128; elsewhere (head dim 256's 64 x 64 tiles, a group of 3,
    more than 64 Q tiles per head, MHA) another."""
    from dash_fa3.schedule import resolve_schedule_name

    def pick(d, h=16, hkv=2, sq=256, sk=8192):
        g = Geometry.from_shape(batch=4, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=d, causal=True)
        return resolve_schedule_name("auto", g, headdim=d)

    assert pick(128) == pick(64) == "grouped_sections"
    assert pick(128, h=32, hkv=1, sq=1024, sk=16384) == "grouped_split"  # a KV head fills L2 alone
    assert not pick(256).startswith("grouped_")
    assert not pick(128, h=12, hkv=4).startswith("grouped_")
    assert pick(128, sq=4096, sk=65536) == "grouped_split"  # 64 Q tiles per head
    assert not pick(128, sq=4160, sk=65536).startswith("grouped_")
    assert not pick(128, hkv=16).startswith("grouped_")


def test_model_working_set_of_the_mqa_view_fits_l2():
    """MQA 2x1024x16384 32/1 causal (H100 run 13: grouped_sections 2.336 ms, grouped_split 2.167,
    no sign of HBM-bound steps): the view has two heads of 512 virtual Q tiles, 64 MiB of Q, dO and
    dQ accumulator, more than l2_bytes; but its CTAs sweep those tiles side by side, each read
    again a step or so later, so the median reuse (model.calibration.working_set_bytes) fits L2
    and predict_ms runs the steps at their compute cost."""
    from dataclasses import replace

    from dash_fa3.schedule import get_schedule
    from dash_fa3.schedule.model import calibration as C
    from dash_fa3.schedule.model.simulate import simulate

    g = Geometry.from_shape(batch=2, heads=32, heads_kv=1, seqlen_q=1024, seqlen_k=16384, headdim=128,
                            causal=True)
    cal = C.H100
    for name in ("grouped_sections", "grouped_split"):
        s = get_schedule(name, g, 132)
        gv = s.geometry
        every_tile = gv.batch * gv.heads * gv.n_q * gv.block_m * 128 * (2 + 2 + 4)
        assert every_tile == 64 << 20
        sim = simulate(s, cal.cost_model(128, g), num_sms=132)
        assert C.working_set_bytes(s, 128, sim) < cal.l2_bytes < every_tile
        want = (cal.call_overhead_us(g, 128, header=s.meta.header) + sim.makespan) / 1000
        assert C.predict_ms(name, g, 128) == pytest.approx(want, rel=1e-12)
        # with the HBM floor the same run would take far longer
        floor = 132 * 64 * 128 * 12 / cal.pre_post_bytes_per_us
        slow = simulate(s, replace(cal.cost_model(128, g), compute=floor, masked_compute=floor), num_sms=132)
        assert slow.makespan > 1.5 * sim.makespan
