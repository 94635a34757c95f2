"""The CLI, called in-process through main(argv)."""

import json
import os

import pytest

from dash_fa3.schedule import SCHEDULES, main

DOCS_GANTT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "gantt")


def test_model_json(capsys):
    rc = main(["model", "--kv-tiles", "8", "--heads", "4", "--compute", "1", "--reduce", "0.5",
               "--mask", "causal", "--schedule", "symmetric_shift", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("schedule", "makespan", "critical_path", "lower_bound", "sm_idle_fraction", "valid"):
        assert key in out
    assert out["valid"] is True and out["schedule"] == "symmetric_shift"
    assert out["makespan"] == out["critical_path"] == out["lower_bound"] == out["paper_makespan"] == 27.0
    assert out["sm_idle_fraction"] == 0.0


def test_model_all_json(capsys):
    assert main(["model", "-n", "6", "-m", "2", "--mask", "full", "--schedule", "all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in rows] == list(SCHEDULES)
    shift = rows[SCHEDULES.index("shift")]
    fa3 = rows[SCHEDULES.index("fa3")]
    assert shift["makespan"] == 2 * 6 * 2.0 and fa3["makespan"] == 2 * 6 * 2.0 + 5 * 1.0


def test_real_shape_table_and_gantt(capsys, tmp_path):
    rc = main(["--seqlen", "1024", "--headdim", "128", "--heads", "4", "--batch", "2", "--causal",
               "--schedule", "all", "--sms", "16", "--gantt-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    for name in SCHEDULES:
        assert name in out
    assert "makespan" in out and "crit.path" in out and "idle %" in out
    pngs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".png"))
    assert len(pngs) == len(SCHEDULES)
    for p in pngs:
        assert os.path.getsize(tmp_path / p) < 400_000


def test_real_shape_json_gqa(capsys):
    rc = main(["--seqlen", "2000", "--seqlen-k", "3000", "--headdim", "64", "--heads", "8", "--heads-kv", "2",
               "--schedule", "shift,descending,auto", "--no-gantt", "--json", "--latency", "0.3"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in rows] == ["shift", "descending", "shift"]
    assert all(r["valid"] and r["makespan"] >= r["critical_path"] - 1e-9 for r in rows)


def test_bench_grid_command(capsys, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"total_tokens": 4096, "hidden": 512, "headdims": [64, 128],
                                "seqlens": [512, 1024], "masks": ["full", "causal"]}))
    assert main(["bench-grid", "--grid", str(grid), "--sms", "132,114", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "all valid" in out and out.count("sms=") == 16


def test_unknown_schedule():
    with pytest.raises(SystemExit):
        main(["model", "-n", "4", "-m", "1", "--schedule", "bogus"])


def test_docs_charts_small():
    if not os.path.isdir(DOCS_GANTT):
        pytest.skip("docs/gantt not generated")
    pngs = [p for p in os.listdir(DOCS_GANTT) if p.endswith(".png")]
    assert len(pngs) >= 12
    for p in pngs:
        assert os.path.getsize(os.path.join(DOCS_GANTT, p)) < 150_000, p
