"""The kernel's input: round trip of the compact metadata through the device arithmetic."""

import numpy as np
import pytest

from dash_fa3.schedule import SCHEDULES, Geometry, ScheduleMeta, build_schedule, decode_step
from dash_fa3.schedule import metadata as M

SHAPES = [
    Geometry.model(8, 4, "causal"),
    Geometry.model(5, 3, "causal"),
    Geometry.model(6, 2, "full"),
    Geometry(2, 6, 3, 1000, 1000, 64, 128, "causal"),     # GQA, ragged, bm != bn
    Geometry(1, 4, 2, 700, 300, 64, 64, "causal"),        # seqlen_q > seqlen_k
    Geometry(3, 2, 1, 300, 900, 128, 64, "causal"),       # seqlen_k > seqlen_q
    Geometry(1, 3, 3, 333, 555, 32, 64, "full"),
]


def regenerate(meta: ScheduleMeta):
    """Per row, per step, decode_step (the device's order of work; tests/test_contract_cpp.py
    compares the C++ decode itself)."""
    h = meta.header.tolist()
    qs, ranks = [], []
    for row in meta.tasks.tolist():
        for s in range(row[M.C_N_STEPS]):
            q, r = decode_step(h, row, s)
            qs.append(q)
            ranks.append(r)
    return np.array(qs), np.array(ranks)


@pytest.mark.parametrize("g", SHAPES, ids=lambda g: g.describe())
@pytest.mark.parametrize("sms", [3, 7, 132])
@pytest.mark.parametrize("name", SCHEDULES)
def test_round_trip_scalar(name, g, sms):
    s = build_schedule(name, g, sms)
    q, r = regenerate(s.meta)
    assert np.array_equal(q, s.step_q)           # (b) visiting orders
    assert np.array_equal(r, s.step_rank)        # (c) dQ ranks
    # (a) which rows each CTA runs
    if s.dynamic:
        assert s.meta.offsets.size == 0 and int(s.meta.header[M.H_DISPATCH]) == M.DISPATCH_DYNAMIC
    else:
        for c in range(s.num_ctas):
            rows = s.meta.cta_rows(c)
            assert np.all(s.meta.tasks[rows.start:rows.stop, M.C_CTA] == c)
            assert np.array_equal(np.arange(rows.start, rows.stop), s.cta_tasks(c))


@pytest.mark.parametrize("name", SCHEDULES)
def test_flat_buffer_round_trip_and_size(name):
    g = Geometry.from_shape(batch=4, heads=16, seqlen_q=4096, headdim=64, causal=True)
    s = build_schedule(name, g, 132)
    flat = s.meta.as_int32_array()
    assert flat.dtype == np.int32 and flat.ndim == 1
    back = ScheduleMeta.from_int32_array(flat)
    for k, v in s.meta.to_numpy().items():
        assert np.array_equal(back.to_numpy()[k], v)
    # O(tasks), not O(tiles^2): a header, the CTA offsets and one row per task, far fewer than the steps
    n_off = 0 if s.dynamic else s.num_ctas + 1
    assert flat.size == M.HEADER_LEN + n_off + M.NUM_COLS * s.num_tasks and s.meta.nbytes == 4 * flat.size
    assert s.num_steps > 10 * s.num_tasks
    # spot-check the scalar decoder on the big shape
    rng = np.random.default_rng(0)
    for k in rng.integers(0, s.num_steps, size=300):
        t = int(s.step_task[k])
        assert back.decode_step(t, int(s.step_index[k])) == (int(s.step_q[k]), int(s.step_rank[k]))


def test_header_fields():
    g = Geometry(2, 8, 4, 1000, 1200, 64, 128, "causal")
    s = build_schedule("symmetric_shift", g, 20)
    h = s.meta.header_dict()
    assert h["magic"] == M.MAGIC and h["num_cols"] == M.NUM_COLS and h["num_ctas"] == 20
    assert (h["seqlen_q"], h["seqlen_k"], h["block_m"], h["block_n"], h["mask"]) == (1000, 1200, 64, 128, M.MASK_CAUSAL)
    assert (h["window_left"], h["window_right"]) == (-1, 0)
    assert (h["n_q"], h["n_kv"]) == (g.n_q, g.n_kv)
    assert h["pairs_hi"] == g.n_kv // 2 and h["units_per_head"] == g.n_kv - g.n_kv // 2
    with pytest.raises(ValueError):
        ScheduleMeta.from_int32_array(np.zeros(40, np.int32))
    h = build_schedule("spt", Geometry(1, 2, 2, 700, 500, 64, 128, "local", 100, 3), 20).meta.header_dict()
    assert (h["mask"], h["window_left"], h["window_right"]) == (M.MASK_LOCAL, 100, 3)


def test_decode_step_is_integer_only():
    """decode_step returns Python ints."""
    s = build_schedule("symmetric_shift", Geometry(1, 2, 2, 500, 700, 64, 64, "causal"), 3)
    h = s.meta.header.tolist()
    for row in s.meta.tasks.tolist():
        for st in range(row[M.C_N_STEPS]):
            q, r = decode_step(h, row, st)
            assert type(q) is int and type(r) is int and r >= 0
