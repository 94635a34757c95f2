"""benchmarks/ab_summary.py: medians pooled over runs, ratios to the base build (CPU only)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab_summary  # noqa: E402

BWD_FLOPS = 1e12  # 1e12 FLOPs: a round of t ms is 1e3 / t TFLOP/s


def run_json(path, commit, rounds):
    """A bench_peers.py --json stand-in: one point, round times in ms per implementation."""
    pt = {"hdim": 128, "mask": "causal", "seqlen": 1024, "flops": {"fwd": BWD_FLOPS / 2.5, "bwd": BWD_FLOPS},
          "round_ms": rounds}
    path.write_text(json.dumps({"commit": commit, "points": [pt]}))


def test_pools_rounds_of_every_run_and_divides_by_the_base(tmp_path):
    run_json(tmp_path / "a_1.json", "aaa", {"ours nd": [2.0, 2.0, 4.0], "ours fwd": [1.0]})
    run_json(tmp_path / "a_2.json", "aaa", {"ours nd": [2.5, 2.5, 2.5], "ours fwd": [1.0]})
    run_json(tmp_path / "b_1.json", "bbb", {"ours nd": [2.0, 2.0, 2.0], "ours fwd": [0.5]})
    builds = [("base", ab_summary.load_runs(str(tmp_path / "a_*.json"))),
              ("new", ab_summary.load_runs(str(tmp_path / "b_*.json")))]
    rows = {r[1]: r for r in ab_summary.summarize(builds, None)}
    # base "ours nd": TFLOP/s 500, 500, 250, 400, 400, 400 -> median 400; new: 500 -> 1.25x
    assert rows["ours nd"][:3] == ["hdim 128 causal 1024", "ours nd", "400"]
    assert rows["ours nd"][3] == "500 (1.250x)"
    # the forward uses the forward's FLOPs: 0.4e12 / 1 ms = 400, / 0.5 ms = 800
    assert rows["ours fwd"][2:] == ["400", "800 (2.000x)"]


def test_an_implementation_the_other_build_lacks_is_na(tmp_path):
    run_json(tmp_path / "a.json", "a", {"ours nd": [1.0], "ours det spt": [1.0]})
    run_json(tmp_path / "b.json", "b", {"ours nd": [1.0]})
    builds = [("a", ab_summary.load_runs(str(tmp_path / "a.json"))), ("b", ab_summary.load_runs(str(tmp_path / "b.json")))]
    rows = ab_summary.summarize(builds, ["ours det spt"])
    assert rows == [["hdim 128 causal 1024", "ours det spt", "1000", "n/a"]]


def test_cli_table_and_errors(tmp_path):
    run_json(tmp_path / "a.json", "a", {"ours nd": [1.0]})
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_summary.py"), f"x={tmp_path / 'a.json'}",
                          f"y={tmp_path / 'a.json'}"], capture_output=True, text=True, check=True).stdout
    assert "| point | implementation | x | y |" in out and "1000 (1.000x)" in out
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_summary.py"), f"x={tmp_path / 'none*.json'}"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no file matches" in bad.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_summary.py"), "nolabel"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "LABEL=GLOB" in bad.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_ab_builds_script_parses_and_requires_trees():
    script = ROOT / "benchmarks" / "ab_builds.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode != 0 and "TREES" in res.stderr


def test_best_deterministic_over_nd_per_build(tmp_path):
    run_json(tmp_path / "a.json", "a", {"ours nd": [1.0], "ours det spt": [2.0], "ours det shift": [1.25]})
    run_json(tmp_path / "b.json", "b", {"ours nd": [1.0], "ours det spt": [1.1]})
    run_json(tmp_path / "c.json", "c", {"ours nd": [1.0]})
    builds = [(n, ab_summary.load_runs(str(tmp_path / f"{n}.json"))) for n in "abc"]
    assert ab_summary.det_over_nd(builds) == [["hdim 128 causal 1024", "0.800 (shift)", "0.909 (spt)", "n/a"]]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_summary.py"), f"a={tmp_path / 'a.json'}",
                          f"b={tmp_path / 'b.json'}"], capture_output=True, text=True, check=True).stdout
    assert "best deterministic / non-deterministic" in out and "| hdim 128 causal 1024 | 0.800 (shift) | 0.909 (spt) |" in out
