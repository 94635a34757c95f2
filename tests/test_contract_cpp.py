"""The kernel contract compiled with the host compiler: the C++ schedule decode
(csrc/schedules/schedule_metadata.h), the block ranges (csrc/common/block_range.h),
the generated tile sizes (kernel_contract.h) and the dQ fragment order
(csrc/common/dq_accum_layout.h) against their Python definitions, on every
bench-grid schedule, on random shapes and on every element of the dQ tiles.

tests/cpp/contract_driver.cpp includes the kernels' own headers; no CUDA, no
nvcc, no GPU. A change to one language alone fails here. One check more,
test_dq_fragment_order_is_cutes, compiles the backward's traits with nvcc (host
code only, no GPU; skipped without nvcc) to compare the fragment order with the
register layout of cute's own dQ MMA.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dash_fa3 import bwd_layouts, fwd_order
from dash_fa3.schedule import SCHEDULES, Geometry, bwd_block_sizes, build_schedule, schedules_for
from dash_fa3.schedule.export import DEFAULT_GRID, grid_geometries, read_bundle, write_bundle
from dash_fa3.schedule.contract import BWD_BLOCK_SIZES, BWD_CHAINS, BWD_MMA_WARPGROUPS, bwd_entry
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
    metas = [build_schedule(name, g, sms, validate=False).meta for name in schedules_for(g)]
    check_decode(driver, tmp_path, metas, f"{label} sms={sms}")


RECT = [(2, 4, 2, 1024, 8192, 64, 128, "causal"), (4, 16, 16, 512, 4096, 128, 128, "causal"),
        (8, 16, 2, 256, 8192, 64, 128, "causal"), (1, 8, 2, 2048, 32768, 128, 128, "full"),
        (3, 5, 1, 300, 5000, 64, 128, "full")]


@pytest.mark.parametrize("sms", [132, 16])
def test_decode_rect_schedules(driver, tmp_path, sms):
    """The C++ decode of the schedules for few queries and many keys on their shapes: several dQ
    splits, heads side by side in sections (interleave, sections), runs and chains, rows of whole
    groups over their virtual Q tiles (grouped_*)."""
    metas = []
    for b, h, hkv, sq, sk, bm, bn, mask in RECT:
        g = Geometry(b, h, hkv, sq, sk, bm, bn, mask)
        names = ("split", "interleave", "sections", "runs", "spt", "grouped_sections", "grouped_shift",
                 "grouped_split")
        metas += [build_schedule(name, g, sms, validate=False).meta for name in names if name in schedules_for(g)]
    check_decode(driver, tmp_path, metas, f"rect sms={sms}")


def random_geometry(rng) -> Geometry:
    heads_kv = int(rng.integers(1, 4))
    bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
    if rng.random() < 0.5:
        bm, bn = bwd_block_sizes(int(rng.choice([64, 96, 128, 192, 256])))
    sq, sk = int(rng.integers(1, 2500)), int(rng.integers(1, 2500))
    mask = str(rng.choice(["full", "causal", "local"]))
    left, right = random_window(rng, sq, sk) if mask == "local" else (-1, -1)
    return Geometry(batch=int(rng.integers(1, 4)), heads=heads_kv * int(rng.integers(1, 4)), heads_kv=heads_kv,
                    seqlen_q=sq, seqlen_k=sk, block_m=bm, block_n=bn, mask=mask, window_left=left,
                    window_right=right)


@pytest.mark.parametrize("seed", range(6))
def test_decode_random_shapes(driver, tmp_path, seed):
    rng = np.random.default_rng(seed)
    metas = []
    for _ in range(8):
        g = random_geometry(rng)
        for sms in (132, 114, int(rng.integers(1, 10))):
            metas += [build_schedule(name, g, sms, validate=False).meta for name in schedules_for(g)]
    check_decode(driver, tmp_path, metas, f"seed {seed}")


def random_window(rng, sq: int, sk: int) -> tuple[int, int]:
    """A window: full, causal, or (left, right) with sides unbounded, 0, small, or past the sequence."""
    kind = int(rng.integers(4))
    if kind < 2:
        return -1, (-1, 0)[kind]
    side = lambda: int(rng.choice([-1, 0, int(rng.integers(0, 64)), int(rng.integers(0, 2 * max(sq, sk) + 2))]))
    return side(), side()


WINDOW_EDGES = [(1000, 1000, 0, 0), (1000, 1000, 256, -1), (1000, 1000, -1, 256), (1000, 1000, 256, 0),
                (300, 1000, 100, 0), (1000, 300, 30, 5), (500, 700, 5000, 5000), (4096, 4096, 1024, 0)]


@pytest.mark.parametrize("sms", SMS)
def test_decode_window_edges(driver, tmp_path, sms):
    """The C++ decode on window geometries: (0, 0), one side, both, wider than the
    sequence, seqlen_q != seqlen_k both ways, every schedule, both backward tile shapes."""
    metas = []
    for sq, sk, left, right in WINDOW_EDGES:
        for bm, bn in ((64, 128), (128, 128)):
            g = Geometry(2, 4, 2, sq, sk, bm, bn, "local", left, right)
            metas += [build_schedule(name, g, sms, validate=False).meta for name in schedules_for(g)]
    check_decode(driver, tmp_path, metas, f"windows sms={sms}")


def geometry_cases():
    rng = np.random.default_rng(3)
    cases = [(128, 128, 64, 64, -1, 0), (300, 100, 64, 32, -1, 0), (512, 64, 64, 128, -1, 0),
             (64, 512, 64, 128, -1, 0), (1, 1, 64, 64, -1, 0), (257, 129, 64, 128, -1, -1),
             (1000, 1000, 64, 128, -1, 0), (1100, 333, 64, 128, -1, 0),
             # windows: (0, 0), left or right only, both, wider than the sequence, seqlen_q != seqlen_k
             (1000, 1000, 64, 128, 0, 0), (1000, 1000, 64, 128, 100, -1), (1000, 1000, 64, 128, -1, 100),
             (1000, 700, 64, 128, 256, 0), (700, 1000, 128, 128, 64, 64), (300, 900, 64, 128, 5000, 5000),
             (900, 300, 64, 128, 0, 0), (300, 900, 64, 128, 0, 0), (1, 1, 64, 64, 0, 0)]
    for _ in range(400):
        sq, sk = (int(x) for x in rng.integers(1, 1200, size=2))
        bm, bn = (int(x) for x in rng.choice([16, 32, 64, 96, 128], size=2))
        cases.append((sq, sk, bm, bn, *random_window(rng, sq, sk)))
    return cases


def test_block_ranges(driver):
    """csrc/common/block_range.h against geometry.TileGeometry: every range of every tile,
    full, causal and window masks."""
    cases = geometry_cases()
    got = run_driver(driver, "geometry", stdin="\n".join(" ".join(map(str, c)) for c in cases))
    pos = 0
    for c in cases:
        t = TileGeometry(*c)
        qs, kvs = np.arange(t.n_q), np.arange(t.n_kv)
        want = np.concatenate([
            np.stack([*t.kv_range(qs), *t.kv_unmasked(qs)], axis=1).ravel(),
            np.stack([*t.q_range(kvs), *t.q_unmasked(kvs)], axis=1).ravel(),
        ])
        mine = got[pos:pos + want.size]
        pos += want.size
        assert np.array_equal(mine, want), f"TileGeometry{c}: C++ and Python differ"
    assert pos == got.size


def test_bwd_block_sizes(driver):
    """kernel_contract.h's bwd_block_m, bwd_block_n, bwd_mma_warpgroups and bwd_chains against
    the contract's tables, on every head dim (0 / false: no kernel)."""
    dims = list(range(-1, 300))
    got = run_driver(driver, "blocks", stdin=" ".join(map(str, dims))).reshape(-1, 4)
    for d, row in zip(dims, got):
        entry = bwd_entry(d)
        want = (0, 0, 0, 0) if entry is None else (*bwd_block_sizes(d), BWD_MMA_WARPGROUPS[entry],
                                                     int(BWD_CHAINS[entry]))
        assert tuple(int(x) for x in row) == want, f"head dim {d}: C++ {tuple(int(x) for x in row)}, Python {want}"


