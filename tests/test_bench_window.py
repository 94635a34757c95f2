"""benchmarks/bench_window.py's CPU parts: the window's entry count (its FLOP count)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_window  # noqa: E402


@pytest.mark.parametrize("n,left,right", [(8, 2, 0), (9, -1, 0), (7, -1, -1), (10, 3, 2), (6, 0, 0), (5, 10, 10)])
def test_window_entries_counts_the_mask(n, left, right):
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    inside = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        inside &= j >= i - left
    if right >= 0:
        inside &= j <= i + right
    assert bench_window.window_entries(n, left, right) == int(inside.sum())

