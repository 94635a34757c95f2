"""Schedule semantics on small readable cases, refusals, caching."""

import numpy as np
import pytest

from dash_fa3.schedule import (SCHEDULES, Geometry, ScheduleError, build_schedule, get_metadata, get_schedule,
                               resolve_schedule_name, simulate, unit_model, CostModel)
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.schedules import LPT_SECTION_ROWS, claim_loads, lpt_order
from dash_fa3.schedule.schedules import Schedule
from dash_fa3.schedule.validate import check_deadlock_free, check_structure


def orders(s):
    return {(int(s.task_head[t]), int(s.task_kv[t])): s.visiting_order(t).tolist() for t in range(s.num_tasks)}


def test_fa3_spt_descending_orders_and_ranks():
    g = Geometry.model(4, 1, "causal")
    fa3 = build_schedule("fa3", g, 4)
    assert fa3.dynamic and fa3.task_kv.tolist() == [0, 1, 2, 3]
    assert orders(fa3)[(0, 1)] == [1, 2, 3]
    assert fa3.accumulation_order(0, 0, 3).tolist() == [0, 1, 2, 3]
    spt = build_schedule("spt", g, 4)
    assert spt.task_kv.tolist() == [3, 2, 1, 0]            # shortest first
    assert orders(spt)[(0, 1)] == [1, 2, 3]
    assert spt.accumulation_order(0, 0, 3).tolist() == [3, 2, 1, 0]
    desc = build_schedule("descending", g, 4)
    assert desc.task_kv.tolist() == [0, 1, 2, 3]
    assert orders(desc)[(0, 1)] == [3, 2, 1]
    assert desc.accumulation_order(0, 0, 2).tolist() == [0, 1, 2]


def test_shift_is_cyclic_and_collision_free():
    n = 5
    g = Geometry.model(n, 3, "full")
    s = build_schedule("shift", g, n)
    assert not s.dynamic and s.num_ctas == n
    for t in range(s.num_tasks):
        kv = int(s.task_kv[t])
        assert s.visiting_order(t).tolist() == [(kv + k) % n for k in range(n)]
        assert int(s.task_cta[t]) == kv                      # head h is wave h, KV tile i on CTA i
    # rank = step at which the tile reaches q = (q - kv) mod n
    for q in range(n):
        assert s.accumulation_order(0, 1, q).tolist() == [(q - k) % n for k in range(n)]
    assert s.validate().collisions == 0


