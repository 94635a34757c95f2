"""The calibrated simulator (dash_fa3/schedule/model/calibration.py): the
measured grid it was fitted to, the fitted H100 costs, predictions against
the measurements on the cheap grid points, the ranking metrics, the fit
itself on a synthetic grid, and the opt-in ``auto`` from the model."""

import json
import math

import pytest

from dash_fa3.schedule import Geometry, resolve_schedule_name
from dash_fa3.schedule import schedules as S
from dash_fa3.schedule.model import calibration as C
from dash_fa3.schedule.model.cli import main


def test_measured_grid():
    g = C.H100_B064A4D
    assert g.commit == "b064a4d" and g.date == "2026-11-23" and "H100" in g.device and g.num_sms == 132
    assert len(g.rows) == 24 and all(len(r[3]) == len(C.COLUMNS) for r in g.rows)
    pts = list(g.points())
    assert len(pts) == 24 * 7 and all(p[4] > 0 for p in pts)
    # ms back to the table's TFLOP/s: hdim 64 full 16k, ours nd 525
    ms = next(p[4] for p in pts if p[:4] == (64, "full", 16384, "nd"))
    assert math.isclose(g.flops(64, "full", 16384) / (ms * 1e-3) / 1e12, 525.0)
    geo = g.geometry(128, "causal", 4096)
    assert (geo.batch, geo.heads, geo.block_m, geo.block_n) == (4, 16, 64, 128)


def test_h100_costs_are_documented():
    cal = C.H100
    assert "b064a4d" in cal.data and "2026-11-23" in cal.data and cal.num_sms == 132
    assert set(cal.headdims) == {64, 128}
    for hc in cal.headdims.values():
        assert all(v >= 0 for v in vars(hc).values())
        assert hc.read <= hc.reduce and 0 < hc.handoff_at <= 1
    json.dumps(cal.to_dict())


def test_costs_of_uncalibrated_headdims():
    """96 and 256 borrow 128's costs, scaled by the tile's MMA work and dQ bytes."""
    cal = C.H100
    g96 = Geometry.from_shape(batch=1, heads=4, seqlen_q=1024, headdim=96)
    hc = cal.costs_for(96, g96)
    assert math.isclose(hc.compute, cal.headdims[128].compute * 0.75)
    assert math.isclose(hc.reduce, cal.headdims[128].reduce * 0.75)
    g256 = Geometry.from_shape(batch=1, heads=4, seqlen_q=1024, headdim=256)  # 64 x 64 tiles
    assert math.isclose(cal.costs_for(256, g256).compute, cal.headdims[128].compute)
    assert C.headdim_of(g96) == 96 and C.headdim_of(Geometry.from_shape(batch=1, heads=1, seqlen_q=64,
                                                                         headdim=64)) == 64


