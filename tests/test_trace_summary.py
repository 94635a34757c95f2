"""benchmarks/trace_summary.py on synthetic traces with known timings (CPU).

The trace is built from a schedule as the kernel would record it: per-SM
clocks with their own offsets against a coarse global timer, steps of a known
length, writers whose acquire follows the predecessor's release after a known
hand-off latency. The summary must recover those numbers.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from dash_fa3.schedule.geometry import Geometry
from dash_fa3.schedule.lowering import lower_to_static
from dash_fa3.schedule.schedules import get_schedule

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "benchmarks" / "trace_summary.py")
ts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ts)

GHZ = 1.6          # clock64 ticks per ns
TIMER_NS = 32      # %globaltimer granularity (an H100's)
STEP_US, GAP_US, JITTER_US = 2.0, 3.0, 1.0
WAIT_AFTER_US, LATENCY_US, ADD_US, CHAIN_US = 1.0, 0.45, 0.3, 1.2


def synthetic(tmp_path: Path, name: str, det: bool, num_sms: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    g = Geometry.from_shape(batch=2, heads=3, heads_kv=3, seqlen_q=1280, seqlen_k=1280, headdim=128, causal=False)
    s = lower_to_static(get_schedule(name, g, num_sms), validate=False)
    T, n_q = s.num_tasks, g.n_q
    tasks = np.zeros((T, 8), np.int64)
    steps = np.zeros((T, n_q, 16), np.int64)
    sm_of_cta = rng.permutation(200)[:s.num_ctas]
    clk_off = rng.integers(10**9, 10**10, size=200)  # each SM's clock64 at global time 0 (ticks)

    def clk(sm, t_us):
        return np.int64(round(t_us * 1e3 * GHZ)) + clk_off[sm]

    def ns(t_us):
        return np.int64(t_us * 1e3 // TIMER_NS * TIMER_NS) + 5 * 10**9

    begin = np.zeros(T)
    step_start = np.zeros(s.num_steps)
    for cta in range(s.num_ctas):
        t = 0.0
        for task in s.cta_tasks(cta):
            t += rng.uniform(0, 1)  # events fall anywhere between the timer's ticks, as on the GPU
            begin[task] = t
            a, b = s.step_offsets[task], s.step_offsets[task + 1]
            # Jitter: each step starts up to JITTER_US late.
            step_start[a:b] = t + STEP_US * np.arange(b - a) + rng.uniform(0, JITTER_US, b - a)
            t += STEP_US * (b - a) + GAP_US
    end = begin + STEP_US * s.task_steps + JITTER_US + 0.5
    # Writers, contributions in rank order so that each predecessor is known first.
    acq = np.zeros(s.num_steps)
    rel = np.zeros(s.num_steps)
    wait = step_start + WAIT_AFTER_US
    tile, rank = s.step_dq_tile, s.step_rank
    last_rel = {}
    pred_rel = np.full(s.num_steps, np.nan)
    for i in np.lexsort((rank, tile)):
        prev = last_rel.get(int(tile[i]))
        if prev is not None:
            pred_rel[i] = prev
        acq[i] = wait[i] if (not det or prev is None) else max(wait[i], prev + LATENCY_US)
        rel[i] = acq[i] + CHAIN_US
        last_rel[int(tile[i])] = rel[i]
    for task in range(T):
        sm = sm_of_cta[s.task_cta[task]]
        tasks[task] = [s.task_cta[task], sm, clk(sm, begin[task]), ns(begin[task]), clk(sm, end[task]),
                       ns(end[task]), 0, 0]
        for k in range(s.task_steps[task]):
            i = s.step_offsets[task] + k
            r = steps[task, k]
            r[ts.M_STEP], r[ts.M_STEP_NS] = clk(sm, step_start[i]), ns(step_start[i])
            r[ts.W_WAIT], r[ts.W_WAIT_NS] = clk(sm, wait[i]), ns(wait[i])
            r[ts.W_ISSUED] = clk(sm, acq[i] + 0.1)
            r[ts.W_READ] = clk(sm, acq[i] + 0.1 + ADD_US)
            r[ts.M_Q_WAIT], r[ts.M_DO_WAIT] = round(50 * GHZ), round(20 * GHZ)  # cycles: 0.05 and 0.02 us
            for wg in range(2):
                r[ts.M_EMPTY_WAIT + 2 * wg] = clk(sm, step_start[i] + 1.5)
                r[ts.M_EMPTY_DONE + 2 * wg] = clk(sm, step_start[i] + 1.5 + 0.1 * (wg + 1))
            if det:
                r[ts.W_ACQ], r[ts.W_ACQ_NS] = clk(sm, acq[i]), ns(acq[i])
                r[ts.W_REL], r[ts.W_REL_NS] = clk(sm, rel[i]), ns(rel[i])
                r[ts.W_ISSUED] = clk(sm, acq[i] + 0.1)
    tag = f"{name}_{'det' if det else 'nd'}"
    tasks.tofile(tmp_path / f"{tag}.tasks.bin")
    steps.tofile(tmp_path / f"{tag}.steps.bin")
    fields = [tag, name, "det" if det else "nd", 128, 0, 2, 3, 3, 1280, 1280, T, n_q, 16, 8, num_sms, 1.0, 1.01]
    with open(tmp_path / "index.tsv", "a") as f:
        f.write("\t".join(map(str, fields)) + "\n")
    return {"begin": begin, "end": end, "acq": acq, "wait": wait, "pred_rel": pred_rel, "s": s}


@pytest.mark.parametrize("name", ["shift", "fa3"])
def test_summary_recovers_known_timings(tmp_path, name):
    truth = synthetic(tmp_path, name, det=True)
    nd = synthetic(tmp_path, name, det=False, seed=1)
    runs = ts.read_index(tmp_path)
    det_row, nd_row = (ts.summarize(tmp_path, r) for r in runs)
    for row in (det_row, nd_row):
        assert row["ghz"] == pytest.approx(GHZ, rel=1e-3)
        # Start-to-start: STEP_US plus the difference of two uniform jitters (triangular).
        spread = JITTER_US * (1 - np.sqrt(0.2))
        assert row["step_us"][0] == pytest.approx(STEP_US, abs=0.03)
        assert row["step_us"][1] == pytest.approx(STEP_US - spread, abs=0.03)
        assert row["step_us"][2] == pytest.approx(STEP_US + spread, abs=0.03)
        assert row["add_us"] == pytest.approx(ADD_US, abs=0.01)
        assert row["compute_us"][0] == pytest.approx(1.5, abs=0.01)  # step start to the dq_empty wait
        # wg 0 waits 0.1 us, wg 1 0.2 us per step.
        task_time = float((truth["end"] - truth["begin"]).sum()) if row is det_row else None
        if task_time:
            expect = 0.15 * truth["s"].num_steps / task_time
            assert row["mma_wait_share"] == pytest.approx(expect, rel=0.02)
            assert row["load_wait_share"] == pytest.approx(0.07 * truth["s"].num_steps / task_time, rel=0.02)
    assert det_row["chain_us"] == pytest.approx(CHAIN_US - 0.1, abs=0.01)
    # Every blocked writer acquired LATENCY_US after its predecessor's release.
    # (shift spaces a Q tile's contributions two steps apart here: none waits.)
    p50, p10, p90, n = det_row["handoff_us"]
    blocked = int(np.sum(truth["wait"] < truth["pred_rel"]))  # NaN (rank 0) compares False
    assert abs(n - blocked) <= max(2, 0.02 * blocked) and (blocked > 0) == (name == "fa3")  # ties within a tick
    if blocked:
        assert p10 == pytest.approx(LATENCY_US, abs=0.03) and p90 == pytest.approx(LATENCY_US, abs=0.03)
    has_pred = ~np.isnan(truth["pred_rel"])
    assert det_row["blocked_share"] == pytest.approx(blocked / has_pred.sum(), abs=0.02)
    free = ~(truth["wait"] < truth["pred_rel"])
    poll = (truth["acq"] - truth["wait"])[free]  # a release landing just after the ask still costs its latency
    assert det_row["poll_us"][0] == pytest.approx(np.percentile(poll, 50), abs=0.05)  # 32-ns ticks
    assert det_row["poll_us"][1] == pytest.approx(np.percentile(poll, 90), abs=0.05)
    assert "handoff_us" not in nd_row
    makespan = float(truth["end"].max() - truth["begin"].min())
    assert det_row["makespan_us"] == pytest.approx(makespan, abs=0.05)
