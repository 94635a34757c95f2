"""bench_cp_compute's pure parts on the CPU: what a round times and the bound it prints."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_cp_compute as B  # noqa: E402


def test_items_are_the_plans_ranks():
    work = B.items([2, 4], 8)
    assert work[0] == ("T1", 0, 0, 8)
    assert work[1:3] == [(2, 0, 0, 4), (2, 1, 4, 8)]
    assert [w[2:] for w in work[3:]] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_bound_is_t1_over_p_times_the_slowest_rank():
    per = {(2, 0): 50.0, (2, 1): 55.0, (4, 0): 26.0, (4, 1): 25.0, (4, 2): 25.0, (4, 3): 25.0}
    b = B.bounds(100.0, per, [2, 4])
    assert b[2] == (55.0, 50.0, pytest.approx(100 / 110))
    assert b[4][2] == pytest.approx(100 / 104)


def test_arguments_are_checked():
    a = B.parse_args(["--P", "2,4", "--tokens", "64k", "--heads", "32/8,16/16", "--modes", "det"])
    assert (a.P, a.tokens, a.heads, a.modes) == ([2, 4], [65536], [(32, 8), (16, 16)], ["det"])
    for bad in (["--P", "16", "--heads", "32/8"], ["--tokens", "1000"], ["--modes", "fast"], ["--P", "0"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def test_steps_balance_of_a_rank():
    # MHA 16/16 at 64k tokens, deterministic: symmetric_shift units (KV tile pairs) over 132 CTAs;
    # 16 heads x 256 units: 31.0 per CTA on average, 32 on the busiest; half the heads: 15.5 and 16
    full = B.steps_balance(16, 16, 65536, True, 0, 16, 132)
    half = B.steps_balance(16, 16, 65536, True, 0, 8, 132)
    assert full == pytest.approx(32 / (4096 / 132), rel=1e-9)
    assert half == pytest.approx(16 / (2048 / 132), rel=1e-9)
    assert B.steps_balance(16, 16, 65536, False, 0, 8, 132) is None     # lpt: claimed at run time