def test_predictions_on_the_small_grid_points():
    """The shipped costs against the measured ms at seqlen 512 and 1024 (both head
    dims and masks, all 7 columns; 512 was fitted, 1024 held out): the errors
    docs/schedule.md reports for them (median 1.4%, max 11.8%)."""
    rows = C.evaluate_grid(C.H100, C.H100_B064A4D, train_seqlens=(512,), seqlens=(512, 1024))
    assert len(rows) == 2 * 2 * 2 * 7
    errs = sorted(abs(r["error"]) for r in rows)
    assert errs[len(errs) // 2] < 0.04 and errs[-1] < 0.125
    one = next(r for r in rows if (r["hdim"], r["mask"], r["seqlen"], r["column"]) == (128, "causal", 512, "spt"))
    g = C.H100_B064A4D.geometry(128, "causal", 512)
    assert math.isclose(C.predict_ms("spt", g, 128), one["predicted_ms"], rel_tol=1e-12)
    nd = next(r for r in rows if (r["hdim"], r["mask"], r["seqlen"], r["column"]) == (64, "full", 1024, "nd"))
    assert math.isclose(C.predict_ms("lpt", C.H100_B064A4D.geometry(64, "full", 1024), 64, deterministic=False),
                        nd["predicted_ms"], rel_tol=1e-12)


def test_ranking_metrics():
    rows = []
    for col, m, p in [("fa3", 2.0, 2.1), ("spt", 1.0, 1.05), ("shift", 1.01, 1.0), ("lpt", 1.5, 1.2)]:
        rows.append(dict(hdim=64, mask="causal", seqlen=512, column=col, measured_ms=m, predicted_ms=p,
                         error=p / m - 1, split="fit"))
    (rk,) = C.ranking(rows)
    assert rk["measured_best"] == "spt" and rk["model_best"] == "shift"
    assert math.isclose(rk["pick_loss"], 0.01)
    # spt/shift differ by 1% (a tie at 2%): 5 pairs count, all ordered alike
    assert rk["pairs"] == 5 and rk["pairs_agree"] == 5
    s = C.summarize(rows, [rk])
    assert s["ranking"]["pick_within_2pct"] == 1 and s["fit"]["cells"] == 4
    assert "| 64 | causal | 512 | fit |" in C.format_table(rows, [rk])


def test_fit_recovers_a_synthetic_grid():
    """Times made by the model from known costs on a small grid (8 SMs) are fitted
    back, from other costs, to within 1% everywhere."""
    pytest.importorskip("scipy")
    truth = C.HeadDimCosts(compute=2.0, compute_per_kkey=0.05, masked_extra=0.4, epilogue=3.0, reduce=1.5,
                           read=0.5, latency=0.4, handoff_at=0.8)
    base = C.MeasuredGrid(device="synthetic", date="-", commit="-", source="-", num_sms=8,
                          total_tokens=2048, hidden=256, rows=())
    rows = []
    for mask in ("full", "causal"):
        for s in (256, 512, 1024):
            f = base.flops(64, mask, s)
            ms = []
            for col in C.COLUMNS:
                cell = C.Cell(base, 64, mask, s, col, 1.0)
                ms.append(cell.predict_ms(truth, 50.0))
            rows.append((64, mask, s, tuple(f / (m * 1e-3) / 1e12 for m in ms)))
    grid = C.MeasuredGrid(**{**vars(base), "rows": tuple(rows)})
    start = C.Calibration(device="synthetic", num_sms=8, data="-", fitted="-", overhead=50.0,
                          headdims={64: C.HeadDimCosts(2.5, 0.02, 0.1, 2.0, 1.0, 0.5, 0.1, 0.8)})
    fitted = C.refit(start, grid, (256, 512, 1024), workers=1, max_evals=120, log=lambda m: None)
    out = C.evaluate_grid(fitted, grid, (256, 512, 1024))
    assert max(abs(r["error"]) for r in out) < 0.01


def test_auto_policy_model_is_opt_in():
    g = Geometry.from_shape(batch=2, heads=8, heads_kv=2, seqlen_q=1536, headdim=128, causal=True)
    assert S.get_auto_policy() == "table"
    table = resolve_schedule_name("auto", g)
    model = resolve_schedule_name("auto", g, num_sms=64, policy="model")
    assert model == C.best_schedule(g, 64)
    pred = C.predict_all(g, 64)
    assert pred[model] == min(pred.values()) and set(pred) == set(C.DETERMINISTIC_CANDIDATES)
    old = S.set_auto_policy("model")
    try:
        assert resolve_schedule_name("auto", g, num_sms=64) == model
        assert resolve_schedule_name("auto", g, deterministic=False) == "lpt"
    finally:
        S.set_auto_policy(old)
    assert resolve_schedule_name("auto", g) == table
    with pytest.raises(ValueError):
        S.set_auto_policy("oracle")
    with pytest.raises(ValueError):
        resolve_schedule_name("auto", g, policy="oracle")


def test_calibrate_cli(capsys):
    assert main(["calibrate", "--headdim", "64", "--seqlens", "512", "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 2 * 7 and len(out["ranking"]) == 2
    assert out["calibration"]["device"].startswith("NVIDIA H100")
    assert out["summary"]["fit"]["max_abs_error"] < 0.10


def test_real_shape_cli_calibrated(capsys):
    assert main(["--seqlen", "1024", "--headdim", "128", "--heads", "4", "--batch", "2", "--causal",
                 "--calibrated", "--no-gantt", "--json", "--no-critical-path", "--sms", "16",
                 "--schedule", "spt,symmetric_shift"]) == 0
    rows = json.loads(capsys.readouterr().out)
    g = Geometry.from_shape(batch=2, heads=4, seqlen_q=1024, headdim=128, causal=True)
    for r in rows:
        assert r["pipeline"] == "writer"
        assert math.isclose(r["predicted_ms"], C.predict_ms(r["schedule"], g, 128, num_sms=16), rel_tol=1e-12)