def test_bundle_round_trip(tmp_path):
    g = Geometry(2, 4, 2, 700, 300, 64, 128, "causal")
    metas = [build_schedule(name, g, 5).meta for name in schedules_for(g)]
    write_bundle(tmp_path / "b.i32", metas)
    back = read_bundle(tmp_path / "b.i32")
    assert len(back) == len(metas)
    for a, b in zip(metas, back):
        assert np.array_equal(a.as_int32_array(), b.as_int32_array())


def test_dq_fragment_order(driver):
    """csrc/common/dq_accum_layout.h against dash_fa3/bwd_layouts.py: layout_ok on
    many (block_m, hdim), and where it holds every element's offset, both from
    (m, c) and from (warpgroup, thread, register)."""
    cases = [(bm, d) for d, (bm, _) in sorted(BWD_BLOCK_SIZES.items())]
    cases += [(bm, d) for bm in (32, 64, 96, 128, 256) for d in range(0, 272, 8)]
    got = run_driver(driver, "dqfrag", stdin="\n".join(f"{bm} {d}" for bm, d in cases))
    pos = 0
    for bm, d in cases:
        ok = bool(got[pos])
        pos += 1
        assert ok == bwd_layouts.layout_ok(bm, d), f"block_m={bm} hdim={d}: C++ layout_ok {ok}"
        if not ok:
            continue
        assert got[pos] == bwd_layouts.atom_cols(bm, d), f"block_m={bm} hdim={d}: C++ atom {got[pos]}"
        pos += 1
        want = bwd_layouts.tile_permutation(bm, d).ravel()
        mine = got[pos:pos + want.size]
        pos += want.size
        assert np.array_equal(mine, want), f"block_m={bm} hdim={d}: dq_frag_offset differs"
        # The postprocess (bwd_postprocess.cu) adds a row part and a column part: the
        # offset of (m, c) is that of (m, 0) plus that of (0, c).
        tile = mine.reshape(bm, d)
        assert np.array_equal(tile, tile[:, :1] + tile[:1, :]), \
            f"block_m={bm} hdim={d}: the fragment offset is not a row part plus a column part"
        wg, tid, r = np.meshgrid(np.arange(bwd_layouts.warpgroups(d)), np.arange(bwd_layouts.WG_THREADS),
                                 np.arange(bwd_layouts.wg_cols(bm, d) // 2), indexing="ij")
        want = bwd_layouts.reg_offset(bm, d, wg, tid, r).ravel()
        mine = got[pos:pos + want.size]
        pos += want.size
        assert np.array_equal(mine, want), f"block_m={bm} hdim={d}: register offsets differ"
    assert pos == got.size


@pytest.fixture(scope="module")
def cute_driver(tmp_path_factory):
    """tests/cpp/dq_frag_cute_driver.cpp: cute's own TiledMmaDq layouts, host code
    compiled by nvcc (cutlass's headers need CUDA's even on the host)."""
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip(f"no nvcc at {nvcc} for the cute layout check")
    try:
        cutlass_include = build_config.cutlass_locator.include_dir()
    except build_config.cutlass_locator.CutlassNotFound as exc:
        pytest.skip(f"no CUTLASS headers for the cute layout check: {exc}")
    out = tmp_path_factory.mktemp("dq_frag_cute")
    build_config.write_contract_header(out)
    exe = out / "dq_frag_cute_driver"
    cmd = [nvcc, "-std=c++17", "-O1", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
           f"-I{ROOT}/csrc", f"-I{out}", f"-I{cutlass_include}", "-x", "cu",
           os.path.join(ROOT, "tests", "cpp", "dq_frag_cute_driver.cpp"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(exe)


def test_dq_fragment_order_is_cutes(cute_driver):
    """Register i of MMA thread t holds the (m, c) that cute's partition_C gives
    it in the kernel's TiledMmaDq: the kernel stores register group i // 4 at
    the fragment-order offset of (warpgroup t // 128, t % 128, i), so this is
    where dq_frag_offset must put (m, c)."""
    got = run_driver(cute_driver)
    pos, seen = 0, []
    while pos < got.size:
        block_m, hdim, threads, regs = (int(x) for x in got[pos:pos + 4])
        pos += 4
        mc = got[pos:pos + threads * regs * 2].reshape(threads, regs, 2)
        pos += mc.size
        assert block_m == bwd_block_sizes(hdim)[0] and regs == bwd_layouts.wg_cols(block_m, hdim) // 2
        assert threads == 128 * bwd_layouts.warpgroups(hdim)
        t, r = np.arange(threads)[:, None], np.arange(regs)[None, :]
        row, col = bwd_layouts.reg_position(block_m, hdim, t // 128, t % 128, r)
        assert np.array_equal(mc[..., 0], row) and np.array_equal(mc[..., 1], col), f"hdim {hdim}"
        seen.append(hdim)
    assert seen == [64, 96, 128, 192]


def test_dq_fragment_order_defined_for_every_bwd_head_dim():
    """The postprocess accepts every head dim of the contract (the kernels 64/96/128, and 192/256)."""
    for d, (bm, _) in BWD_BLOCK_SIZES.items():
        assert bwd_layouts.layout_ok(bm, d), f"hdim {d}: no dQ fragment order for block_m {bm}"


def test_packed_statistics_rows_match_the_kernels(driver):
    """csrc/common/seqlen_info.h's padded layout of packed documents (packed_padded_offset,
    packed_row_of) against bwd_layouts.packed_rows, on random document mixes with empty
    documents; and the layout's promises: every packed row once, each document from a tile
    boundary, no tile shared by two documents."""
    rng = np.random.default_rng(5)
    cases = [(64, [0, 0]), (128, [0, 1]), (64, [0, 0, 0, 5]), (128, [0, 128, 256, 257])]
    for _ in range(40):
        block_m = int(rng.choice([64, 128]))
        lengths = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 300], size=int(rng.integers(1, 9)))
        cases.append((block_m, [0] + np.cumsum(lengths).tolist()))
    stdin = "".join(f"{bm} {len(cu) - 1} {' '.join(map(str, cu))}\n" for bm, cu in cases)
    got = run_driver(driver, "packed", stdin=stdin)
    pos = 0
    for block_m, cu in cases:
        want = bwd_layouts.packed_rows(cu, block_m)
        assert got[pos] == want.size
        np.testing.assert_array_equal(got[pos + 1:pos + 1 + want.size], want)
        pos += 1 + want.size
        valid = want[want >= 0]
        np.testing.assert_array_equal(np.sort(valid), np.arange(cu[-1]))
        for b in range(len(cu) - 1):
            start = bwd_layouts.packed_padded_offset(cu[b], b, block_m)
            n_tiles = -(-(cu[b + 1] - cu[b]) // block_m)
            assert start % block_m == 0
            # The document's tiles hold its rows and padding only.
            tiles = want[start:start + n_tiles * block_m]
            assert tiles.size == n_tiles * block_m
            assert bool(((tiles == -1) | ((tiles >= cu[b]) & (tiles < cu[b + 1]))).all())
    assert pos == got.size


def test_packed_forward_order_matches_the_kernels(driver):
    """csrc/common/packed_order.h against dash_fa3/fwd_order.py: the documents' sort buckets,
    and the decode of every unit of an order buffer into (document, unit within it). The
    order's promises: documents in descending key blocks, every unit of every document
    (every head) exactly once, a document's units consecutive, empty documents passed over."""
    rng = np.random.default_rng(11)
    cases = [(128, False, [0, 0], [0, 0]), (128, True, [0, 1], [0, 1]), (64, True, [0, 0, 5, 5], [0, 3, 3, 9])]
    for _ in range(40):
        lengths_q = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 300, 1000], size=int(rng.integers(1, 12)))
        same = bool(rng.integers(0, 2))
        lengths_k = lengths_q if same else rng.choice([0, 1, 64, 200, 700], size=lengths_q.size)
        cases.append((int(rng.choice([64, 128, 176])), bool(rng.integers(0, 2)),
                      [0] + np.cumsum(lengths_q).tolist(), [0] + np.cumsum(lengths_k).tolist()))
    cases.append((128, False, [0, 5], [0, 128 * 5000]))  # longer than the last bucket
    heads, block_m = 3, 128
    stdin, orders = "", []
    for block_n, causal, cu_q, cu_k in cases:
        order = fwd_order.packed_order(cu_q, cu_k, heads, block_m, block_n, causal)
        orders.append(order)
        stdin += f"{block_n} {len(cu_q) - 1} {' '.join(map(str, cu_k))} {' '.join(map(str, order))}\n"
    got = run_driver(driver, "fwd_order", stdin=stdin)
    pos = 0
    for (block_n, causal, cu_q, cu_k), order in zip(cases, orders):
        batch = len(cu_q) - 1
        buckets = [fwd_order.bucket(cu_k[d + 1] - cu_k[d], block_n) for d in range(batch)]
        np.testing.assert_array_equal(got[pos:pos + batch], buckets)
        pos += batch
        pairs = got[pos:pos + 2 * int(order[0])].reshape(-1, 2)
        pos += 2 * int(order[0])
        want = []
        documents = order[2 + batch:2 + 2 * batch]
        assert order[2 + 2 * batch] == 0  # the tile counter
        for d in documents:
            n_m = -(-(cu_q[d + 1] - cu_q[d]) // block_m)
            want += [(d, u) for u in range(fwd_order.units_per_head(n_m, causal) * heads)]
        np.testing.assert_array_equal(pairs, np.array(want, dtype=np.int32).reshape(-1, 2))
        keys = [cu_k[d + 1] - cu_k[d] for d in documents]
        blocks = [min(-(-k // block_n), fwd_order.BUCKETS - 1) for k in keys]
        assert blocks == sorted(blocks, reverse=True)
    assert pos == got.size


def test_dense_causal_sections_match_the_kernels(driver):
    """fwd_causal_section_kv_heads (csrc/common/packed_order.h) against dash_fa3/fwd_order.py: the
    smallest power of two of KV heads whose tiles fill the grid once."""
    cases = [(n, g) for n in (1, 2, 3, 4, 7, 16, 22, 64, 128, 1000, 1 << 20) for g in (1, 7, 114, 132, 133, 1024)]
    got = run_driver(driver, "causal_sections", stdin="".join(f"{n} {g}\n" for n, g in cases))
    want = [fwd_order.causal_section_kv_heads(n, g) for n, g in cases]
    np.testing.assert_array_equal(got, want)
    for (n, g), k in zip(cases, want):
        assert k & (k - 1) == 0 and k * n >= g and (k == 1 or (k // 2) * n < g), (n, g, k)
