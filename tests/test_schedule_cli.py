"""The CLI, called in-process through main(argv)."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from dash_fa3._cli import headdim
from dash_fa3.schedule import SCHEDULES, Geometry, main
from dash_fa3.schedule.export import read_bundle
from dash_fa3.schedule.lowering import get_kernel_metadata
from dash_fa3.schedule.model import cli

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
    pytest.importorskip("matplotlib", reason="Gantt charts need the plots extra (pip install -e .[plots])")
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
    rc = main(["--seqlen", "2000", "--seqlen-k", "3000", "--headdim", "64", "--heads", "6", "--heads-kv", "2",
               "--schedule", "shift,descending,auto", "--no-gantt", "--json", "--latency", "0.3"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    # auto: seqlen_q < seqlen_k takes no shift order, a group of 3 no grouped one (policy.table_pick)
    assert [r["schedule"] for r in rows] == ["shift", "descending", "fa3"]
    assert all(r["valid"] and r["makespan"] >= r["critical_path"] - 1e-9 for r in rows)


def test_bench_grid_command(capsys, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"total_tokens": 4096, "hidden": 512, "headdims": [64, 128],
                                "seqlens": [512, 1024], "masks": ["full", "causal"]}))
    assert main(["bench-grid", "--grid", str(grid), "--sms", "132,114", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "all valid" in out and out.count("sms=") == 16


def test_unknown_schedule(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["model", "-n", "4", "-m", "1", "--schedule", "bogus"])
    assert exc.value.code == 2 and "unknown schedule 'bogus'" in capsys.readouterr().err


def test_docs_charts_small():
    if not os.path.isdir(DOCS_GANTT):
        pytest.skip("docs/gantt not generated")
    pngs = [p for p in os.listdir(DOCS_GANTT) if p.endswith(".png")]
    assert len(pngs) >= 12
    for p in pngs:
        assert os.path.getsize(os.path.join(DOCS_GANTT, p)) < 150_000, p


@pytest.mark.parametrize("argv", [
    ["model", "-n", "4", "-m", "2", "--reduce", "nan"],
    ["model", "-n", "4", "-m", "2", "--compute", "-1"],
    ["model", "-n", "4", "-m", "2", "--latency", "inf"],
    ["model", "-n", "0", "-m", "2"],
    ["model", "-n", "4", "-m", "-3"],
    ["model", "-n", "4", "-m", "2", "--sms", "0"],
    ["model", "-n", "4", "-m", "2", "--schedule", ","],
    ["--seqlen", "1024", "--sms", "0", "--no-gantt"],
    ["--seqlen", "-5", "--no-gantt"],
    ["--seqlen", "1024", "--headdim", "0", "--no-gantt"],
    ["--seqlen", "1024", "--headdim", "512", "--no-gantt"],
    ["--seqlen", "1024", "--heads", "6", "--heads-kv", "4", "--no-gantt"],
    ["--seqlen", "1024", "--block-m", "-64", "--no-gantt"],
    ["--seqlen", "abc", "--no-gantt"],
    ["--seqlen", "1024", "--epilogue", "nan", "--no-gantt"],
    ["bench-grid", "--sms", "132,0"],
    ["bench-grid", "--sms", "x"],
    ["gallery", "--reduce", "-0.5"],
    ["export", "--out", "unused.i32", "--sms", "0", "--seqlen", "128"],
    ["export", "--out", "unused.i32"],
    # zero where meaningless, absurd sizes, a head dim the API refuses
    ["model", "-n", "4", "-m", "2", "--compute", "0"],
    ["model", "-n", "4", "-m", "2", "--compute", "1e308", "--rc-ratio", "1e308"],
    ["model", "-n", "4", "-m", "2", "--compute", "1e9", "--rc-ratio", "2"],
    ["model", "-n", "4", "-m", "2", "--latency", "1e308"],
    ["model", "-n", "4", "-m", "2", "--read", "2", "--reduce", "1"],
    ["--seqlen", "1024", "--sms", "100000000", "--no-gantt"],
    ["--seqlen", "10000000", "--no-gantt"],
    ["--seqlen", "1024", "--heads", "100000000", "--no-gantt"],
    ["--seqlen", "1024", "--batch", "0", "--no-gantt"],
    ["--seqlen", "1024", "--headdim", "80", "--no-gantt"],
    ["--seqlen", "1024", "--block-n", "100000", "--no-gantt"],
    ["bench-grid", "--grid", "/nonexistent/grid.json"],
    ["calibrate", "--headdim", "80"],
    ["calibrate", "--seqlens", "3000"],
    ["calibrate", "--workers", "0"],
    ["export", "--out", "unused.i32", "--seqlen", "128", "--headdim", "80"],
    ["export", "--out", "unused.i32", "--shapes", "/nonexistent/shapes.txt"],
])
def test_bad_arguments_one_line_error(argv, capsys):
    """A bad value is refused before any work: exit status 2, one line naming the program."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m dash_fa3.schedule") and "error:" in err[0], err


def test_headdims_are_the_apis():
    """The CLI takes exactly the head dims the API has kernels for (variants.check_head_dims)."""
    from dash_fa3 import variants

    for d in range(1, 300):
        try:
            variants.check_head_dims(d, d)
            api = True
        except ValueError:
            api = False
        try:
            headdim(str(d))
            ok = True
        except argparse.ArgumentTypeError:
            ok = False
        assert ok == api, d


