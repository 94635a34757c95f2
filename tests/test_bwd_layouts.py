"""dash_fa3/bwd_layouts.py: the dQ fragment order is a permutation of each tile
with the properties the kernel and the postprocess rely on (CPU only; the C++
header is compared with it in tests/test_contract_cpp.py)."""

import numpy as np
import pytest

from dash_fa3 import bwd_layouts as L
from dash_fa3.schedule.contract import BWD_BLOCK_SIZES

TILES = sorted({(bm, d) for d, (bm, _) in BWD_BLOCK_SIZES.items()} | {(128, 32), (64, 80)})


@pytest.mark.parametrize("block_m,hdim", TILES)
def test_bijection(block_m, hdim):
    off = L.tile_permutation(block_m, hdim).ravel()
    assert np.array_equal(np.sort(off), np.arange(block_m * hdim))


@pytest.mark.parametrize("block_m,hdim", TILES)
def test_registers(block_m, hdim):
    """Register r of (wg, tid) sits where its (row, col) does, 4 consecutive
    registers of a thread are 4 consecutive floats, and a warp's group g
    covers 512 contiguous bytes (conflict-free 128-bit stores)."""
    regs = L.wg_cols(block_m, hdim) // 2
    assert regs % L.GROUP == 0
    w = L.warpgroups(hdim)
    wg, tid, r = np.meshgrid(np.arange(w), np.arange(L.WG_THREADS), np.arange(regs), indexing="ij")
    row, col = L.reg_position(block_m, hdim, wg, tid, r)
    off = L.reg_offset(block_m, hdim, wg, tid, r)
    assert np.array_equal(L.dq_frag_offset(block_m, hdim, row, col), off)
    assert np.array_equal(np.sort(off.ravel()), np.arange(block_m * hdim))  # every element once
    groups = off.reshape(w, L.WG_THREADS, regs // L.GROUP, L.GROUP)
    assert np.all(groups % L.GROUP == np.arange(L.GROUP))
    assert np.all(np.diff(groups, axis=-1) == 1)
    warp_starts = groups[:, ::32, :, 0]
    assert np.all(groups[..., 0].reshape(w, 4, 32, -1) -
                  warp_starts[:, :, None, :] == (L.GROUP * np.arange(32))[None, None, :, None])


@pytest.mark.parametrize("block_m,hdim", TILES)
def test_postprocess_spans(block_m, hdim):
    """The postprocess reads rows m, m + 8 x columns c .. c + 7 (m % 16 < 8,
    c % 8 == 0) as the 16 floats from dq_frag_offset(m, c), float4 k holding
    (m, c+2k), (m, c+2k+1), (m+8, c+2k), (m+8, c+2k+1)."""
    perm = L.tile_permutation(block_m, hdim)
    for m in [x for x in range(block_m) if x % 16 < 8]:
        for c in range(0, hdim, 8):
            base = perm[m, c]
            assert base % 16 == 0
            want = np.stack([perm[m, c:c + 8:2], perm[m, c + 1:c + 8:2], perm[m + 8, c:c + 8:2],
                             perm[m + 8, c + 1:c + 8:2]], axis=1).ravel()
            assert np.array_equal(want, base + np.arange(16))


def test_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 192, 96)).astype(np.float32)
    acc = L.to_fragment_order(x, 64)
    assert not np.array_equal(acc, x)
    assert np.array_equal(L.from_fragment_order(acc, 64), x)


def test_three_warpgroups_at_192():
    """hdim 192: three warpgroups, 64 contiguous columns each (one 64-wide atom)."""
    assert L.warpgroups(192) == 3 and L.wg_cols(64, 192) == 64 and L.atom_cols(64, 192) == 64
    _, col = L.reg_position(64, 192, np.arange(3)[:, None], 0, np.arange(32)[None, :])
    assert np.array_equal(col // 64, np.repeat(np.arange(3)[:, None], 32, axis=1))


@pytest.mark.parametrize("block_m,hdim", [(64, 72), (64, 88), (32, 64), (128, 0), (96, 128), (128, 192)])
def test_rejects_undefined_tiles(block_m, hdim):
    assert not L.layout_ok(block_m, hdim)
    with pytest.raises(ValueError, match="fragment order"):
        L.dq_frag_offset(block_m, hdim, 0, 0)
