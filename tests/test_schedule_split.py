"""The ``split`` schedule (dash_fa3/schedule/split.py): its layout, its certificate on the kernel
path, and where ``auto`` picks it."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, ScheduleError, build_metadata, build_schedule, resolve_schedule_name
from dash_fa3.schedule import metadata as M
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


@pytest.mark.parametrize("shape", RECT, ids=lambda s: "x".join(map(str, s)))
def test_kernel_path_certificate_agrees_with_the_definition(shape):
    g = geom(*shape)
    s = build_schedule("split", g, 132)  # validates: the decode reproduces the definition
    meta = build_metadata("split", g, 132)
    assert np.array_equal(meta.tasks, s.meta.tasks) and np.array_equal(meta.header, s.meta.header)
    check_metadata(meta, g, 132)
    assert s.num_splits > 1
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
    (1024, 8192, True, "split"), (1024, 4096, True, "split"), (1024, 2048, True, None),
    (1024, 2048, False, "split"), (2048, 2048, False, None), (4096, 1024, True, None)])
def test_auto_picks_split_where_keys_outnumber_queries(sq, sk, causal, want):
    g = Geometry.from_shape(batch=1, heads=4, seqlen_q=sq, seqlen_k=sk, headdim=128, causal=causal)
    got = resolve_schedule_name("auto", g)
    assert (got == "split") == (want == "split")
    assert resolve_schedule_name("auto", g, deterministic=False) == "lpt"
