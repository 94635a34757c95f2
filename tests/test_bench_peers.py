"""The peer harness without a GPU: benchmarks/bench_peers.py's arguments, grid
narrowing, round rotation and ratio math on synthetic timings, and
benchmarks/peers/build_fa3.py's plan (dry run), commit check and errors."""

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_peers as bp  # noqa: E402
from peers import build_fa3, fa3 as fa3_peer, fa3_suite  # noqa: E402

# A flash-attention checkout, as build_fa3.py finds it: the tests that read FA3's sources skip without one.
FA3_SRC = os.environ.get("FA3_SRC", "")
GRID = json.load(open(os.path.join(ROOT, "dash_fa3", "schedule", "bench_grid.json")))
GRID_SWITCHES_OFF = ("SM80", "FP8", "FP16", "SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA",
                     "CLUSTER", "VARLEN", "HDIM96", "HDIM192", "HDIM256", "HDIMDIFF64", "HDIMDIFF192")


# ---------------------------------------------------------------- bench_peers: arguments


def test_defaults_cover_the_whole_grid():
    args = bp.parse_args([])
    points = bp.grid_points(GRID, args.hdims, args.seqlens, args.masks)
    assert sorted((p["hdim"], p["mask"], p["seqlen"]) for p in points) == sorted(
        (d, m, s) for d in GRID["headdims"] for m in GRID["masks"] for s in GRID["seqlens"])
    for p in points:  # every point holds the grid's token count and hidden size
        assert p["batch"] * p["seqlen"] == GRID["total_tokens"] and p["heads"] * p["hdim"] == GRID["hidden"]


def test_narrowing_with_space_or_comma_lists():
    a = bp.parse_args(["--hdims", "128", "--seqlens", "512,8192", "--masks", "causal", "--direction", "bwd"])
    b = bp.parse_args(["--hdims", "128", "--seqlens", "512", "8192", "--masks", "causal", "--direction", "bwd"])
    for args in (a, b):
        points = bp.grid_points(GRID, args.hdims, args.seqlens, args.masks)
        assert [(p["hdim"], p["mask"], p["seqlen"], p["batch"], p["heads"]) for p in points] == [
            (128, "causal", 512, 32, 16), (128, "causal", 8192, 2, 16)]
    args = bp.parse_args(["--schedules", "shift,spt", "--peers", "cudnn"])
    assert args.schedules == ["shift", "spt"] and args.peers == ["cudnn"]
    # every schedule of the package can be timed, beyond the default six
    assert bp.parse_args(["--schedules", "sections,runs"]).schedules == ["sections", "runs"]
    assert bp.parse_args([]).schedules == list(bp.DEFAULT_SCHEDULES)
    assert bp.parse_args(["--peers", ""]).peers == []


def test_wide_head_dims_and_skips():
    # 192 does not divide the hidden size: the largest whole number of heads, as FA3's benchmark.
    args = bp.parse_args(["--hdims", "192,256", "--seqlens", "4096", "--masks", "full", "--skip", "FA3 det"])
    points = bp.grid_points(GRID, args.hdims, args.seqlens, args.masks)
    assert [(p["hdim"], p["heads"], p["batch"]) for p in points] == [(192, 10, 4), (256, 8, 4)]
    assert args.skip == ["FA3 det"]


@pytest.mark.parametrize("argv", [
    ["--masks", "sliding"], ["--seqlens", "1000"], ["--hdims", "0"], ["--hdims", "4096"], ["--hdims", "x"],
    ["--skip", "FA3 deterministic"],
    ["--schedules", "bogus"], ["--peers", "sdpa"], ["--rounds", "0"], ["--iters", "0"], ["--direction", "up"],
])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit):
        bp.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_implementations_per_direction():
    sched = list(bp.DEFAULT_SCHEDULES)
    fwd, bwd, both = (bp.impl_names(d, sched) for d in ("fwd", "bwd", "both"))
    assert fwd == ("FA3 fwd", "FA4 fwd", "cuDNN fwd", "ours fwd")
    assert set(bwd) == ({"FA3 nd", "FA3 det", "FA4 nd", "FA4 det", "cuDNN bwd", "ours nd", "ours auto"}
                        | {f"ours det {s}" for s in sched})
    assert len(bwd) == 13 and set(both) == set(fwd) | set(bwd)
    assert {bp.impl_direction(n) for n in fwd} == {"fwd"} and {bp.impl_direction(n) for n in bwd} == {"bwd"}
    assert ([bp.impl_peer(n) for n in ("FA3 det", "FA4 nd", "cuDNN fwd", "ours det lpt")]
            == ["fa3", "fa4", "cudnn", "ours"])


