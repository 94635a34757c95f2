"""The kernel contract compiled with the host compiler: the C++ schedule decode
(csrc/schedules/schedule_metadata.h), the block ranges (csrc/common/block_range.h)
and the generated tile sizes (kernel_contract.h) against their Python
definitions, on every bench-grid schedule and on random shapes.

tests/cpp/contract_driver.cpp includes the kernels' own headers; no CUDA, no
nvcc, no GPU. A change to one language alone fails here.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dash_fa3.schedule import SCHEDULES, Geometry, bwd_block_sizes, build_schedule
from dash_fa3.schedule.export import DEFAULT_GRID, grid_geometries, read_bundle, write_bundle
from dash_fa3.schedule.geometry import TileGeometry
from dash_fa3.schedule.metadata import decode_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_config  # noqa: E402

SMS = (132, 114, 7)  # H100/H200 SXM, H100 PCIe, a small count (many waves)


GRID = list(grid_geometries(DEFAULT_GRID))


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) for the contract cross-check")
    out = tmp_path_factory.mktemp("contract")
    build_config.write_contract_header(out)
    exe = out / "contract_driver"
    cmd = [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT}/csrc", f"-I{out}",
           os.path.join(ROOT, "tests", "cpp", "contract_driver.cpp"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(exe)


def run_driver(exe, *args, stdin: str = "") -> np.ndarray:
    proc = subprocess.run([exe, *args], input=stdin.encode(), capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    return np.frombuffer(proc.stdout, dtype=np.int32)


def check_decode(exe, tmp_path, metas, what):
    path = tmp_path / "bundle.i32"
    write_bundle(path, metas)
    got = run_driver(exe, "decode", str(path)).reshape(-1, 2)
    pos = 0
    for meta in metas:
        _, _, q, rank = decode_all(meta.header, meta.tasks)
        mine = got[pos:pos + q.size]
        pos += q.size
        name = SCHEDULES[int(meta.header[2])]
        assert mine.shape[0] == q.size, f"{what} {name}: C++ decoded {mine.shape[0]} steps, Python {q.size}"
        for col, want, label in ((0, q, "Q tile"), (1, rank, "rank")):
            bad = np.flatnonzero(mine[:, col] != want)
            assert bad.size == 0, (f"{what} {name}: step {bad[0]} {label} C++ {mine[bad[0], col]} != "
                                   f"Python {want[bad[0]]} ({bad.size} steps differ)")
    assert pos == got.shape[0]


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("label,g", GRID, ids=[lbl for lbl, _ in GRID])
def test_decode_bench_grid(driver, tmp_path, label, g, sms):
    metas = [build_schedule(name, g, sms, validate=False).meta for name in SCHEDULES]
    check_decode(driver, tmp_path, metas, f"{label} sms={sms}")


def random_geometry(rng) -> Geometry:
    heads_kv = int(rng.integers(1, 4))
    bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
    if rng.random() < 0.5:
        bm, bn = bwd_block_sizes(int(rng.choice([64, 96, 128, 192, 256])))
    return Geometry(batch=int(rng.integers(1, 4)), heads=heads_kv * int(rng.integers(1, 4)), heads_kv=heads_kv,
                    seqlen_q=int(rng.integers(1, 2500)), seqlen_k=int(rng.integers(1, 2500)),
                    block_m=bm, block_n=bn, mask=str(rng.choice(["full", "causal"])))


@pytest.mark.parametrize("seed", range(6))
def test_decode_random_shapes(driver, tmp_path, seed):
    rng = np.random.default_rng(seed)
    metas = []
    for _ in range(8):
        g = random_geometry(rng)
        for sms in (132, 114, int(rng.integers(1, 10))):
            metas += [build_schedule(name, g, sms, validate=False).meta for name in SCHEDULES]
    check_decode(driver, tmp_path, metas, f"seed {seed}")


def geometry_cases():
    rng = np.random.default_rng(3)
    cases = [(128, 128, 64, 64, 1), (300, 100, 64, 32, 1), (512, 64, 64, 128, 1), (64, 512, 64, 128, 1),
             (1, 1, 64, 64, 1), (257, 129, 64, 128, 0), (1000, 1000, 64, 128, 1), (1100, 333, 64, 128, 1)]
    for _ in range(300):
        sq, sk = (int(x) for x in rng.integers(1, 1200, size=2))
        bm, bn = (int(x) for x in rng.choice([16, 32, 64, 96, 128], size=2))
        cases.append((sq, sk, bm, bn, int(rng.integers(2))))
    return cases


def test_block_ranges(driver):
    cases = geometry_cases()
    got = run_driver(driver, "geometry", stdin="\n".join(" ".join(map(str, c)) for c in cases))
    pos = 0
    for sq, sk, bm, bn, causal in cases:
        t = TileGeometry(sq, sk, bm, bn, bool(causal))
        qs, kvs = np.arange(t.n_q), np.arange(t.n_kv)
        want = np.concatenate([
            np.stack([*t.kv_range(qs), t.kv_unmasked_end(qs)], axis=1).ravel(),
            np.stack([*t.q_range(kvs), t.q_unmasked_begin(kvs)], axis=1).ravel(),
        ])
        mine = got[pos:pos + want.size]
        pos += want.size
        assert np.array_equal(mine, want), f"TileGeometry{(sq, sk, bm, bn, bool(causal))}: C++ and Python differ"
    assert pos == got.size


def test_bwd_block_sizes(driver):
    dims = list(range(-1, 300))
    got = run_driver(driver, "blocks", stdin=" ".join(map(str, dims))).reshape(-1, 2)
    for d, (bm, bn) in zip(dims, got):
        try:
            want = bwd_block_sizes(d)
        except ValueError:
            want = (0, 0)
        assert (int(bm), int(bn)) == want, f"head dim {d}: C++ {(int(bm), int(bn))}, Python {want}"


def test_bundle_round_trip(tmp_path):
    g = Geometry(2, 4, 2, 700, 300, 64, 128, "causal")
    metas = [build_schedule(name, g, 5).meta for name in SCHEDULES]
    write_bundle(tmp_path / "b.i32", metas)
    back = read_bundle(tmp_path / "b.i32")
    assert len(back) == len(metas)
    for a, b in zip(metas, back):
        assert np.array_equal(a.as_int32_array(), b.as_int32_array())
