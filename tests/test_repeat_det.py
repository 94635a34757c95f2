"""benchmarks/repeat_det.py on the CPU: what it would run, and its refusals of bad arguments."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import repeat_det  # noqa: E402

from dash_fa3.schedule import SCHEDULES  # noqa: E402


def test_dry_run_lists_every_schedule_then_nd(capsys):
    assert repeat_det.main(["--dry-run", "--runs", "5"]) == 0
    out = capsys.readouterr().out
    assert "b2 2048x2048 h16/4 d128 causal" in out and "5 rounds" in out
    assert out.strip().endswith(", ".join(SCHEDULES + ("auto", "nd")))


@pytest.mark.parametrize("argv", [["--schedules", "spt,nope"], ["--shape", "2,64,64,6,4"], ["--shape", "1,2,3"],
                                  ["--runs", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        repeat_det.main(["--dry-run", *argv])
    assert e.value.code == 2