def test_rounds_rotate_the_order():
    names = bp.impl_names("both", bp.DEFAULT_SCHEDULES)
    orders = [bp.rotated(names, r) for r in range(len(names))]
    for order in orders:
        assert sorted(order) == sorted(names)  # every implementation once per round
    # Over len(names) rounds each implementation holds each position exactly once.
    for pos in range(len(names)):
        assert sorted(o[pos] for o in orders) == sorted(names)
    assert bp.rotated(names, 0)[0] != bp.rotated(names, 1)[0]
    assert bp.rotated([], 3) == []


# ---------------------------------------------------------------- bench_peers: figures


def test_flops_formula():
    p = bp.grid_points(GRID, [128], [8192], ["full", "causal"])
    full, causal = (bp.point_flops(x, "fwd") for x in p)
    assert full == 4 * 2 * 16 * 8192 * 8192 * 128 and causal == full / 2
    assert bp.point_flops(p[0], "bwd") == 2.5 * full


def test_value_head_dim_points():
    """--hdims 192v128: MLA points with v's head dim, flops counted per GEMM, labelled 192v128."""
    args = bp.parse_args(["--hdims", "192v128,128", "--seqlens", "4096", "--masks", "full"], grid=GRID)
    assert args.hdims == [(192, 128), (128, 128)]
    mla, plain = bp.grid_points(GRID, args.hdims, args.seqlens, args.masks)
    assert (mla["hdim"], mla["hdim_v"], mla["heads"]) == (192, 128, GRID["hidden"] // 192)
    pairs = mla["batch"] * mla["heads"] * 4096 * 4096
    assert bp.point_flops(mla, "fwd") == 2 * pairs * (192 + 128)
    assert bp.point_flops(mla, "bwd") == 2 * pairs * (3 * 192 + 2 * 128)
    assert bp.point_label(mla) == "d192v128 full 4k" and bp.point_label(plain) == "d128 full 4k"


def test_tflops_is_the_median_over_rounds():
    flops = {"fwd": 1e12, "bwd": 2.5e12}
    tf = bp.tflops_from_rounds({"ours nd": [5.0, 4.0, 10.0], "ours fwd": [2.0, 2.5], "FA3 nd": []}, flops)
    assert tf["ours nd"] == pytest.approx(500.0)  # 2.5e12 / 5 ms, the median of 500, 625, 250
    assert tf["ours fwd"] == pytest.approx(statistics.median([500.0, 400.0]))
    assert tf["FA3 nd"] is None


def _tf(**over):
    tf = {"ours fwd": 700.0, "FA3 fwd": 750.0, "cuDNN fwd": 600.0, "ours nd": 500.0, "FA3 nd": 600.0,
          "FA3 det": 520.0, "cuDNN bwd": 550.0, "ours auto": 480.0}
    tf.update({f"ours det {s}": 400.0 + i for i, s in enumerate(bp.DEFAULT_SCHEDULES)})  # lpt best: 405
    tf.update(over)
    return tf


def test_ratios_on_synthetic_figures():
    r = bp.point_ratios(_tf(), bp.DEFAULT_SCHEDULES)
    assert r["nd/FA3 nd"] == pytest.approx(500 / 600)
    assert r["best det/FA3 det"] == pytest.approx(405 / 520)
    assert bp.best_det(_tf(), bp.DEFAULT_SCHEDULES) == (405.0, "lpt")
    assert r["auto/max nd"] == pytest.approx(480 / 600)  # FA3 nd is the fastest non-deterministic peer
    assert r["fwd/max fwd"] == pytest.approx(700 / 750)
    # cuDNN fastest: the max moves to it.
    assert bp.point_ratios(_tf(**{"cuDNN bwd": 800.0}), bp.DEFAULT_SCHEDULES)["auto/max nd"] == pytest.approx(0.6)
    # Only a subset of schedules counts toward best det.
    assert bp.point_ratios(_tf(), ["fa3", "spt"])["best det/FA3 det"] == pytest.approx(401 / 520)


def test_ratios_with_fa4():
    tf = _tf(**{"FA4 nd": 650.0, "FA4 det": 450.0, "FA4 fwd": 800.0})
    r = bp.point_ratios(tf, bp.DEFAULT_SCHEDULES)
    assert r["nd/FA4 nd"] == pytest.approx(500 / 650)
    assert r["best det/FA4 det"] == pytest.approx(405 / 450)
    # FA4 is now the fastest non-deterministic backward and the fastest forward
    assert r["best det/max nd"] == pytest.approx(405 / 650)
    assert r["auto/max nd"] == pytest.approx(480 / 650)
    assert r["fwd/max fwd"] == pytest.approx(700 / 800)
    assert r["nd/FA3 nd"] == pytest.approx(500 / 600)  # the FA3 ratios are unchanged


def test_missing_fa4_is_reported_not_raised(monkeypatch):
    import importlib.metadata

    def not_found(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_found)
    fa4, reason = bp.load_fa4_peer(bp.parse_args([]))
    assert fa4 is None and "flash-attn-4 is not installed" in reason and "pip install" in reason
    assert bp.load_fa4_peer(bp.parse_args(["--peers", "fa3,cudnn"])) == (None, "not requested (--peers)")


def test_ratios_without_fa3():
    tf = {k: v for k, v in _tf().items() if not k.startswith("FA3")}
    r = bp.point_ratios(tf, bp.DEFAULT_SCHEDULES)
    assert r["nd/FA3 nd"] is None and r["best det/FA3 det"] is None
    assert r["auto/max nd"] == pytest.approx(480 / 550)  # the max runs over the peers present
    assert r["fwd/max fwd"] == pytest.approx(700 / 600)
    assert bp.point_ratios({}, bp.DEFAULT_SCHEDULES) == {k: None for k in bp.RATIOS}


def test_summary_min_median_max():
    rows = [{"nd/FA3 nd": 0.8, "fwd/max fwd": None}, {"nd/FA3 nd": 1.1}, {"nd/FA3 nd": 0.9}, {"nd/FA3 nd": None}]
    s = bp.summarize(rows)
    assert (s["min"]["nd/FA3 nd"], s["median"]["nd/FA3 nd"], s["max"]["nd/FA3 nd"]) == (0.8, 0.9, 1.1)
    assert s["median"]["fwd/max fwd"] is None and s["max"]["auto/max nd"] is None


def test_table_rows_and_summary_rows():
    sched = list(bp.DEFAULT_SCHEDULES)
    cols = bp.columns("both", sched)
    assert cols[-1] == "check" and all(r in cols for r in bp.RATIOS)
    assert "FA3 fwd" not in bp.columns("bwd", sched) and "ours nd" not in bp.columns("fwd", sched)
    assert "fwd/max fwd" not in bp.columns("bwd", sched) and "nd/FA3 nd" not in bp.columns("fwd", sched)
    header = bp.table_header(cols)
    assert header.splitlines()[0].count("|") == header.splitlines()[1].count("|") == len(cols) + 4
    assert "det symmetric_shift" in header
    p = {"hdim": 64, "mask": "causal", "seqlen": 8192}
    tf = _tf(**{"FA3 det": None})
    row = bp.format_row(p, tf, bp.point_ratios(tf, sched), "ok", cols, sched)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(cols) + 3 and cells[:3] == ["64", "causal", "8192"]
    by_col = dict(zip(cols, cells[3:]))
    assert by_col["FA3 det"] == "n/a" and by_col["best det/FA3 det"] == "n/a"
    assert by_col["ours nd"] == "500" and by_col["best det"] == "405 (lpt)" and by_col["nd/FA3 nd"] == "0.83"
    lines = bp.format_summary(bp.summarize([bp.point_ratios(_tf(), sched)]), cols)
    assert [ln.split("|")[1].strip() for ln in lines] == ["min", "median", "max"]
    assert all(ln.count("|") == len(cols) + 4 for ln in lines)


def test_check_text():
    assert bp.check_text({"FA3": {"out": 0.003, "dq": 0.004}, "cuDNN": {"dq": 0.01}}, 0.02) == "ok"
    warn = bp.check_text({"FA3": {"out": 0.003, "dq": 0.5}}, 0.02)
    assert warn.startswith("WARN") and "FA3 dq" in warn and "out" not in warn
    assert bp.check_text({"FA3": {"dk": float("nan")}}, 0.02).startswith("WARN")
    assert bp.check_text({}, 0.02) == "ok"


def test_seeds_differ_per_point():
    points = bp.grid_points(GRID, GRID["headdims"], GRID["seqlens"], GRID["masks"])
    assert len({bp.point_seed(0, p) for p in points}) == len(points)


def test_png_chart(tmp_path):
    pytest.importorskip("matplotlib")
    points = bp.grid_points(GRID, [64], [512, 1024], ["full"])
    rows = [bp.point_ratios(_tf(), bp.DEFAULT_SCHEDULES), bp.point_ratios({}, bp.DEFAULT_SCHEDULES)]
    path = tmp_path / "ratios.png"
    bp.draw_png(str(path), points, rows, "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_gpu(capsys):
    assert bp.main(["--hdims", "64", "--seqlens", "512"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_missing_fa3_is_reported_not_raised(tmp_path):
    args = bp.parse_args(["--fa3-build", str(tmp_path / "nothing")])
    fa3, reason = bp.load_peer(args)
    assert fa3 is None and "not built" in reason and "build_fa3.py" in reason
    assert bp.load_peer(bp.parse_args(["--peers", "cudnn"]))[0] is None
    with pytest.raises(fa3_peer.FA3NotBuilt, match="build_fa3.py --src"):
        fa3_peer.load_fa3(tmp_path)


def test_commit_override(monkeypatch):
    monkeypatch.setenv("DASH_FA3_COMMIT", "abc1234")
    assert bp.commit_label() == "abc1234"
    monkeypatch.delenv("DASH_FA3_COMMIT")
    assert bp.commit_label() not in ("", "abc1234")


# ---------------------------------------------------------------- build_fa3


def _toolchain_ok():
    try:
        build_fa3.find_nvcc()
        build_fa3.cutlass_locator.include_dir()
    except (build_fa3.BuildError, build_fa3.cutlass_locator.CutlassNotFound) as exc:
        return str(exc)
    return None


needs_toolchain = pytest.mark.skipif(_toolchain_ok() is not None, reason=f"nvcc or CUTLASS missing: {_toolchain_ok()}")


def _env_lines(text):
    return dict(line.strip().split("=", 1) for line in text.splitlines() if line.startswith("  ") and "=" in line)


def test_switches_for_the_grid_and_for_later_issues():
    env = build_fa3.switch_env((64, 128), ())
    for s in GRID_SWITCHES_OFF:
        assert env[f"FLASH_ATTENTION_DISABLE_{s}"] == "TRUE", s
    for s in ("HDIM64", "HDIM128", "BACKWARD"):
        assert env[f"FLASH_ATTENTION_DISABLE_{s}"] == "FALSE", s
    wide = build_fa3.switch_env((64, 128, 192, 256), ("varlen", "local", "softcap"))
    for s in ("VARLEN", "LOCAL", "SOFTCAP", "HDIM192", "HDIM256"):
        assert wide[f"FLASH_ATTENTION_DISABLE_{s}"] == "FALSE", s
    assert wide["FLASH_ATTENTION_DISABLE_FP8"] == "TRUE" and wide["FLASH_ATTENTION_DISABLE_HDIM96"] == "TRUE"
    assert build_fa3.switch_env((128,), (), backward=False)["FLASH_ATTENTION_DISABLE_BACKWARD"] == "TRUE"


def test_build_args():
    args = build_fa3.parse_args(["--src", "x", "--hdims", "128,256", "--features", "varlen,softcap"])
    assert args.hdims == (128, 256) and args.features == ("varlen", "softcap")
    for bad in (["--hdims", "100"], ["--features", "ring"], ["--hdims", ""]):
        with pytest.raises(SystemExit):
            build_fa3.parse_args(bad)


@needs_toolchain
@pytest.mark.skipif(not os.path.isdir(FA3_SRC), reason="no FA3 checkout: set FA3_SRC")
def test_dry_run_on_the_test_checkout(capsys, tmp_path):
    assert build_fa3.main(["--src", FA3_SRC, "--build-dir", str(tmp_path / "b"), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    env = _env_lines(out)
    for s in GRID_SWITCHES_OFF:
        assert env[f"FLASH_ATTENTION_DISABLE_{s}"] == "TRUE", s
    for s in ("HDIM64", "HDIM128", "BACKWARD"):
        assert env[f"FLASH_ATTENTION_DISABLE_{s}"] == "FALSE", s
    assert env["GIT_CEILING_DIRECTORIES"] == str(tmp_path / "b")
    assert int(env["MAX_JOBS"]) >= 1 and "NVCC_THREADS" in env
    assert f"FA3 commit:   {build_fa3.PINNED_COMMIT}" in out
    assert "not the pinned" not in err  # the test checkout is the pinned commit
    assert "build_ext --inplace" in out and "module flash_attn_3._C" in out
    assert not (tmp_path / "b").exists()  # a dry run writes nothing


def _fake_checkout(root, commit=None, interface="import flash_attn_3._C\n"):
    (root / "hopper").mkdir(parents=True)
    (root / "hopper" / "setup.py").write_text("raise SystemExit('not a real setup.py')\n")
    (root / "hopper" / "flash_attn_interface.py").write_text(interface)
    (root / "hopper" / "build").mkdir()
    (root / "hopper" / "build" / "stale.o").write_text("")
    (root / "README.md").write_text("fake\n")
    if commit:
        (root / "COMMIT").write_text(commit + "\n")
    return root


@needs_toolchain
def test_commit_mismatch_warns(capsys, tmp_path):
    src = _fake_checkout(tmp_path / "fa", commit="deadbeef")
    assert build_fa3.main(["--src", str(src), "--build-dir", str(tmp_path / "b"), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "FA3 commit:   deadbeef" in out
    assert "not the pinned" in err and build_fa3.PINNED_COMMIT in err


def test_abbreviated_pinned_commit_counts_as_pinned():
    pinned = build_fa3.PINNED_COMMIT
    assert build_fa3.is_pinned(pinned) and build_fa3.is_pinned(pinned[:8]) and build_fa3.is_pinned(pinned[:7].upper())
    assert not build_fa3.is_pinned(pinned[:6])        # too short to name a commit
    assert not build_fa3.is_pinned("deadbeef") and not build_fa3.is_pinned("unknown")
    assert not build_fa3.is_pinned(pinned[:7] + "z")  # not hex
    other = ("1" if pinned[0] != "1" else "2") + pinned[1:]
    assert not build_fa3.is_pinned(other)


def test_commit_sources(tmp_path):
    assert build_fa3.checkout_commit(_fake_checkout(tmp_path / "none")) == "unknown"
    assert build_fa3.checkout_commit(_fake_checkout(tmp_path / "file", commit="cafe01")) == "cafe01"
    if shutil.which("git") is None:
        return
    repo = tmp_path / "repo"
    _fake_checkout(repo, commit="from-file")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert build_fa3.checkout_commit(repo) == head
    # An export nested inside some other repository reports its own COMMIT, not that repository's HEAD.
    nested = _fake_checkout(repo / "sub" / "fa", commit="nested01")
    assert build_fa3.checkout_commit(nested) == "nested01"


@pytest.mark.parametrize("case", ["missing", "no_setup", "no_src"])
def test_clear_errors_for_bad_checkouts(case, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("FA3_SRC", raising=False)
    argv = {"missing": ["--src", str(tmp_path / "absent")], "no_setup": ["--src", str(tmp_path)], "no_src": []}[case]
    assert build_fa3.main(argv + ["--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: build_fa3:")
    assert {"missing": "FA3 checkout not found", "no_setup": "no hopper/setup.py", "no_src": "--src"}[case] in err


def test_clear_errors_for_missing_nvcc_and_cutlass(capsys, tmp_path, monkeypatch):
    src = _fake_checkout(tmp_path / "fa")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert build_fa3.main(["--src", str(src), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nvcc not found" in err
    if _toolchain_ok() is not None:
        return
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("DASH_FA3_CUTLASS_INCLUDE", str(tmp_path / "no-cutlass"))
    assert build_fa3.main(["--src", str(src), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cute/tensor.hpp" in err


@needs_toolchain
def test_prepare_copies_and_links_without_touching_the_checkout(tmp_path):
    src = _fake_checkout(tmp_path / "fa", commit="abc")
    before = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    p = build_fa3.plan(build_fa3.parse_args(["--src", str(src), "--build-dir", str(tmp_path / "b")]))
    for _ in range(2):  # a second run reuses the folder
        hopper = build_fa3.prepare(p)
    assert (hopper / "setup.py").is_file() and (tmp_path / "b" / "README.md").read_text() == "fake\n"
    assert not (hopper / "build").exists()  # the checkout's own build products are not copied
    link = tmp_path / "b" / "csrc" / "cutlass" / "include"
    assert link.is_symlink() and (link / "cute" / "tensor.hpp").is_file()
    assert sorted(str(q.relative_to(src)) for q in src.rglob("*")) == before


def test_up_to_date_and_module_detection(tmp_path):
    b = tmp_path / "b"
    (b / "hopper" / "flash_attn_3").mkdir(parents=True)
    (b / "hopper" / "flash_attn_interface.py").write_text("import flash_attn_3._C\n")
    p = {"build_dir": str(b), "commit": "c1", "hdims": [64, 128], "features": [], "backward": True}
    assert not build_fa3.up_to_date(p)
    (b / "hopper" / "flash_attn_3" / "_C.abi3.so").write_bytes(b"")
    (b / build_fa3.BUILD_INFO).write_text(json.dumps(dict(p, seconds=1.0)))
    assert build_fa3.up_to_date(p)
    assert not build_fa3.up_to_date(dict(p, hdims=[128]))
    assert not build_fa3.up_to_date(dict(p, commit="c2"))
    # Older FA3 snapshots build a top-level flash_attn_3_cuda module instead.
    (b / "hopper" / "flash_attn_interface.py").write_text("import flash_attn_3_cuda\n")
    assert build_fa3.extension_module(b / "hopper") == "flash_attn_3_cuda" and build_fa3.built_library(b) is None
    (b / "hopper" / "flash_attn_3_cuda.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert build_fa3.built_library(b).endswith("flash_attn_3_cuda.cpython-311-x86_64-linux-gnu.so")


@pytest.mark.skipif(build_fa3.built_library(build_fa3.DEFAULT_BUILD_DIR) is None,
                    reason="FA3 not built in build/peers/fa3")
def test_load_a_real_build():
    fa3 = fa3_peer.load_fa3()
    assert callable(fa3.flash_attn_func) and fa3.commit != ""
    assert hasattr(torch.ops.flash_attn_3, "bwd") and hasattr(torch.ops.flash_attn_3, "fwd")
    assert (fa3.flash_attn_varlen_func is None) == ("varlen" not in fa3.info.get("features", []))


# ---------------------------------------------------------------- FA3 call layout and main() on the CPU


def _fa3_signature(name):
    """The parameter list of FA3's `name` as written in the checkout's interface
    (read with ast: importing it needs the compiled extension)."""
    import ast
    import inspect

    path = os.path.join(FA3_SRC, "hopper", "flash_attn_interface.py")
    tree = ast.parse(open(path).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    defaults = [inspect.Parameter.empty] * (len(fn.args.args) - len(fn.args.defaults)) + [
        ast.literal_eval(d) for d in fn.args.defaults]
    return inspect.Signature([inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                              for a, d in zip(fn.args.args, defaults)])


class _FakeFA3Module:
    """Stands in for flash_attn_interface: binds each call to FA3's real signature
    and answers with the fp32 reference, so a wrong argument layout shows."""

    def __init__(self, fwd_sig, bwd_sig):
        self.fwd_sig, self.bwd_sig, self.calls = fwd_sig, bwd_sig, []
        self.flash_attn_func = self.flash_attn_varlen_func = object()

    def _flash_attn_forward(self, *args, **kwargs):
        from dash_fa3 import reference

        a = self.fwd_sig.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        self.calls.append(("fwd", a))
        out, lse = reference.attention_ref(a["q"], a["k"], a["v"], a["softmax_scale"], a["causal"])
        return out.to(a["q"].dtype), lse, torch.empty(0), torch.empty(0)

    def _flash_attn_backward(self, *args, **kwargs):
        from dash_fa3 import reference

        a = self.bwd_sig.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        self.calls.append(("bwd", a))
        grads = reference.attention_bwd_ref(a["dout"], a["q"], a["k"], a["v"], a["out"], a["softmax_scale"],
                                            a["is_causal"])
        for dst, g in zip((a["dq"], a["dk"], a["dv"]), grads):
            dst.copy_(g)
        return torch.empty(0)


def _fake_fa3():
    if not os.path.isfile(os.path.join(FA3_SRC, "hopper", "flash_attn_interface.py")):
        pytest.skip("no FA3 checkout: set FA3_SRC")
    module = _FakeFA3Module(_fa3_signature("_flash_attn_forward"), _fa3_signature("_flash_attn_backward"))
    info = {"commit": build_fa3.PINNED_COMMIT, "hdims": [64, 128], "features": []}
    return fa3_peer.FA3(module, module.flash_attn_func, None, info, "fake")


def test_fa3_calls_bind_to_fa3s_signatures():
    fa3 = _fake_fa3()
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 64, 2, 64, generator=g).bfloat16() for _ in range(4))
    out, lse = fa3_peer.forward(fa3, q, k, v, causal=True)
    fwd = fa3.module.calls[-1][1]
    assert fwd["causal"] is True and fwd["softmax_scale"] == 64 ** -0.5 and fwd["num_splits"] == 1
    assert fwd["window_size_left"] == fwd["window_size_right"] == -1 and fwd["softcap"] == 0.0
    assert all(fwd[n] is None for n in ("k_new", "v_new", "qv", "out_", "cu_seqlens_q", "page_table", "q_descale"))
    for det in (False, True):
        dq, dk, dv = fa3_peer.backward(fa3, dout, q, k, v, out, lse, causal=True, deterministic=det)
        bwd = fa3.module.calls[-1][1]
        assert bwd["deterministic"] is det and bwd["is_causal"] is True and bwd["softmax_scale"] == 64 ** -0.5
        assert bwd["dq"] is dq and bwd["dk"] is dk and bwd["dv"] is dv and bwd["sm_margin"] == 0
        assert bwd["window_size_left"] == bwd["window_size_right"] == -1 and bwd["softcap"] == 0.0
        assert all(bwd[n] is None for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
    # preallocate: the same dq/dk/dv every call; otherwise fresh ones, as FA3's autograd allocates.
    run = fa3_peer.backward_fn(fa3, q, k, v, dout, True, True, preallocate=True)
    assert run()[0] is run()[0]
    run = fa3_peer.backward_fn(fa3, q, k, v, dout, True, True)
    assert run()[0] is not run()[0]


def test_main_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    """main() with the GPU pieces swapped for CPU ones: our ops' CPU path, a fake
    FA3 on the reference, CPU timers; cuDNN is unavailable on the CPU, which
    exercises the n/a path."""
    from dash_fa3 import _timing

    fa3 = _fake_fa3()
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"total_tokens": 256, "hidden": 128, "headdims": [64], "seqlens": [128, 256],
                                "masks": ["full", "causal"]}))
    monkeypatch.setattr(bp, "GRID", str(grid))
    monkeypatch.setattr(bp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bp.torch.cuda, "get_device_name", lambda *a: "CPU stand-in")
    monkeypatch.setattr(bp.torch.backends.cudnn, "version", lambda: 0)
    monkeypatch.setattr(bp, "load_peer", lambda args: (fa3, None))
    monkeypatch.setattr(bp, "median_ms", lambda fn, **kw: _timing.median_ms(fn, device="cpu", **kw))

    def cpu_inputs(p, seed):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(p["batch"], p["seqlen"], p["heads"], p["hdim"], generator=g).bfloat16()
                     for _ in range(4))

    monkeypatch.setattr(bp, "make_inputs", cpu_inputs)
    monkeypatch.setenv("DASH_FA3_COMMIT", "test123")
    js, png = tmp_path / "peers.json", tmp_path / "ratios.png"
    assert bp.main(["--rounds", "2", "--iters", "2", "--warmup", "0", "--schedules", "shift,spt",
                    "--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "CPU stand-in" in out and "test123" in out and build_fa3.PINNED_COMMIT[:12] in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 64 |")]
    assert len(rows) == 4 and all("WARN FA3" not in r for r in rows)
    assert all("cuDNN not checked" in r for r in rows)  # cuDNN cannot run on the CPU
    assert out.count("cuDNN fwd: n/a") == 1 and out.count("cuDNN bwd: n/a") == 1  # reported once
    assert [ln.split("|")[1].strip() for ln in out.splitlines()[-3:]] == ["min", "median", "max"]
    data = json.loads(js.read_text())
    assert data["commit"] == "test123" and data["fa3_commit"] == build_fa3.PINNED_COMMIT
    for p in data["points"]:
        assert set(p["round_ms"]) == {"ours fwd", "FA3 fwd", "ours nd", "ours det shift", "ours det spt",
                                      "ours auto", "FA3 nd", "FA3 det"}
        assert all(len(v) == 2 for v in p["round_ms"].values())  # one timing per round
        assert all(len(r) == 2 for v in p["samples_ms"].values() for r in v)  # --iters raw samples each
        assert p["tflops"]["cuDNN bwd"] is None and p["ratios"]["nd/FA3 nd"] is not None
        assert max(p["check"]["FA3"].values()) < 0.02  # the reference on both sides
        assert p["best_det_schedule"] in ("shift", "spt")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # Both directions of FA3's backward ran, with the deterministic flag passed through.
    assert {c[1]["deterministic"] for c in fa3.module.calls if c[0] == "bwd"} == {False, True}


def test_nd_only_drops_every_deterministic_backward():
    names = bp.impl_names("both", bp.DEFAULT_SCHEDULES)
    kept = bp.nondeterministic(names)
    assert set(kept) == {"FA3 fwd", "FA4 fwd", "cuDNN fwd", "ours fwd", "FA3 nd", "FA4 nd", "cuDNN bwd",
                         "ours nd"}
    assert "ours nd" in kept and "FA3 nd" in kept


def test_pair_cells_time_the_six_calls_and_report_errors(monkeypatch):
    """The row cells of bench_window / bench_varlen: TFLOP/s of the median round, ratios, n/a on errors."""
    ms = {"ours fwd": [2.0, 1.0, 3.0], "FA3 fwd": [4.0, 4.0, 4.0], "ours nd": [5.0, 5.0, 5.0],
          "FA3 nd": [10.0, 10.0, 10.0], "ours det": [10.0, 10.0, 10.0]}

    def fake_time_point(fns, errors, rounds, warmup, iters):
        assert list(fns) == list(bp.PAIR_COLUMNS) and (rounds, warmup, iters) == (3, 1, 2)
        errors["FA3 det"] = "boom"
        return ms, {}

    monkeypatch.setattr(bp, "time_point", fake_time_point)
    args = type("A", (), {"rounds": 3, "warmup": 1, "iters": 2})()
    cells = bp.pair_cells({n: None for n in bp.PAIR_COLUMNS}, 1e12, (1e-5, 2e-4), args).split(" | ")
    assert len(cells) == bp.PAIR_HEADER.count("|") + 1
    # 1e12 flops forward: 2 ms median -> 500 TFLOP/s; the backward counts 2.5x.
    assert cells[:6] == ["500", "250", "500", "250", "250", "n/a (boom)"]
    assert cells[6:] == ["2.00", "2.00", "n/a", "0.50", "1.0e-05, 2.0e-04"]


def test_pair_table_start_prints_title_and_header(monkeypatch, capsys):
    """The title and header of bench_window / bench_varlen; no GPU: one-line error, None."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = type("A", (), {"rounds": 3, "commit": "abc1234", "fa3_build": "/b"})()
    assert bp.pair_table_start("bench_x", "things", "details", ["a", "b"], args) is None
    assert capsys.readouterr().err == "bench_x: needs a CUDA GPU\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "GPU X")
    fake = type("F", (), {"commit": "fa3c0ffee"})()
    monkeypatch.setattr(fa3_peer, "load_fa3", lambda build: fake if build == "/b" else None)
    assert bp.pair_table_start("bench_x", "things", "details", ["a", "b"], args) is fake
    title, header, rule = capsys.readouterr().out.splitlines()
    assert title.startswith("# things, GPU X, ") and "commit abc1234, FA3 fa3c0ffee; details; median of 3" in title
    assert header == f"| a | b | {bp.PAIR_HEADER} |"
    assert rule.count("---") == header.count("|") - 1


def test_fa3_packed_documents_need_a_varlen_build():
    dense_only = fa3_peer.FA3(None, None, None, {}, "/nowhere")
    assert fa3_peer._packed(dense_only, None) == (None, None, None, None)
    with pytest.raises(fa3_peer.FA3NotBuilt, match="--features varlen"):
        fa3_peer._packed(dense_only, ("cu", "cu", 8, 8))
    with_varlen = fa3_peer.FA3(None, None, object(), {}, "/b")
    assert fa3_peer._packed(with_varlen, ("cu", "ck", 8, 9)) == ("cu", "ck", 8, 9)


# ---------------------------------------------------------------- fa3_suite: the adapter of FA3's tests

FA3_TEST_SNIPPET = """\
def test_flash_attn_output(d, dtype):
    dv_vals = [128, d] if d > 128 and d <= 192 else ([256, 512, d] if d <= 64 else [d])
    if dtype == torch.float8_e4m3fn:
        dv_vals = [d]
    attention_chunk_vals = [torch.randint(1, 9, (1,)).item(), 0] if not DISABLE_LOCAL else [0]
    for dv, attention_chunk in itertools.product(dv_vals, attention_chunk_vals):
        pass
"""


def test_fa3_suite_rewrites_the_unsupported_loop_lists():
    out = fa3_suite.rewrite_test_source(FA3_TEST_SNIPPET)
    assert "dv_vals = [d]  #" in out and "[256, 512, d]" not in out
    assert "attention_chunk_vals = [0]  #" in out and "randint" not in out
    # Indentation kept, the loop itself untouched.
    assert "        dv_vals = [d]  #" in out
    assert "    for dv, attention_chunk in itertools.product(dv_vals, attention_chunk_vals):" in out
    compile(out, "test_flash_attn.py", "exec")


def test_fa3_suite_refuses_an_unknown_test_layout():
    with pytest.raises(SystemExit, match="attention_chunk_vals"):
        fa3_suite.rewrite_test_source(FA3_TEST_SNIPPET.replace("attention_chunk_vals =", "chunks ="))


def test_fa3_suite_switches_follow_the_build():
    env = fa3_suite.disable_switches(["hdim64-bf16-causal", "hdim64-bf16-full", "hdim128-fp16-local"])
    for feature in ("FP8", "SPLIT", "PACKGQA", "SOFTCAP", "PAGEDKV", "APPENDKV", "HDIM96", "HDIM192", "HDIM256"):
        assert env[f"FLASH_ATTENTION_DISABLE_{feature}"] == "TRUE"
    assert "FLASH_ATTENTION_DISABLE_HDIM64" not in env and "FLASH_ATTENTION_DISABLE_HDIM128" not in env
    assert "FLASH_ATTENTION_DISABLE_FP16" not in env
    assert fa3_suite.disable_switches(["hdim128-bf16-causal"])["FLASH_ATTENTION_DISABLE_FP16"] == "TRUE"
    # softcap stays in FA3's tests only when every built variant has its softcap kernels
    built = ["hdim128-bf16-causal", "hdim128-bf16-full"]
    assert "FLASH_ATTENTION_DISABLE_SOFTCAP" not in fa3_suite.disable_switches(built, built + ["hdim64-bf16-full"])
    assert fa3_suite.disable_switches(built, built[:1])["FLASH_ATTENTION_DISABLE_SOFTCAP"] == "TRUE"


def test_fa3_suite_missing_checkout_exits_2(tmp_path, capsys):
    assert fa3_suite.main(["--src", str(tmp_path)]) == 2
    assert "lacks test_flash_attn.py" in capsys.readouterr().err


def test_points_where_our_nd_runs_the_deterministic_mode():
    grid = json.load(open(bp.GRID))
    points = bp.grid_points(grid, [64, 128], grid["seqlens"], ["full", "causal"])
    ordered = {(p["hdim"], p["mask"], p["seqlen"]) for p in points if bp.nd_runs_ordered(p)}
    # 512 (full and causal) and causal 1024 at both head dims: at most 4.5 dQ adds per Q tile.
    assert ordered == {(d, m, s) for d in (64, 128) for m, s in (("full", 512), ("causal", 512), ("causal", 1024))}
