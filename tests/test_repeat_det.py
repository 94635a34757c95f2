"""benchmarks/repeat_det.py on the CPU: what it would run, and its refusals of bad arguments."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import repeat_det  # noqa: E402

from dash_fa3.schedule import SCHEDULES  # noqa: E402


def test_dry_run_says_what_it_would_run(capsys):
    """Every deterministic schedule and auto by default, then the non-deterministic reference; the shape
    and mask as given."""
    assert repeat_det.main(["--dry-run", "--runs", "5", "--shape", "1,256,384,8,2", "--hdim", "64", "--full"]) == 0
    out = capsys.readouterr().out
    assert "b1 256x384 h8/2 d64 full" in out and "5 rounds" in out
    assert out.strip().endswith(", ".join(SCHEDULES + ("auto", "nd")))
    assert repeat_det.main(["--dry-run", "--schedules", "shift,spt"]) == 0
    assert capsys.readouterr().out.strip().endswith("shift, spt, nd")


@pytest.mark.parametrize("argv", [["--schedules", "spt,nope"], ["--shape", "2,64,64,6,4"], ["--shape", "1,2,3"],
                                  ["--runs", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        repeat_det.main(["--dry-run", *argv])
    assert e.value.code == 2
