"""The kernel path's schedule check (validate.check_metadata on schedules.build_metadata): the same
metadata as the full build, accepted wherever the full validation accepts, and refusing broken
task tables (coverage, ranks, the deadlock certificate) that it is handed."""

import numpy as np
import pytest

from dash_fa3.schedule import SCHEDULES, Geometry, build_schedule, schedules_for
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.export import DEFAULT_GRID, grid_geometries
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.schedules import build_metadata
from dash_fa3.schedule.validate import ScheduleError, check_metadata


def same_meta(a: M.ScheduleMeta, b: M.ScheduleMeta) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a.header, b.header), (a.offsets, b.offsets), (a.tasks, b.tasks)))


def random_geometry(rng, max_steps=5000):
    while True:
        bm = int(rng.choice([16, 32, 64, 128]))
        bn = int(rng.choice([16, 32, 64, 96, 128]))
        sq = int(rng.integers(1, 1100))
        sk = int(rng.integers(1, 1100)) if rng.random() < 0.5 else sq
        hkv = int(rng.integers(1, 6))
        grp = int(rng.choice([1, 2, 3]))
        b = int(rng.integers(1, 4))
        kind = rng.random()
        if kind < 0.45:
            g = Geometry(b, hkv * grp, hkv, sq, sk, bm, bn, "causal")
        elif kind < 0.8:
            g = Geometry(b, hkv * grp, hkv, sq, sk, bm, bn, "full")
        else:
            left, right = int(rng.integers(-1, 600)), int(rng.integers(0, 300))
            g = Geometry(b, hkv * grp, hkv, sq, sk, bm, bn, "local", left, right)
        if 0 < g.num_steps <= max_steps:
            return g


@pytest.mark.parametrize("chunk", range(4))
def test_random_shapes_same_metadata_and_accepted(chunk):
    """400 random shapes (fixed seeds; causal, full and windows; GQA; batches), every schedule and
    SM count from 1 to 132: the kernel path's metadata is the full build's, and both checks pass."""
    rng = np.random.default_rng(7100 + chunk)
    for _ in range(100):
        g = random_geometry(rng)
        sms = int(rng.choice([132, 114])) if rng.random() < 0.5 else int(rng.integers(1, 40))
        for name in schedules_for(g):
            full = build_schedule(name, g, sms)     # the full validation, on the explicit orders
            meta = build_metadata(name, g, sms)
            assert same_meta(meta, full.meta), (name, g.describe(), sms)
            check_metadata(meta, g, sms)


@pytest.mark.parametrize("label,g", list(grid_geometries(DEFAULT_GRID)), ids=lambda x: x if isinstance(x, str) else "")
def test_bench_grid_kernel_path(label, g):
    for name in SCHEDULES:
        meta = get_kernel_metadata(name, g, 132, "dynamic")
        assert same_meta(meta, build_schedule(name, g, 132).meta), name


def test_static_dispatch_of_queue_schedules_is_certified_by_queue_place():
    """A queue dealt to CTAs by the claim model (the lowering, groups) is certified by each row's
    place in the queue, recovered from the table; a CTA that runs its rows out of queue order is
    refused."""
    g = Geometry(2, 4, 2, 1000, 1000, 64, 128, "causal")
    for name in ("fa3", "spt", "lpt"):
        for sms in (3, 20):
            meta = get_kernel_metadata(name, g, sms, "static")
            assert int(meta.header[M.H_DISPATCH]) == M.DISPATCH_STATIC
            check_metadata(meta, g, sms)
    meta = get_kernel_metadata("fa3", g, 3, "static")
    t = meta.tasks.copy()
    t[meta.offsets[0]:meta.offsets[1]] = t[meta.offsets[0]:meta.offsets[1]][::-1]  # CTA 0 backwards
    with pytest.raises(ScheduleError, match="deadlock risk"):
        check_metadata(M.ScheduleMeta(meta.header, meta.offsets, t), g, 3)


# ---------------------------------------------------------------- what it refuses
def mutated(meta: M.ScheduleMeta, tasks=None, header=None, offsets=None) -> M.ScheduleMeta:
    return M.ScheduleMeta(meta.header.copy() if header is None else header,
                          meta.offsets.copy() if offsets is None else offsets,
                          meta.tasks.copy() if tasks is None else tasks)


G_CAUSAL = Geometry(1, 4, 2, 4096, 4096, 64, 128, "causal")     # 64 q tiles, 32 kv tiles


def test_refuses_a_queue_that_claims_a_later_rank_first():
    """fa3 adds dQ in ascending KV order; a queue with one head's tasks reversed would have a task
    wait on one claimed after it: a deadlock on a GPU of few SMs."""
    meta = build_metadata("fa3", G_CAUSAL, 132)
    t = meta.tasks.copy()
    head0 = np.flatnonzero(t[:, M.C_HEAD] == 0)
    t[head0] = t[head0[::-1]]
    with pytest.raises(ScheduleError, match="deadlock risk"):
        check_metadata(mutated(meta, tasks=t), G_CAUSAL, 132)


def test_refuses_a_static_cta_whose_rows_run_against_the_plan():
    meta = build_metadata("symmetric_shift", G_CAUSAL, 8)   # 4 heads x 16 units on 8 CTAs: 8 waves
    t = meta.tasks.copy()
    off = meta.offsets
    a, b = int(off[3]), int(off[3]) + 2                      # CTA 3's first unit (2 rows) and its next
    t[a:a + 4] = np.concatenate([t[b:b + 2], t[a:b]])
    with pytest.raises(ScheduleError, match="deadlock risk"):
        check_metadata(mutated(meta, tasks=t), G_CAUSAL, 8)


