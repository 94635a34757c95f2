"""The ``runs`` schedule (dash_fa3/schedule/runs.py): each CTA's run, its pieces' dQ splits, the
dK/dV turns of a group on one CTA, and its certificate on the kernel path."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, ScheduleError, build_metadata, build_schedule
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.runs import run_layout
from dash_fa3.schedule.validate import check_metadata, dkv_order_ok

SHAPES = [  # batch, heads, heads_kv, seqlen_q, seqlen_k, headdim, causal
    (8, 16, 2, 256, 8192, 128, True),
    (2, 16, 4, 1024, 8192, 128, False),
    (4, 16, 16, 512, 4096, 64, True),
    (2, 32, 1, 1024, 4096, 128, True),
    (1, 6, 3, 700, 1300, 64, False),
    (2, 4, 2, 300, 1000, 64, True),
    (1, 2, 2, 2048, 2048, 128, True),
]


def geom(b, h, hk, sq, sk, d, causal, window=None):
    kw = dict(window_size=window) if window else dict(causal=causal)
    return Geometry.from_shape(batch=b, heads=h, heads_kv=hk, seqlen_q=sq, seqlen_k=sk, headdim=d, **kw)


@pytest.mark.parametrize("sms", [132, 7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_runs_and_pieces(shape, sms):
    g = geom(*shape)
    batch, head, kv, cta, split, begin, num_ctas, num_splits = run_layout(g, sms)
    assert num_ctas <= sms and np.array_equal(np.unique(cta), np.arange(num_ctas))
    assert np.all(np.diff(cta) >= 0)  # table order: by run
    # one task per (batch, head, KV tile)
    key = np.sort((batch * g.heads + head) * g.n_kv + kv)
    assert np.array_equal(key, np.arange(g.num_heads_total * g.n_kv))
    # runs of about equal work: none above the mean by more than the largest task
    cost = np.maximum(g.task_len[kv], 1)
    load = np.bincount(cta, weights=cost)
    assert load.max() <= cost.sum() / num_ctas + cost.max()
    hidx = batch * g.heads + head
    for h in np.unique(hidx):
        mine = hidx == h
        runs = cta[mine]
        # a head's pieces: split ids 0.. by run, each a contiguous stretch of KV tiles from its begin
        assert np.array_equal(np.unique(split[mine]), np.arange(np.unique(runs).size))
        for r in np.unique(runs):
            piece = mine & (cta == r)
            tiles = kv[piece]
            assert np.array_equal(tiles, np.arange(tiles[0], tiles[0] + tiles.size))  # ascending, contiguous
            assert np.all(begin[piece] == tiles[0]) and np.unique(split[piece]).size == 1
        assert np.all(np.diff(split[mine][np.argsort(kv[mine], kind="stable")]) >= 0)
    # a group's heads of a KV tile: ascending within each run, the lower heads in the later runs
    unit = (batch * g.heads_kv + head // g.group) * g.n_kv + kv
    for u in np.unique(unit):
        rows = np.flatnonzero(unit == u)
        hs, rs = head[rows], cta[rows]
        assert np.all(np.diff(rs) >= 0)
        for a, b in zip(np.unique(rs)[:-1], np.unique(rs)[1:]):
            assert hs[rs == b].max() < hs[rs == a].min()
        for r in np.unique(rs):
            assert np.all(np.diff(hs[rs == r]) > 0)
    assert num_splits == int(split.max()) + 1


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_path_certificate_agrees_with_the_definition(shape):
    g = geom(*shape)
    s = build_schedule("runs", g, 132)  # validates: the decode reproduces the definition, no wait cycle
    meta = build_metadata("runs", g, 132)
    assert np.array_equal(meta.tasks, s.meta.tasks) and np.array_equal(meta.header, s.meta.header)
    check_metadata(meta, g, 132)
    # every dQ add waits only on an add of its own CTA, made earlier in the CTA's program
    pred = s.step_predecessor
    has = pred >= 0
    cta = s.task_cta[s.step_task]
    assert np.array_equal(cta[has], cta[pred[has]])
    assert np.all(pred[has] < np.flatnonzero(has))
    # GQA: the group's dK/dV go in turns, certified
    kernel = get_kernel_metadata("runs", g, 132)
    assert int(kernel.header[M.H_DKV_ORDERED]) == int(g.heads != g.heads_kv)
    if g.heads != g.heads_kv:
        assert dkv_order_ok(meta, g, 132)


def test_windows():
    g = geom(1, 4, 2, 1000, 3000, 128, False, window=(256, 0))
    s = build_schedule("runs", g, 132)
    check_metadata(s.meta, g, 132)


def test_kernel_path_refuses_a_broken_run():
    g = geom(2, 4, 2, 1024, 8192, 128, True)
    meta = build_metadata("runs", g, 132)
    tasks = meta.tasks.copy()
    # two tasks of one piece swapped: the later KV tile would add first, then wait on itself
    rows = np.flatnonzero((tasks[:, M.C_CTA] == 0) & (tasks[:, M.C_HEAD] == tasks[0, M.C_HEAD])
                          & (tasks[:, M.C_BATCH] == tasks[0, M.C_BATCH]))
    assert rows.size >= 2
    tasks[[rows[0], rows[1]]] = tasks[[rows[1], rows[0]]]
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(meta.header.copy(), meta.offsets.copy(), tasks), g, 132)
    header = meta.header.copy()
    header[M.H_NUM_SPLITS] = 1  # fewer accumulators than the pieces use
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), meta.tasks.copy()), g, 132)
    tasks = meta.tasks.copy()
    piece = np.flatnonzero(tasks[:, M.C_SPLIT] == 1)[0]
    tasks[piece, M.C_SPLIT] = 0  # its adds would join another piece's order
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(meta.header.copy(), meta.offsets.copy(), tasks), g, 132)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chains_of_a_groups_heads(shape):
    g = geom(*shape)
    meta = get_kernel_metadata("runs", g, 132)
    t = meta.tasks.astype(np.int64)
    before, after = t[:, M.C_CHAIN_BEFORE], t[:, M.C_CHAIN_AFTER]
    if g.heads == g.heads_kv:
        assert int(meta.header[M.H_DKV_CHAINED]) == 0 and not before.any() and not after.any()
        return
    assert int(meta.header[M.H_DKV_CHAINED]) == 1 and int(meta.header[M.H_DKV_ORDERED]) == 1
    # each chain: consecutive rows of one CTA and KV tile, heads ascending by one, counts agreeing
    starts = np.flatnonzero(before == 0)
    for s0 in starts:
        n = int(after[s0]) + 1
        rows = t[s0:s0 + n]
        assert np.array_equal(rows[:, M.C_CHAIN_BEFORE], np.arange(n))
        assert np.array_equal(rows[:, M.C_CHAIN_AFTER], np.arange(n)[::-1])
        assert np.unique(rows[:, [M.C_CTA, M.C_BATCH, M.C_HEAD_KV, M.C_KV]], axis=0).shape[0] == 1
        assert np.array_equal(rows[:, M.C_HEAD], rows[0, M.C_HEAD] + np.arange(n))
    # a group's heads of a KV tile share one chain but where a run boundary cuts the group
    units = g.batch * g.heads_kv * g.n_kv
    assert starts.size <= units + int(meta.header[M.H_NUM_CTAS]) - 1


def test_kernel_path_refuses_a_broken_chain():
    g = geom(8, 16, 2, 256, 8192, 128, True)
    meta = get_kernel_metadata("runs", g, 132)
    cont = int(np.flatnonzero(meta.tasks[:, M.C_CHAIN_BEFORE] > 0)[0])
    for col, delta in ((M.C_CHAIN_BEFORE, 1), (M.C_CHAIN_AFTER, 1), (M.C_KV, 0)):
        tasks = meta.tasks.copy()
        if col == M.C_KV:  # the row before it on another KV tile: its K and V would be wrong
            tasks[[cont - 1, cont]] = tasks[[cont, cont - 1]]
        else:
            tasks[cont, col] += delta
        with pytest.raises(ScheduleError):
            check_metadata(M.ScheduleMeta(meta.header.copy(), meta.offsets.copy(), tasks), g, 132)
    header = meta.header.copy()
    header[M.H_DKV_ORDERED] = 0  # a chain adds in its first head's turn
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), meta.tasks.copy()), g, 132)
    header = meta.header.copy()
    header[M.H_DKV_CHAINED] = 0  # columns without the header's word
    with pytest.raises(ScheduleError):
        check_metadata(M.ScheduleMeta(header, meta.offsets.copy(), meta.tasks.copy()), g, 132)
    # other schedules carry no chains
    for name in ("split", "spt", "symmetric_shift"):
        other = get_kernel_metadata(name, g, 132)
        assert int(other.header[M.H_DKV_CHAINED]) == 0
        assert not other.tasks[:, [M.C_CHAIN_BEFORE, M.C_CHAIN_AFTER]].any()


@pytest.mark.parametrize("shape,want", [
    ((4, 16, 16, 512, 4096, 64, True), "sections"),  # 4 Q tiles, MHA: sections measured faster
    ((8, 12, 4, 256, 8192, 128, True), "runs"),      # 4 Q tiles of 64 rows, GQA chains (a group of 3)
    ((8, 16, 2, 256, 8192, 128, True), "grouped_sections"),  # a power-of-two group: whole-group tasks
    ((2, 24, 1, 256, 16384, 128, True), "sections"),  # MQA of 24: a run per CTA per head, 25x K's and V's bytes
    ((2, 16, 4, 1024, 8192, 128, False), "grouped_sections"),  # 16 Q tiles, a group of 4
    ((4, 16, 16, 2048, 2048, 128, True), None),      # square: neither
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_auto_picks_runs_for_a_few_q_tiles(shape, want):
    from dash_fa3.schedule import resolve_schedule_name
    g = geom(*shape)
    got = resolve_schedule_name("auto", g, headdim=shape[5])
    assert got == want if want else got not in ("runs", "sections")


def test_a_head_parallel_rank_keeps_its_chains_certified():
    """Head-parallel context parallelism runs the rows of its KV heads (metadata.restrict_heads):
    a group's chains stay whole and the restricted table passes the kernel path's check."""
    from dash_fa3.schedule.metadata import restrict_heads
    g = geom(8, 16, 2, 256, 8192, 128, True)
    meta = get_kernel_metadata("runs", g, 132)
    for lo in (0, 1):
        part = restrict_heads(meta, lo, lo + 1)
        check_metadata(part, geom(8, 8, 1, 256, 8192, 128, True), 132)
        assert int(part.header[M.H_DKV_CHAINED]) == 1
        assert np.array_equal(part.tasks[:, M.C_CHAIN_BEFORE],
                              meta.tasks[meta.tasks[:, M.C_HEAD_KV] == lo, M.C_CHAIN_BEFORE])
