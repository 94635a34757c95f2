"""benchmarks/bar_call.sh refuses what it cannot run before it builds anything."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bar_call.sh"


def run(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "DASH_FA3_COMMIT"} | env_extra
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_needs_the_commit_it_measures():
    r = run({})
    assert r.returncode != 0 and "set DASH_FA3_COMMIT" in r.stderr


def test_unknown_steps_are_refused(tmp_path):
    r = run({"DASH_FA3_COMMIT": "abc1234", "STEPS": "tests bogus", "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and "unknown step 'bogus'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_ab_needs_a_base_tree(tmp_path):
    r = run({"DASH_FA3_COMMIT": "abc1234", "STEPS": "ab", "BASE": str(tmp_path / "none"), "OUT": str(tmp_path / "o")})
    assert r.returncode == 2 and "step ab needs BASE" in r.stderr
