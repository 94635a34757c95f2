"""tools/sim_fuzz.py runs (a few shapes; the tool's 10 000 are a measurement, docs/journal/results.md)."""

import importlib.util
from pathlib import Path

from dash_fa3.schedule import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sim_fuzz", ROOT / "tools" / "sim_fuzz.py")
sim_fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_fuzz)


def test_sim_fuzz_passes_a_few_shapes(capsys):
    assert sim_fuzz.main(["--shapes", "6", "--seed", "11"]) == 0
    out = capsys.readouterr().out
    assert f"6 shapes, {6 * len(SCHEDULES)} schedules validated and simulated, 0 failures" in out
