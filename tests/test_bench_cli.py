"""``python -m dash_fa3.bench``: argument handling, the CPU run's shape, --plot (CPU)."""

import os
import subprocess
import sys

import pytest

from dash_fa3 import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--seqlen", "64", "--warmup", "0", "--iters", "1"]


@pytest.fixture
def cpu_run(monkeypatch):
    """The CPU path, also on a GPU machine."""
    monkeypatch.setattr(bench, "gpu_unavailable_reason", lambda: "test: the CPU path was asked for")


@pytest.mark.parametrize("argv, message", [
    (["--heads", "0"], "--heads must be >= 1, got 0"),
    (["--batch", "-2"], "--batch must be >= 1, got -2"),
    (["--seqlen", "0"], "--seqlen must be >= 1"),
    (["--heads-kv", "0"], "--heads-kv must be >= 1"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--sms", "0"], "--sms must be >= 1"),
    (["--headdim", "80"], "--headdim: head dim 80 is not supported"),
    (["--sms", "100000000"], "--sms must be <= 1024, got 100000000"),
    (["--iters", "1000000000"], "--iters must be <= 10000"),
    (["--seqlen", "1000000000"], "--seqlen must be <= "),
    (["--seqlen", "131072"], "the CPU reference holds batch x heads x seqlen^2"),
    (["--heads", "16", "--heads-kv", "5"], "--heads (16) must be a multiple of --heads-kv (5)"),
    (["--heads-kv", "3"], "--heads-kv 3 does not divide --heads, which defaults to"),
    (["--heads", "many"], "argument --heads: invalid int value: 'many'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice"),
    (["--causal", "--full"], "not allowed with argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--plot", "out.jpeg"], "must end in .png, .pdf, .svg"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, cpu_run):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("python -m dash_fa3.bench: error: ")
    assert message in err


def test_plot_path_that_is_a_directory(tmp_path, capsys, cpu_run):
    target = tmp_path / "figure.png"
    target.mkdir()
    with pytest.raises(SystemExit) as exc:
        bench.main(["--plot", str(target)])
    assert exc.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_process_exit_status_and_no_traceback():
    res = subprocess.run([sys.executable, "-m", "dash_fa3.bench", "--heads", "-1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == ["python -m dash_fa3.bench: error: --heads must be >= 1, got -1 (see --help)"]


def test_cpu_run_keeps_the_users_shape_flags(capsys, cpu_run):
    # Used to crash with an error about heads=4, a value nobody asked for.
    assert bench.main(["--heads", "16", "--heads-kv", "16", "--batch", "2", "--headdim", "96", "--full"] + TINY) == 0
    out = capsys.readouterr().out
    assert "shape: batch 2, seqlen 64, heads 16/16 (q/kv), headdim 96, bf16, full" in out
    assert "CPU defaults" not in out
    assert "forward" in out and "backward" in out and "CPU fp32 reference" in out


def test_cpu_run_says_which_flags_took_cpu_defaults(capsys, cpu_run):
    assert bench.main(["--heads", "8", "--heads-kv", "2"] + TINY) == 0
    out = capsys.readouterr().out
    d = bench.CPU_DEFAULTS
    assert f"CPU defaults for the shape flags not given: --batch {d['batch']}, --headdim {d['headdim']}" in out
    assert f"shape: batch {d['batch']}, seqlen 64, heads 8/2 (q/kv), headdim {d['headdim']}" in out
    # The schedule model describes the GPU run: the flags given, GPU defaults for the rest.
    g = bench.GPU_DEFAULTS
    assert f"b={g['batch']} h=8 hkv=2 sq=64 sk=64" in out


def test_plot_is_drawn_from_the_run(tmp_path, capsys, cpu_run):
    path = tmp_path / "sub" / "bench.png"
    assert bench.main(TINY + ["--heads", "2", "--plot", str(path)]) == 0
    assert f"plot written to {path}" in capsys.readouterr().out
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_values_come_from_the_rows(tmp_path, monkeypatch):
    seen = {}

    class FakeAxes:
        def __getattr__(self, name):
            def record(*args, **kwargs):
                seen.setdefault(name, []).append(args)
            return record

    plt = pytest.importorskip("matplotlib.pyplot", reason="charts need the plots extra (pip install -e .[plots])")

    monkeypatch.setattr(plt, "subplots", lambda *a, **k: (FakeAxes(), [FakeAxes(), FakeAxes(), FakeAxes()]))
    monkeypatch.setattr(plt, "close", lambda fig: None)
    rows = [("forward", "dash_fa3 Hopper kernel", 2.0, "600 TFLOP/s"),
            ("bwd preprocess", "dash_fa3 kernel", 0.1, "2000 GB/s"),
            ("backward", "dash_fa3 Hopper kernel, non-deterministic (adds in any order), task order lpt", 5.0, "500 TFLOP/s"),
            ("backward", "dash_fa3 Hopper kernel, deterministic, schedule spt", 5.5, "450 TFLOP/s")]
    model = [{"schedule": "spt", "ratio": 1.08, "num_sms": 132}, {"schedule": "fa3", "ratio": 1.85, "num_sms": 132}]
    bench.plot(str(tmp_path / "x.png"), rows, model, "title", "model shape")
    tflops = seen["barh"][0][1]
    assert sorted(tflops) == [450.0, 500.0, 600.0]  # the GB/s row is not a TFLOP/s bar
    ratio_names, ratio_values = seen["bar"][0]
    assert ratio_values[0] == pytest.approx(0.9) and ratio_values[1] == pytest.approx(5.0 / 2.0)
    assert list(seen["bar"][1][0]) == ["spt", "fa3"] and list(seen["bar"][1][1]) == [1.08, 1.85]


def test_matplotlib_is_imported_only_for_a_plot():
    code = "import sys, dash_fa3.bench; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_headdims_are_the_apis(capsys, cpu_run):
    """The bench takes exactly the head dims the API has kernels for (variants.check_head_dims)."""
    from dash_fa3 import variants

    for d in range(1, 300):
        try:
            variants.check_head_dims(d, d)
            api = True
        except ValueError:
            api = False
        ok = bench.check_args(bench.parser().parse_args(["--headdim", str(d)])) is None
        assert ok == api, d


def test_unwritable_plot_folder_is_one_line_error(tmp_path, capsys, cpu_run):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        bench.main(TINY + ["--plot", str(blocker / "sub" / "x.png")])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--plot" in err and "its folder" in err


def test_model_section_past_its_limit_is_skipped_not_fatal(capsys, cpu_run):
    """A shape the schedule model cannot enumerate: the model section says why it is left out instead of
    ending the run."""
    args = bench.parser().parse_args(["--seqlen", "65536"])
    bench.resolve(args, bench.GPU_DEFAULTS)
    assert bench.model_too_large(args) is not None and bench.schedule_model_rows(args, 132) == []
    bench.print_schedule_model(args, 132)
    assert "not run:" in capsys.readouterr().out
