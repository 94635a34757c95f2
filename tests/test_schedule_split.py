"""The ``split`` schedule (dash_fa3/schedule/split.py): its layout, its certificate on the kernel
path, and where ``auto`` picks it."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, ScheduleError, build_metadata, build_schedule, resolve_schedule_name
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.policy import nd_runs_ordered
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.geometry import L2_BUDGET, head_section
from dash_fa3.schedule.split import split_layout
from dash_fa3.schedule.validate import check_metadata

RECT = [  # batch, heads, heads_kv, seqlen_q, seqlen_k, headdim, causal
    (2, 4, 2, 1024, 8192, 128, True),
    (2, 4, 2, 1024, 8192, 128, False),
    (1, 3, 1, 512, 4096, 64, True),
    (3, 2, 2, 300, 5000, 128, True),
    (1, 2, 1, 200, 777, 64, False),
]


def geom(b, h, hk, sq, sk, d, causal):
    return Geometry.from_shape(batch=b, heads=h, heads_kv=hk, seqlen_q=sq, seqlen_k=sk, headdim=d, causal=causal)


@pytest.mark.parametrize("shape", RECT, ids=lambda s: "x".join(map(str, s)))
def test_layout(shape):
    g = geom(*shape)
    split, begin, rect = split_layout(g)
    n_q = g.n_q
    # consecutive tiles, splits numbered in order, each with its first tile as begin
    assert split[0] == 0 and np.all(np.diff(split) >= 0) and np.all(np.diff(split) <= 1)
    for s in np.unique(split):
        tiles = np.flatnonzero(split == s)
        assert np.all(begin[tiles] == tiles[0])
        # the rectangle: met by every tile of the split, at least as wide as the split
        assert np.all(g.q_begin[tiles] <= rect[tiles[0]]) and rect[tiles[0]] == g.q_begin[tiles[-1]]
        assert tiles.size <= max(n_q - rect[tiles[0]], 1)
        # one q_begin, or distinct ones: no two tiles walk below the rectangle in step
        qb = g.q_begin[tiles]
        assert np.unique(qb).size in (1, qb.size)


@pytest.mark.parametrize("name", ["split", "interleave"])
@pytest.mark.parametrize("shape", RECT, ids=lambda s: "x".join(map(str, s)))
def test_kernel_path_certificate_agrees_with_the_definition(shape, name):
    g = geom(*shape)
    s = build_schedule(name, g, 132)  # validates: the decode reproduces the definition
    meta = build_metadata(name, g, 132)
    assert np.array_equal(meta.tasks, s.meta.tasks) and np.array_equal(meta.header, s.meta.header)
    check_metadata(meta, g, 132)
    assert s.num_splits > 1 or name == "interleave"
    # every (split, dQ tile) gets ranks 0..k-1
    key = s.step_dq_tile
    for gid in np.unique(key):
        r = np.sort(s.step_rank[key == gid])
        assert np.array_equal(r, np.arange(r.size))


def test_kernel_path_refuses_a_wrong_split():
    g = geom(2, 4, 2, 1024, 8192, 128, True)
    meta = build_metadata("split", g, 132)
    tasks = meta.tasks.copy()
    row = int(np.flatnonzero(tasks[:, M.C_SPLIT] == 1)[0])
    tasks[row, M.C_SPLIT] = 0  # its adds would join split 0's order
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(meta.header.copy(), meta.offsets.copy(), tasks), g, 132)
    header = meta.header.copy()
    header[M.H_NUM_SPLITS] = 1  # fewer accumulators than the rows use
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), meta.tasks.copy()), g, 132)


def test_windows_get_one_split_without_a_rectangle():
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=1000, seqlen_k=3000, headdim=128, window_size=(256, 0))
    s = build_schedule("split", g, 132)
    assert s.num_splits == 1
    assert np.all(s.meta.tasks[:, M.C_RECT] == g.n_q)


@pytest.mark.parametrize("sq,sk,causal,want", [
    (1024, 8192, True, "sections"), (1024, 4096, True, "sections"), (1024, 2048, True, "sections"),
    (1024, 2048, False, "sections"), (2048, 3072, False, None), (2048, 2048, False, None), (4096, 1024, True, None)])
def test_auto_picks_sections_from_two_keys_per_query(sq, sk, causal, want):
    g = Geometry.from_shape(batch=1, heads=4, seqlen_q=sq, seqlen_k=sk, headdim=128, causal=causal)
    got = resolve_schedule_name("auto", g)
    assert (got == "sections") == (want == "sections")
    # Non-deterministic: lpt, or the deterministic pick where a Q tile takes few adds (4096 x 1024).
    nd = resolve_schedule_name("auto", g, deterministic=False)
    assert nd == (got if nd_runs_ordered(g) else "lpt")
    assert nd_runs_ordered(g) == (sq == 4096)


@pytest.mark.parametrize("sms", [132, 16, 7])
@pytest.mark.parametrize("shape", RECT + [(4, 16, 16, 1024, 4096, 128, True), (3, 5, 1, 256, 6000, 64, False)],
                         ids=lambda s: "x".join(map(str, s)))
def test_interleave_runs_sections_side_by_side(shape, sms):
    g = geom(*shape)
    section = head_section(g)
    s = build_schedule("interleave", g, sms)
    assert int(s.meta.header[M.H_HEAD_SECTION]) == section >= 1
    H, n = g.num_heads_total, g.n_kv
    hidx = s.task_batch * g.heads + s.task_head
    u = M.planned_unit(hidx, s.task_kv, n, section, H)
    # the launch order is a permutation of the units, section by section, KV tile by KV tile
    assert np.array_equal(np.sort(u), np.arange(H * n))
    assert np.array_equal(s.task_cta, u % sms)
    first = (hidx // section) * section
    assert np.all((u >= first * n) & (u < np.minimum(first + section, H) * n))
    # a wave holds a consecutive run of each head's KV tiles, no more than a split's rectangle is wide
    # unless the split holds no more than the rectangle is wide
    wave = u // sms
    for h in np.unique(hidx):
        mine = hidx == h
        for w in np.unique(wave[mine]):
            kv = np.sort(s.task_kv[mine & (wave == w)])
            assert np.array_equal(kv, np.arange(kv[0], kv[0] + kv.size))
    # never more dQ splits than ``split``
    assert s.num_splits <= build_schedule("split", g, sms).num_splits


def test_interleave_section_keeps_heads_within_the_l2_budget():
    g = geom(1, 32, 8, 4096, 65536, 128, True)
    section = head_section(g)
    per_head = g.n_q * g.block_m * 128 * 8
    fit = L2_BUDGET // per_head  # 10 heads of 4 MiB: 4 sections of 8, not 10 + 10 + 10 + 2
    assert (section, fit) == (8, 10)
    g = geom(4, 16, 16, 512, 4096, 64, True)  # 64 heads of 512 KiB: all in one section
    assert head_section(g) == 64


def test_kernel_path_refuses_a_section_on_other_rank_kinds():
    g = geom(2, 4, 2, 1024, 8192, 128, True)
    meta = build_metadata("symmetric_shift", g, 132)
    header = meta.header.copy()
    header[M.H_HEAD_SECTION] = 2
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), meta.tasks.copy()), g, 132)


def test_kernel_path_refuses_interleave_metadata_under_the_wrong_section():
    g = geom(2, 4, 2, 1024, 8192, 128, True)
    meta = build_metadata("interleave", g, 16)
    header = meta.header.copy()
    header[M.H_HEAD_SECTION] = 0  # the waves the certificate assumes are then not the launch's
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), meta.tasks.copy()), g, 16)


@pytest.mark.parametrize("sms", [132, 16])
@pytest.mark.parametrize("shape", RECT + [(4, 16, 16, 1024, 4096, 128, True), (2, 3, 3, 1000, 1000, 64, True)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sections_is_spt_queued_section_by_section(shape, sms):
    g = geom(*shape)
    sec = head_section(g)
    s, spt = build_schedule("sections", g, sms), build_schedule("spt", g, sms)
    check_metadata(build_metadata("sections", g, sms), g, sms)
    hidx = s.task_batch * g.heads + s.task_head
    # spt's tasks, each head's in spt's order (kv descending): the ranks and their decode are spt's
    assert int(s.meta.header[M.H_RANK_KIND]) == int(spt.meta.header[M.H_RANK_KIND]) == M.RANK_DESC
    for h in np.unique(hidx):
        assert np.array_equal(s.task_kv[hidx == h], np.arange(g.n_kv)[::-1])
    key = lambda x: np.lexsort((x.task_kv, x.task_batch * g.heads + x.task_head))  # noqa: E731
    assert np.array_equal(np.sort(s.step_rank), np.sort(spt.step_rank))
    assert np.array_equal(s.task_kv[key(s)], spt.task_kv[key(spt)])
    # the queue: sections in order, within one KV tile by KV tile, its heads side by side; a GQA
    # group's i-th head one place behind the (i-1)-th
    section = hidx // sec
    assert np.all(np.diff(section) >= 0)
    for j in np.unique(section):
        mine = section == j
        place = (g.n_kv - 1 - s.task_kv[mine]) + (hidx[mine] % g.heads) % g.group
        hh = hidx[mine]
        assert np.all(np.diff(place) >= 0)
        same = place[1:] == place[:-1]
        assert np.all(np.diff(hh)[same] > 0)


@pytest.mark.parametrize("shape,turns", [
    ((2, 16, 4, 1024, 8192, 128, True), True), ((2, 16, 4, 1024, 8192, 128, False), True),
    ((1, 32, 8, 1000, 4000, 128, True), True),
    ((8, 16, 2, 256, 8192, 128, True), False),  # 4 Q tiles: the group's tasks of a tile overlap
    ((4, 16, 4, 512, 4096, 64, True), False),   # 128-row steps: the turns measured slower (dkv_order_pays)
    ((4, 16, 16, 512, 4096, 128, True), False)])  # MHA: no group
def test_sections_adds_a_groups_dkv_in_turns(shape, turns):
    g = geom(*shape)
    for sms in (132, 16):
        meta = get_kernel_metadata("sections", g, sms)
        assert int(meta.header[M.H_DKV_ORDERED]) == int(turns)
        check_metadata(meta, g, sms)