@pytest.mark.parametrize("argv", [
    ["--seqlen", "131072", "--no-gantt"],                       # 16 heads: 2M steps per head x 16
    ["--seqlen", "1048576", "--heads", "1", "--causal", "--no-gantt"],
    ["model", "-n", "4096", "-m", "1"],
    ["export", "--out", "unused.i32", "--seqlen", "8388608", "--heads", "1"],
    ["export", "--out", "unused.i32", "--seqlen", "1048576", "--heads", "4096", "--batch", "4"],
])
def test_long_sequences_are_refused_up_front(argv, capsys):
    """128k-1M tokens: refused in one line that names the limit, before any schedule is built (the
    model's time and memory grow with the square of the length)."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and time.perf_counter() - t0 < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and any(f"{limit:,}" in err[0] for limit in (cli.MAX_STEPS, cli.MAX_HEAD_CELLS, cli.MAX_TASKS))


def test_a_long_sequence_with_one_head_runs(capsys):
    """At the limit's scale the model still runs: 128k tokens of one head, a causal mask (1M steps)."""
    g = Geometry.from_shape(batch=1, heads=1, seqlen_q=131072, headdim=128, causal=True)
    assert g.num_steps <= cli.MAX_STEPS
    assert main(["--seqlen", "131072", "--heads", "1", "--causal", "--no-gantt", "--no-critical-path",
                 "--schedule", "spt", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["valid"] and row["steps"] == g.num_steps


@pytest.mark.parametrize("flag", ["--gantt-dir", "gallery --out", "model --gantt"])
def test_unwritable_outputs_are_one_line_errors(flag, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = str(blocker / "sub")          # a directory under a regular file cannot be made
    sub, opt = flag.split() if " " in flag else (None, flag)
    argv = {None: ["--seqlen", "256", "--heads", "1", "--schedule", "spt"],
            "gallery": ["gallery"], "model": ["model", "-n", "4", "-m", "1"]}[sub]
    with pytest.raises(SystemExit) as exc:
        main(argv + [opt, path + ("/x.png" if sub == "model" else "")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and opt in err[0], err


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert f"  {name} " in out, name
    for name in cli.SUBCOMMANDS:     # and each one answers --help
        if name != "shape":
            with pytest.raises(SystemExit) as exc:
                main([name, "--help"])
            assert exc.value.code == 0


def test_bad_arguments_from_the_command_line(tmp_path):
    """The same through `python -m dash_fa3.schedule`: no traceback."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "dash_fa3.schedule", "model", "-n", "4", "-m", "2",
                           "--reduce", "nan"], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "argument --reduce: must be a finite number >= 0 and <= 1e+09, got 'nan'" in proc.stderr


def test_export_bundle(tmp_path, capsys):
    """export writes the launcher's validated static metadata, one buffer per (shape, schedule)."""
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("# b h hkv sq sk d causal\n2 4 2 700 300 64 1\n\n1 2 2 1000 1000 128 0  # full\n")
    out = tmp_path / "s.i32"
    assert main(["export", "--out", str(out), "--sms", "16", "--shapes", str(shapes), "--schedule", "fa3,spt"]) == 0
    metas = read_bundle(out)
    geoms = [Geometry.from_shape(batch=2, heads=4, heads_kv=2, seqlen_q=700, seqlen_k=300, headdim=64,
                                 causal=True),
             Geometry.from_shape(batch=1, heads=2, seqlen_q=1000, headdim=128)]
    want = [get_kernel_metadata(n, g, 16, "static") for g in geoms for n in ("fa3", "spt")]
    assert [m.as_int32_array().tolist() for m in metas] == [m.as_int32_array().tolist() for m in want]
    assert all(not m.dynamic for m in metas)
    assert main(["export", "--out", str(out), "--seqlen", "256", "--headdim", "64", "--causal",
                 "--schedule", "shift"]) == 0
    (one,) = read_bundle(out)
    assert one.field("schedule") == SCHEDULES.index("shift") and one.field("num_ctas") <= 132


def test_export_rejects_bad_shape_lines(tmp_path, capsys):
    shapes = tmp_path / "shapes.txt"
    for text in ("1 2 2 100 100 64\n", "1 2 2 100 100 64 2\n", "1 2 x 100 100 64 1\n", "1 3 2 100 100 64 1\n",
                 "1 2 2 0 100 64 1\n"):
        shapes.write_text(text)
        with pytest.raises(SystemExit) as exc:
            main(["export", "--out", str(tmp_path / "s.i32"), "--shapes", str(shapes)])
        assert exc.value.code == 2
        assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("headdim,heads", [(192, 8), (128, 6)])
def test_all_is_the_schedules_a_shape_has(capsys, headdim, heads):
    """``--schedule all`` lists the schedules defined for the shape (schedules_for): no runs or groups at
    head dim 192, whose kernel has no chains; no grouped_* with a group of 3."""
    from dash_fa3.schedule import schedules_for
    assert main(["--seqlen", "512", "--headdim", str(headdim), "--heads", str(heads), "--heads-kv", "2",
                 "--schedule", "all", "--no-gantt", "--no-critical-path", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    g = Geometry.from_shape(batch=1, heads=heads, heads_kv=2, seqlen_q=512, headdim=headdim)
    assert [r["schedule"] for r in rows] == list(schedules_for(g)) and all(r["valid"] for r in rows)
    assert ("runs" in schedules_for(g)) == (headdim != 192)