def test_symmetric_shift_paper_layout():
    n = 8
    g = Geometry.model(n, 2, "causal")
    s = build_schedule("symmetric_shift", g, n)
    assert s.num_ctas == n
    # CTA p runs KV tile p then KV tile n-1-p (head 0 on CTAs 0..3, head 1 on 4..7)
    for cta in range(n):
        tasks = s.cta_tasks(cta)
        p = cta % (n // 2)
        assert s.task_kv[tasks].tolist() == [p, n - 1 - p]
        lo, hi = (s.visiting_order(t).tolist() for t in tasks)
        # stage 1: cyclic shift over the dense rectangle [n/2, n); stage 2: the rest ascending
        assert lo == [n // 2 + (p + k) % (n // 2) for k in range(n // 2)] + list(range(p, n // 2))
        # folded lower-right triangle: descending
        assert hi == list(range(n - 1, n - 2 - p, -1))
        # level work: n + 1 steps per CTA
        assert len(lo) + len(hi) == n + 1
    assert s.validate().collisions == 0


def test_symmetric_shift_on_full_is_shift():
    g = Geometry.model(6, 2, "full")
    a, b = build_schedule("shift", g, 6), build_schedule("symmetric_shift", g, 6)
    assert np.array_equal(a.step_q, b.step_q) and np.array_equal(a.step_rank, b.step_rank)
    assert np.array_equal(a.meta.tasks, b.meta.tasks)


def test_shift_generalizes_to_causal():
    g = Geometry.model(6, 2, "causal")
    s = build_schedule("shift", g, 6)   # valid (rectangle shift + ascending rest), not balanced
    rep = s.validate()
    # the rectangle is the last Q tile only: all six tiles meet it at step 0 (two heads)
    assert rep.collisions == 2 * 5
    assert all(s.visiting_order(t).tolist() == [5] + list(range(int(s.task_kv[t]), 5))
               for t in range(s.num_tasks))


def test_auto_rule():
    assert resolve_schedule_name("auto", Geometry.model(8, 1, "full")) == "shift"
    assert resolve_schedule_name("auto", Geometry.model(3, 1, "full")) == "split"  # below shift's KV tiles
    assert resolve_schedule_name("auto", Geometry.model(4, 1, "full")) == "shift"  # square tiles from 4
    assert resolve_schedule_name("auto", Geometry.model(4, 1, "causal")) == "spt"
    assert get_schedule("auto", Geometry.model(4, 1, "causal"), 4).name == "spt"
    full64 = dict(batch=1, heads=32, headdim=64, causal=False)
    # head dim 64's square tiles: sections from 16 to 96 KV tiles, shift outside them up to 127
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=8192, **full64)) == "sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=12288, **full64)) == "sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=12416, **full64)) == "shift"  # 97
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=16384, **full64)) == "fa3"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1920, **full64)) == "shift"  # 15
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2048, **full64)) == "sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=512, **full64)) == "shift"
    # The shift orders only where seqlen_k <= seqlen_q; from 2 keys per query on, sections.
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, seqlen_k=6144, **full64)) == "fa3"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2048, seqlen_k=6144, **full64)) == "sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=6144, seqlen_k=1920, **full64)) == "shift"
    causal128 = dict(batch=1, heads=16, headdim=128, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2048, **(causal128 | dict(batch=8)))) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, **causal128)) == "symmetric_shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=16384, **causal128)) == "symmetric_shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, seqlen_k=6144, **causal128)) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, seqlen_k=8192, **causal128)) == "sections"
    # few Q tiles per head: under GQA grouped_sections with a power-of-two group, else runs (its
    # chains add a group's dK/dV once); sections without GQA
    gqa = dict(batch=8, heads=16, heads_kv=2, headdim=128, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=256, seqlen_k=8192, **gqa)) == "grouped_sections"
    gqa3 = dict(batch=8, heads=12, heads_kv=4, headdim=128, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=256, seqlen_k=8192, **gqa3)) == "runs"
    # up to 64 Q tiles per head; grouped_split where an L2 section of the view holds at most 2 KV
    # heads (here 2), else grouped_sections (at 32 Q tiles, 4); past 64, sections
    big = dict(batch=1, heads=32, heads_kv=8, headdim=128, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, seqlen_k=65536, **big)) == "grouped_split"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2048, seqlen_k=32768, **big)) == "grouped_sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4160, seqlen_k=65536, **big)) == "sections"
    mqa = dict(batch=2, heads=32, heads_kv=1, headdim=128, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1024, seqlen_k=16384, **mqa)) == "grouped_split"
    mha64 = dict(batch=4, heads=16, headdim=64, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=512, seqlen_k=4096, **mha64)) == "sections"
    # square GQA with a power-of-two group: grouped_split for a full mask up to 64 Q tiles per head,
    # grouped_sections for a causal one up to 40 Q tiles per group; both only where the grouped
    # view's tasks fill a wave of the SMs, and a full one with keys within the queries only where
    # they fill their waves 80% on average; past those, the MHA rule
    sq_gqa = dict(batch=4, heads=16, heads_kv=4, headdim=64)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, **sq_gqa)) == "grouped_split"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=8192, **sq_gqa)) == "grouped_split"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=9216, **sq_gqa)) == "sections"  # the MHA rule
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1024, **sq_gqa)) == "shift"  # 32 tasks
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1024, **sq_gqa), num_sms=32) == "grouped_split"
    sq_gqa_c = sq_gqa | dict(batch=16, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=512, **sq_gqa_c)) == "grouped_sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1280, **sq_gqa_c)) == "grouped_sections"  # 40
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1408, **sq_gqa_c)) == "spt"  # 44
    # 6 x 2 x 16 = 192 tasks on 132 SMs fill their 2 waves 73%; 256 fill 97%
    g8 = dict(heads=16, heads_kv=2, headdim=64, seqlen_q=2048)
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=6, **g8)) == "sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=8, **g8)) == "grouped_split"
    # a group of 5 has no grouped view: groups for a full mask on 64 x 128 tiles up to 40 Q tiles per head
    g5 = dict(batch=6, heads=20, heads_kv=4, headdim=128)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2560, **g5)) == "groups"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2624, **g5)) == "shift"  # 41
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2560, causal=True, **g5)) == "spt"  # not groups
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=512, **(sq_gqa_c | dict(batch=4)))) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, heads=15, heads_kv=5, headdim=64,
                                                              batch=4)) == "sections"  # a group of 3
    # causal tasks of a few waves, from 16 KV tiles at every tile shape but head dim 96's:
    # sections under 3 waves up to 48 KV tiles, symmetric_shift up to 6 waves
    few = dict(heads=8, headdim=64, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=4, seqlen_q=2048, **few)) == "symmetric_shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=2, seqlen_q=2048, **few)) == "sections"
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=2, seqlen_q=1920, **few)) == "spt"   # 15 KV tiles
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=4, seqlen_q=1920, **few)) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=8, seqlen_q=2048, **few)) == "spt"   # 7.8 waves
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=4, seqlen_q=2048, **few), num_sms=64) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=2, seqlen_q=2048, **few),
                                 num_sms=64) == "symmetric_shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=1, heads=4, seqlen_q=6144, headdim=128,
                                                              causal=True)) == "sections"  # 48 KV tiles
    assert resolve_schedule_name("auto", Geometry.from_shape(batch=1, heads=4, seqlen_q=8192, headdim=128,
                                                              causal=True)) == "symmetric_shift"  # 64
    few128 = dict(batch=2, heads=16, headdim=128, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, seqlen_k=2048, **few128)) == "symmetric_shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, seqlen_k=2048, **few128),
                                 headdim=96) == "spt"
    # head dim 96 shares head dim 128's tiles; the op passes headdim, and causal masks get spt there
    causal96 = dict(batch=1, heads=21, headdim=96, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=8192, **causal96), headdim=96) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=8192, **causal96), headdim=128) == "symmetric_shift"
    causal64 = dict(batch=1, heads=32, headdim=64, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=2048, **(causal64 | dict(batch=8)))) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, **causal64)) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=7168, **causal64)) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=8192, **causal64)) == "spt"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=16384, **causal64)) == "spt"
    # the head-dim-split kernels' 64 x 64 tiles (head dims 192, 256): spt for causal masks
    causal256 = dict(batch=1, heads=8, headdim=256, causal=True)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=16384, **causal256)) == "spt"
    full256 = dict(batch=1, heads=8, headdim=256, causal=False)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, **full256)) == "shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=8192, **full256)) == "shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=16384, **full256)) == "fa3"
    # head dim 192's 64 x 96 tiles (three warpgroups; MLA's too): spt for causal masks, shift for
    # full ones through 16k tokens (171 KV tiles)
    causal192 = dict(batch=1, heads=10, headdim=192, causal=True)
    for seqlen in (2048, 4096, 16384):
        assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=seqlen, **causal192)) == "spt"
    full192 = dict(batch=1, heads=10, headdim=192, causal=False)
    for seqlen in (512, 8192, 16384):
        assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=seqlen, **full192)) == "shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=32768, **full192)) == "fa3"
    full128 = dict(batch=1, heads=16, headdim=128, causal=False)
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=1024, **full128)) == "shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=4096, **full128)) == "shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=16384, **full128)) == "shift"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=32768, **full128)) == "fa3"
    assert resolve_schedule_name("auto", Geometry.from_shape(seqlen_q=512, **full128)) == "split"  # 4 KV tiles, below shift's 5
    with pytest.raises(ValueError, match="unknown schedule"):
        resolve_schedule_name("nope", Geometry.model(4, 1))
    # Non-deterministic without GQA: the best-balanced task order, whatever the mask (GQA:
    # tests/test_schedule_groups.py).
    for g in (Geometry.from_shape(seqlen_q=4096, **causal128), Geometry.from_shape(seqlen_q=4096, **full128),
              Geometry.model(8, 1, "full")):
        assert resolve_schedule_name("auto", g, deterministic=False) == "lpt"
        assert resolve_schedule_name("spt", g, deterministic=False) == "spt"


