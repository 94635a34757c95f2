"""The order of the backward's row statistics within a Q tile: the C++
definition (csrc/common/row_stat_layout.h, compiled with the host compiler by
tests/cpp/row_stat_driver.cpp) against the Python mirror
(dash_fa3.bwd_layouts), and the properties the kernel relies on. No GPU."""

import os
import shutil
import subprocess

import numpy as np
import pytest

from dash_fa3.bwd_layouts import ROW_STAT_QUADS, row_stat_pos, row_stat_positions, row_stat_row
from dash_fa3.schedule.contract import BWD_BLOCK_SIZES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every backward tile's block_m, the two the kernels use, and a few more multiples of 8.
BLOCK_MS = sorted({bm for bm, _ in BWD_BLOCK_SIZES.values()} | {8, 16, 32, 64, 128, 192, 256})


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) for the row statistics cross-check")
    exe = tmp_path_factory.mktemp("row_stat") / "row_stat_driver"
    cmd = [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT}/csrc",
           os.path.join(ROOT, "tests", "cpp", "row_stat_driver.cpp"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(exe)


def test_cpp_matches_python(driver):
    proc = subprocess.run([driver], input=" ".join(map(str, BLOCK_MS)).encode(), capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    got = np.frombuffer(proc.stdout, dtype=np.int32)
    pos = 0
    for bm in BLOCK_MS:
        n = np.arange(bm)
        for label, want in (("row_stat_pos", row_stat_pos(bm, n)), ("row_stat_row", row_stat_row(bm, n))):
            mine = got[pos:pos + bm]
            pos += bm
            assert np.array_equal(mine, want), f"{label}(block_m={bm}): C++ {mine.tolist()} != Python {want.tolist()}"
    assert pos == got.size


@pytest.mark.parametrize("bm", BLOCK_MS)
def test_bijection_and_inverse(bm):
    n = np.arange(bm)
    pos = row_stat_pos(bm, n)
    assert np.array_equal(np.sort(pos), n), "not a permutation of the tile"
    assert np.array_equal(row_stat_row(bm, pos), n)
    assert np.array_equal(row_stat_pos(bm, row_stat_row(bm, n)), n)


@pytest.mark.parametrize("bm", BLOCK_MS)
def test_each_quad_contiguous(bm):
    """The rows a thread with lane % 4 = t holds in the transposed accumulator,
    8j + 2t + {0, 1} in register order, sit at t * bm/4 + 0, 1, 2, ...: one
    contiguous run per t (16-byte aligned when bm % 16 == 0, as the kernel asserts)."""
    run = bm // ROW_STAT_QUADS
    for t in range(ROW_STAT_QUADS):
        rows = np.array([8 * j + 2 * t + c for j in range(bm // 8) for c in (0, 1)])
        assert np.array_equal(row_stat_pos(bm, rows), t * run + np.arange(run))


def test_positions_gather_rows():
    bm, tiles = 64, 3
    rows = np.arange(tiles * bm)
    buf = np.empty_like(rows)
    buf[row_stat_positions(bm, rows.size)] = rows  # what the preprocess writes
    assert np.array_equal(buf[row_stat_positions(bm, rows.size)], rows)
    assert np.array_equal(buf[:bm], row_stat_row(bm, np.arange(bm)))
    assert np.array_equal(buf[bm:2 * bm] - bm, row_stat_row(bm, np.arange(bm)))


def test_rejects_bad_block_m():
    with pytest.raises(ValueError):
        row_stat_pos(12, 0)
    with pytest.raises(ValueError):
        row_stat_positions(64, 100)