def test_refuses_broken_coverage_and_ranks():
    for name, col, delta, what in (("symmetric_shift", M.C_CYC_OFF, 1, "visited twice|ranks"),
                                   ("symmetric_shift", M.C_SEG_BEGIN, 1, "rank"),
                                   ("shift", M.C_LIN_BASE, -1, "mask does not pair|visited twice"),
                                   ("spt", M.C_LIN_BASE, 1, "mask does not pair")):
        meta = build_metadata(name, G_CAUSAL, 132)
        t = meta.tasks.copy()
        rows = np.flatnonzero((t[:, M.C_HEAD] == 1) & (t[:, M.C_N_STEPS] > 1) & (t[:, M.C_ROLE] == 0))
        t[rows[len(rows) // 2], col] += delta
        with pytest.raises(ScheduleError, match=what):
            check_metadata(mutated(meta, tasks=t), G_CAUSAL, 132)


def test_refuses_bad_rows_and_header():
    meta = build_metadata("spt", G_CAUSAL, 132)
    t = meta.tasks.copy()
    t[5, M.C_KV] = t[6, M.C_KV]
    with pytest.raises(ScheduleError, match="one per"):
        check_metadata(mutated(meta, tasks=t), G_CAUSAL, 132)
    h = meta.header.copy()
    h[M.H_NUM_STEPS] += 1
    with pytest.raises(ScheduleError, match="num_steps"):
        check_metadata(mutated(meta, header=h), G_CAUSAL, 132)
    with pytest.raises(ScheduleError, match="CTAs for 64 SMs"):
        check_metadata(build_metadata("spt", G_CAUSAL, 132), G_CAUSAL, 64)


def test_heads_alike_are_decoded_once(monkeypatch):
    """The decode reads no head index, so heads with alike rows are checked once: a queue
    schedule's 4 heads (all alike) decode as one head's steps."""
    calls = []
    real = M.decode_all
    monkeypatch.setattr(M, "decode_all", lambda h, t: (calls.append(len(t)), real(h, t))[1])
    check_metadata(build_metadata("spt", G_CAUSAL, 132), G_CAUSAL, 132)
    assert sum(calls) == G_CAUSAL.n_kv


def test_dkv_turns_where_the_order_lets_them_come_and_pays():
    """GQA under full and causal masks: every schedule's order lets a group's query heads add
    dK/dV in turns; the kernel metadata asks for them (header dkv_ordered) where the plan is
    static and keeps a group's heads of a KV tile within a wave, or is ``sections`` (a group's
    heads a place apart in its queue) with at least SECTIONS_TURNS_MIN_Q_TILES Q tiles, never
    for MHA or windows, nor for ``groups`` and ``grouped_*``, whose whole-group rows store dK/dV (no turns); a
    table whose head h + 1 would finish a KV tile before head h is refused when flagged."""
    from dash_fa3.schedule.validate import SECTIONS_TURNS_MIN_Q_TILES, dkv_order_ok, dkv_order_pays, with_dkv_order

    for name in SCHEDULES:
        meta = get_kernel_metadata(name, G_CAUSAL, 132, "dynamic")
        assert dkv_order_ok(meta, G_CAUSAL, 132), name
        static = int(meta.header[M.H_DISPATCH]) == M.DISPATCH_STATIC
        sections = name == "sections" and G_CAUSAL.n_q >= SECTIONS_TURNS_MIN_Q_TILES
        whole = int(meta.header[M.H_DKV_CHAINED]) == M.DKV_CHAINED_WHOLE
        assert whole == (name == "groups" or name.startswith("grouped_")), name
        assert int(meta.header[M.H_DKV_ORDERED]) == int((static or sections) and not whole), name
        check_metadata(meta, G_CAUSAL, 132)
    # 256 KV tiles per head on 132 CTAs: a group's heads of a KV tile two waves apart
    far = Geometry(1, 8, 2, 2048, 32768, 64, 128, "causal")
    assert not dkv_order_pays(build_metadata("split", far, 132), far, 132)
    assert int(get_kernel_metadata("split", far, 132).header[M.H_DKV_ORDERED]) == 0
    mha = Geometry(1, 4, 4, 4096, 4096, 64, 128, "causal")
    local = Geometry(1, 4, 2, 4096, 4096, 64, 128, "local", 256, 0)
    for g in (mha, local):
        assert int(get_kernel_metadata("symmetric_shift", g, 132).header[M.H_DKV_ORDERED]) == 0
        assert not dkv_order_ok(build_metadata("symmetric_shift", g, 132), g, 132)
    meta = get_kernel_metadata("fa3", G_CAUSAL, 132, "dynamic")
    t = meta.tasks.copy()
    first = lambda h: int(np.flatnonzero((t[:, M.C_HEAD] == h) & (t[:, M.C_KV] == 3))[0])  # noqa: E731
    a, b = first(0), first(1)                     # head 1 of KV head 0 claimed before head 0, at KV tile 3
    t[[a, b]] = t[[b, a]]
    flagged = meta.header.copy()
    flagged[M.H_DKV_ORDERED] = 1
    check_metadata(mutated(meta, header=flagged), G_CAUSAL, 132)   # the queue's own order: accepted
    bad = mutated(meta, tasks=t, header=flagged)
    assert not dkv_order_ok(bad, G_CAUSAL, 132)
    with pytest.raises(ScheduleError, match="dkv_ordered"):
        check_metadata(bad, G_CAUSAL, 132)
    assert int(with_dkv_order(bad, G_CAUSAL, 132).header[M.H_DKV_ORDERED]) == 0
    h = meta.header.copy()
    h[M.H_DKV_ORDERED] = 2
    with pytest.raises(ScheduleError, match="dkv_ordered"):
        check_metadata(mutated(meta, header=h), G_CAUSAL, 132)