def test_lpt_is_fa3_on_a_full_mask_and_longest_first_on_a_causal_one():
    full = Geometry.from_shape(batch=2, heads=8, headdim=128, seqlen_q=2048, causal=False)
    a, b = get_schedule("lpt", full, 132), get_schedule("fa3", full, 132)
    assert np.array_equal(a.meta.tasks[:, :M.C_CTA], b.meta.tasks[:, :M.C_CTA])
    causal = Geometry.from_shape(batch=2, heads=16, headdim=128, seqlen_q=8192, causal=True)
    s = get_schedule("lpt", causal, 132)
    fa3 = get_schedule("fa3", causal, 132)
    hidx = fa3.task_batch * causal.heads + fa3.task_head
    _, per = lpt_order(causal, hidx, fa3.task_kv, 132)
    assert 1 <= per <= LPT_SECTION_ROWS // (2 * 8192)
    section = (s.task_batch * causal.heads + s.task_head) // per
    assert np.all(np.diff(section) >= 0)
    for sec in np.unique(section):
        assert np.all(np.diff(s.task_steps[section == sec]) <= 0)


@pytest.mark.parametrize("seqlen", [1024, 2048, 8192, 16384])
def test_lpt_levels_the_causal_loads(seqlen):
    """Under the lowering's cost model, lpt leaves the busiest CTA within 2% of
    the mean on the bench grid's causal shapes, where spt's shortest-first
    queue leaves 7-8% (the tail of long tasks)."""
    g = Geometry.from_shape(batch=16384 // seqlen, heads=16, headdim=128, seqlen_q=seqlen, causal=True)

    def imbalance(name):
        load = claim_loads(get_schedule(name, g, 132).task_steps, 132)
        return load.max() / load.mean()

    assert imbalance("lpt") <= 1.02
    assert imbalance("spt") >= 1.05


def test_cache_and_sm_count():
    g = Geometry.from_shape(batch=2, heads=16, seqlen_q=2048, headdim=128, causal=True)
    a = get_schedule("symmetric_shift", g, 132)
    b = get_schedule("symmetric_shift", Geometry.from_shape(batch=2, heads=16, seqlen_q=2048, headdim=128,
                                                            causal=True), 132)
    assert a is b and hash(a) == hash(b)
    c = get_schedule("symmetric_shift", g, 114)
    assert c is not a and c.num_ctas == 114 and a.num_ctas == 132
    assert int(a.meta.header[5]) == 132 and int(c.meta.header[5]) == 114
    with pytest.raises(ValueError):
        get_schedule("shift", g, 0)
    meta = get_metadata("auto", g, 132)
    assert meta is get_metadata(resolve_schedule_name("auto", g), g, 132)
    assert np.array_equal(meta.tasks, get_schedule(resolve_schedule_name("auto", g), g, 132).meta.tasks)


@pytest.mark.parametrize("heads_kv", [2, 1])  # groups of 4 q heads, MQA
# runs and sections order a group's heads for the dK/dV turns, groups chains them, grouped_* make
# a row of each group: their GQA rows
# differ from MHA's by design (tests/test_schedule_runs.py, tests/test_schedule_split.py,
# tests/test_schedule_groups.py)
@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in ("runs", "sections", "groups")
                                  and not n.startswith("grouped_")])
