"""benchmarks/bench_varlen.py's CPU parts: the document mix and its FLOP count."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_varlen = pytest.importorskip("bench_varlen")


@pytest.mark.parametrize("seed", range(5))
def test_document_mix(seed):
    lengths = bench_varlen.document_mix(16384, 64, 8192, seed)
    assert sum(lengths) == 16384
    assert all(64 <= n <= 8192 for n in lengths[:-1]) and 1 <= lengths[-1] <= 8192
    assert lengths == bench_varlen.document_mix(16384, 64, 8192, seed)  # fixed by the seed


def test_causal_entries_count_the_kept_scores():
    lengths = [1, 5, 64, 77]
    brute = sum(1 for n in lengths for i in range(n) for j in range(n) if j <= i)
    assert bench_varlen.causal_entries(lengths) == brute
