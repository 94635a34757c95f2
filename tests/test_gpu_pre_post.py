"""Backward preprocess and postprocess kernels against torch (GPU)."""

import math

import pytest
import torch

from conftest import poison_cuda_allocator
from dash_fa3 import _ext, bwd_layouts
from dash_fa3.schedule import bwd_block_sizes

pytestmark = pytest.mark.gpu

LOG2E = 1.0 / math.log(2.0)
SHAPES = [  # batch, seqlen_q, heads, headdim, block_m
    (2, 128, 4, 64, 128),
    (1, 1000, 3, 128, 64),  # ragged: padding rows in the last tile
    (3, 77, 2, 96, 128),
    (1, 1, 1, 256, 64),
    (2, 513, 5, 192, 64),
]
DTYPES = [torch.bfloat16, torch.float16]


def strided_bshd(b, s, h, d, dtype):
    """(b, s, h, d) view whose head stride is padded: checks that strides are honoured."""
    base = torch.randn(b, s, h + 1, d, device="cuda", dtype=dtype)
    return base[:, :, :h]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_preprocess(shape, dtype):
    b, s, h, d, block_m = shape
    out, dout = strided_bshd(b, s, h, d, dtype), torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    lse = torch.randn(b, h, s, device="cuda") * 3
    lse[..., ::7] = float("-inf")  # rows that attend nothing
    poison_cuda_allocator(1 << 26)
    dpsum, lse_log2, dq_accum, sem = _ext.ops().bwd_preprocess(out, dout, lse, block_m)

    n_tiles = (s + block_m - 1) // block_m
    rounded = n_tiles * block_m
    assert dpsum.shape == lse_log2.shape == (b, h, rounded)
    assert dq_accum.shape == (b, h, rounded, d) and dq_accum.dtype == torch.float32
    assert sem.shape == (b, h, n_tiles) and sem.dtype == torch.int32

    want = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(dpsum[..., :s], want, rtol=1e-5, atol=1e-4)
    want_lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse * LOG2E)
    torch.testing.assert_close(lse_log2[..., :s], want_lse, rtol=1e-6, atol=1e-6)
    # Padding rows: P = exp2(S - inf) = 0 there, whatever the rows the main kernel loads.
    assert torch.count_nonzero(dpsum[..., s:]) == 0 and bool((lse_log2[..., s:] == float("inf")).all())
    assert torch.count_nonzero(dq_accum) == 0 and not torch.isnan(dq_accum).any()
    assert torch.count_nonzero(sem) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_postprocess(shape, dtype):
    """The accumulator holds each of the main kernel's Q tiles (bwd_block_m(d)
    rows) in fragment order (dash_fa3/bwd_layouts.py): dq is scale times the
    accumulator read back through that order."""
    b, s, h, d, block_m = shape
    tile_m = bwd_block_sizes(d)[0]
    step = max(block_m, tile_m)  # both powers of two: rows a multiple of each
    rounded = (s + step - 1) // step * step
    accum = torch.randn(b, h, rounded, d, device="cuda") * 10
    scale = 0.37
    poison_cuda_allocator(1 << 26)
    dq = _ext.ops().bwd_postprocess(accum, s, scale, dtype)
    assert dq.shape == (b, s, h, d) and dq.dtype == dtype
    perm = torch.from_numpy(bwd_layouts.tile_permutation(tile_m, d).ravel()).to(accum.device)
    rows = accum.view(b, h, rounded // tile_m, tile_m * d)[..., perm].view(b, h, rounded, d)
    want = (rows[:, :, :s] * scale).to(dtype).transpose(1, 2)
    assert torch.equal(dq, want)


def test_postprocess_rejects_bad_accumulator():
    with pytest.raises(RuntimeError, match="dq_accum"):
        _ext.ops().bwd_postprocess(torch.zeros(2, 3, 64, device="cuda"), 64, 1.0, torch.bfloat16)


def test_postprocess_rejects_accumulator_without_whole_tiles():
    # hdim 128: the main kernel's tiles are 64 rows.
    with pytest.raises(RuntimeError, match="not a multiple of the backward's block_m 64"):
        _ext.ops().bwd_postprocess(torch.zeros(1, 2, 96, 128, device="cuda"), 90, 1.0, torch.bfloat16)
    # hdim 72: 64-row tiles, 36 columns per warpgroup: no fragment order.
    with pytest.raises(RuntimeError, match="no dQ accumulator layout for headdim 72"):
        _ext.ops().bwd_postprocess(torch.zeros(1, 2, 64, 72, device="cuda"), 64, 1.0, torch.bfloat16)


def test_preprocess_rejects_mismatched_dout():
    out = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dout must have out's shape"):
        _ext.ops().bwd_preprocess(out, out[:, :32], torch.zeros(1, 2, 64, device="cuda"), 64)