def test_gqa_epilogue_waits_for_nothing(name, heads_kv):
    """Each q head stores its own dK/dV partials (the postprocess sums a group),
    so GQA adds no wait: the schedule and its simulated timeline are those of
    MHA with as many kv heads as q heads, and every epilogue starts as soon as
    its task's last reduce ends."""
    gqa = Geometry(2, 8, heads_kv, 256, 256, 64, 64, "causal")
    mha = Geometry(2, 8, 8, 256, 256, 64, 64, "causal")
    s, ref = build_schedule(name, gqa, 7), build_schedule(name, mha, 7)
    assert np.array_equal(s.meta.tasks[:, M.C_HEAD_KV], s.task_head // (8 // heads_kv))
    for pipeline in ("serial", "writer"):
        costs = CostModel(1, 1, latency=0.3, epilogue=0.5, pipeline=pipeline)
        sim, sim_ref = simulate(s, costs), simulate(ref, costs)
        assert sim.makespan == sim_ref.makespan and sim.waits == sim_ref.waits
        assert np.array_equal(sim.epilogue_start, sim_ref.epilogue_start)
        # serial: after the last reduce; writer (the kernel): once the MMA warps
        # handed the last partial dQ over, not waiting for its add
        last = s.step_offsets[1:] - 1
        done = sim.step_end if pipeline == "serial" else sim.step_handoff
        assert np.array_equal(sim.epilogue_start, done[last])
    assert unit_model(s) == unit_model(ref)


# ------------------------------------------------------------------ refusals
def clone(s, **kw):
    fields = dict(name=s.name, geometry=s.geometry, num_sms=s.num_sms, dispatch=s.dispatch,
                  num_ctas=s.num_ctas, task_batch=s.task_batch, task_head=s.task_head, task_kv=s.task_kv,
                  task_cta=s.task_cta, task_unit=s.task_unit,
                  step_offsets=s.step_offsets, step_q=s.step_q, step_rank=s.step_rank,
                  step_wave=s.step_wave, step_time=s.step_time, meta=s.meta)
    fields.update(kw)
    return Schedule(**fields)


def test_refuses_double_visit():
    s = build_schedule("fa3", Geometry.model(3, 1, "full"), 3)
    q = s.step_q.copy()
    q[1] = q[0]
    with pytest.raises(ScheduleError, match="visited twice"):
        clone(s, step_q=q).validate()


def test_refuses_masked_visit():
    s = build_schedule("fa3", Geometry.model(3, 1, "causal"), 3)
    q = s.step_q.copy()
    t = s.find_task(0, 0, 2)
    q[s.step_offsets[t]] = 0
    with pytest.raises(ScheduleError, match="does not need"):
        clone(s, step_q=q).validate()


def test_refuses_bad_rank_permutation():
    s = build_schedule("shift", Geometry.model(3, 1, "full"), 3)
    r = s.step_rank.copy()
    r[0] = 7
    with pytest.raises(ScheduleError, match="not a permutation"):
        clone(s, step_rank=r).validate()


def test_refuses_metadata_mismatch():
    s = build_schedule("symmetric_shift", Geometry.model(6, 2, "causal"), 6)
    r = s.step_rank.copy()
    t = s.step_task == 0
    r[t] = r[t][::-1] if t.sum() > 1 else r[t]
    # still a permutation per tile? make one by swapping two contributions of one dQ tile
    gid = s.step_dq_tile
    a, b = np.flatnonzero(gid == gid[0])[:2]
    r = s.step_rank.copy()
    r[a], r[b] = r[b], r[a]
    with pytest.raises(ScheduleError, match="metadata decodes"):
        clone(s, step_rank=r).validate()


def test_refuses_static_deadlock():
    # shift, 2 KV tiles x 2 Q tiles on 2 CTAs: tile 0 visits q0,q1; tile 1 visits q1,q0.
    s = build_schedule("shift", Geometry.model(2, 1, "full"), 2)
    bad = clone(s, step_rank=1 - s.step_rank)   # later contribution first on both tiles: a cycle
    check_structure(clone(s))                    # sanity
    with pytest.raises(ScheduleError, match="deadlock"):
        check_deadlock_free(bad)


def test_refuses_static_deadlock_behind_waiting_task():
    # one CTA runs both tiles; ranks make the first task wait for the second
    g = Geometry.model(2, 1, "full")
    s = build_schedule("shift", g, 1)
    assert s.num_ctas == 1
    with pytest.raises(ScheduleError, match="deadlock"):
        check_deadlock_free(clone(s, step_rank=1 - s.step_rank))


def test_refuses_dynamic_wait_on_later_task():
    s = build_schedule("fa3", Geometry.model(3, 1, "full"), 3)
    bad = clone(s, step_rank=2 - s.step_rank)     # descending kv ranks, ascending queue
    with pytest.raises(ScheduleError, match="claimed later"):
        check_deadlock_free(bad)


def test_refuses_too_many_ctas():
    s = build_schedule("shift", Geometry.model(4, 1, "full"), 4)
    with pytest.raises(ScheduleError, match="persistent grid"):
        clone(s, num_sms=2).validate()


def _rect_gaps(s, width):
    """Steps between consecutive contributions to each rectangle tile, per (head, wave) segment."""
    gaps = []
    rect = int(s.meta.header[M.H_RECT_BEGIN])
    for key in set(zip(s.task_head_index.tolist(), s.meta.tasks[:, M.C_SEG_BEGIN].tolist())):
        rows = [t for t in range(s.num_tasks) if (int(s.task_head_index[t]), int(s.meta.tasks[t, M.C_SEG_BEGIN])) == key
                and int(s.meta.tasks[t, M.C_ROLE]) == M.ROLE_LO]
        for q in range(rect, rect + width):
            steps = sorted(int(np.flatnonzero(s.visiting_order(t) == q)[0]) for t in rows)
            gaps += np.diff(steps).tolist()
    return gaps


@pytest.mark.parametrize("name,causal", [("shift", False), ("symmetric_shift", True)])
def test_cyclic_legs_keep_a_tiles_contributions_apart(name, causal):
    # 64-row Q tiles against 128-row KV tiles: the rectangle is twice as wide as a
    # head's units, so consecutive slots start two tiles apart and every rectangle
    # tile's consecutive contributions (of one wave) come two steps apart, not one.
    g = Geometry.from_shape(batch=1, heads=3, seqlen_q=2048, headdim=128, causal=causal)
    s = build_schedule(name, g, 40)   # 40 CTAs: some heads' units straddle two waves
    header = s.meta.header
    units, rect = int(header[M.H_UNITS_PER_HEAD]), int(header[M.H_RECT_BEGIN])
    width = g.n_q - rect
    assert int(header[M.H_CYC_STRIDE_LOG2]) == 1 and 2 * units <= width
    lo = s.meta.tasks[:, M.C_ROLE] == M.ROLE_LO
    slot = s.meta.tasks[:, M.C_UNIT] - s.meta.tasks[:, M.C_SEG_BEGIN]
    assert np.array_equal(s.meta.tasks[lo, M.C_CYC_OFF], (2 * slot[lo]) % width)
    gaps = _rect_gaps(s, width)
    assert gaps and min(gaps) == 2
    assert s.validate().collisions == 0   # and the decoded ranks match the planned-time order


def test_square_tiles_keep_the_papers_shift():
    # Square tiles (d = 64): no room, stride 1, the paper's consecutive shift.
    g = Geometry.from_shape(batch=1, heads=3, seqlen_q=2048, headdim=64, causal=False)
    s = build_schedule("shift", g, 40)
    assert int(s.meta.header[M.H_CYC_STRIDE_LOG2]) == 0
    slot = s.meta.tasks[:, M.C_UNIT] - s.meta.tasks[:, M.C_SEG_BEGIN]
    assert np.array_equal(s.meta.tasks[:, M.C_CYC_OFF], slot % g.n_q)
    assert min(_rect_gaps(s, g.n_q)) == 1


@pytest.mark.parametrize("seqlen_q,seqlen_k,expect", [(8192, 2048, 3), (5000, 1200, 2), (1050, 1050, 0)])
def test_cyc_stride_is_the_largest_power_of_two_that_fits(seqlen_q, seqlen_k, expect):
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=128, causal=False)
    s = build_schedule("shift", g, 132)
    k = 1 << int(s.meta.header[M.H_CYC_STRIDE_LOG2])
    assert int(s.meta.header[M.H_CYC_STRIDE_LOG2]) == expect
    assert k * g.n_kv <= g.n_q < 2 * k * g.n_kv
    s.validate()


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_report_collisions_are_the_unit_models(mask):
    """A static schedule's report counts its unit-cost collisions from the deadlock check's graph; the
    research model's simulation counts the same ones. A dynamic schedule's depend on the claim order,
    which only the model knows: its report refuses to guess."""
    g = Geometry.model(6, 3, mask)
    for name in ("shift", "symmetric_shift"):
        s = build_schedule(name, g, 5)
        rep = s.validate()
        assert (rep.collisions, rep.unit_makespan) == unit_model(s)
    dyn = build_schedule("fa3", g, 5)
    assert unit_model(dyn)[0] > 0
    with pytest.raises(ValueError, match="dispatched dynamically"):
        dyn.validate().collisions
