"""The reference against naive fp64 math and fp64 autograd (CPU)."""

import math
import warnings

import numpy as np
import pytest
import torch

from dash_fa3 import reference

SHAPES = [
    # batch, seqlen_q, seqlen_k, heads, heads_kv, headdim
    (1, 8, 8, 1, 1, 16),
    (2, 7, 13, 4, 2, 32),
    (1, 13, 7, 6, 1, 64),  # seqlen_q > seqlen_k: causal leaves early rows empty
    (3, 1, 9, 2, 2, 8),
]


def naive(q, k, v, scale, causal):
    """Loop-per-head fp64 attention, written independently of the reference."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(sq):
                cols = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not cols:
                    continue
                s = torch.stack([(q[bi, i, hi] * k[bi, j, kh]).sum() * scale for j in cols])
                m = s.max()
                w = torch.exp(s - m)
                lse[bi, hi, i] = m + torch.log(w.sum())
                out[bi, i, hi] = (w[:, None] * v[bi, cols, kh]).sum(0) / w.sum()
    return out, lse


def rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_naive(shape, causal):
    b, sq, sk, h, hkv, d = shape
    q, k, v = rand((b, sq, h, d), 1), rand((b, sk, hkv, d), 2), rand((b, sk, hkv, d), 3)
    scale = 0.7 / math.sqrt(d)
    out, lse = reference.attention_ref(q, k, v, scale, causal, compute_dtype=torch.float64)
    out_n, lse_n = naive(q, k, v, scale, causal)
    torch.testing.assert_close(out, out_n, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_n, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_autograd(shape, causal):
    b, sq, sk, h, hkv, d = shape
    q, k, v = (t.requires_grad_() for t in (rand((b, sq, h, d), 4), rand((b, sk, hkv, d), 5), rand((b, sk, hkv, d), 6)))
    dout = rand((b, sq, h, d), 7)
    scale = 1.3 / math.sqrt(d)
    out, _ = naive(q, k, v, scale, causal)
    dq_a, dk_a, dv_a = torch.autograd.grad(out, (q, k, v), dout)
    dq, dk, dv = reference.attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), scale, causal, torch.float64)
    for got, want in ((dq, dq_a), (dk, dk_a), (dv, dv_a)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_empty_rows_are_zero_with_minus_inf_lse():
    q, k, v = rand((1, 6, 1, 8), 8), rand((1, 3, 1, 8), 9), rand((1, 3, 1, 8), 10)
    out, lse = reference.attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    # seqlen_q - seqlen_k = 3 rows see no key under the bottom-right aligned mask.
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    dq, dk, dv = reference.attention_bwd_ref(rand((1, 6, 1, 8), 11), q, k, v, out, causal=True, compute_dtype=torch.float64)
    assert torch.equal(dq[:, :3], torch.zeros_like(dq[:, :3]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_causal_mask_is_bottom_right_aligned():
    m = reference.causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_fp32_reference_close_to_fp64():
    q, k, v = rand((2, 33, 4, 64), 12), rand((2, 47, 2, 64), 13), rand((2, 47, 2, 64), 14)
    o64, l64 = reference.attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    o32, l32 = reference.attention_ref(q.float(), k.float(), v.float(), causal=True)
    assert o32.dtype == torch.float32 and l32.dtype == torch.float32
    assert ((o32.double() - o64).norm() / o64.norm()).item() < 1e-5


def test_rejects_low_precision_compute():
    q = rand((1, 2, 1, 8), 0)
    with pytest.raises(ValueError, match="compute_dtype"):
        reference.attention_ref(q, q, q, compute_dtype=torch.bfloat16)


# Block edges that split the shapes below unevenly, so that the first, middle and
# last blocks, partly masked causal blocks and rows with no visible key all occur.
BLOCKED_SHAPES = [
    # batch, seqlen_q, seqlen_k, heads, heads_kv, headdim, block_size
    (2, 37, 53, 4, 2, 16, 8),
    (1, 53, 37, 6, 3, 8, 5),   # seqlen_q > seqlen_k: whole blocks of empty rows
    (2, 29, 29, 3, 1, 8, 1),   # block 1: every row and key alone
    (1, 40, 17, 2, 2, 32, 16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", BLOCKED_SHAPES)
def test_blockwise_forward_and_backward_match_naive(shape, causal):
    b, sq, sk, h, hkv, d, block = shape
    seed = 100 + 10 * BLOCKED_SHAPES.index(shape) + causal
    q, k, v = (t.requires_grad_() for t in (rand((b, sq, h, d), seed), rand((b, sk, hkv, d), seed + 1),
                                             rand((b, sk, hkv, d), seed + 2)))
    dout = rand((b, sq, h, d), seed + 3)
    scale = 0.9 / math.sqrt(d)
    out_n, lse_n = naive(q, k, v, scale, causal)
    grads_n = torch.autograd.grad(out_n, (q, k, v), dout)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = reference.attention_ref(q, k, v, scale, causal, torch.float64, block_size=block)
    torch.testing.assert_close(out, out_n.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_n, rtol=1e-10, atol=1e-10)
    grads = reference.attention_bwd_ref(dout, q, k, v, out, scale, causal, torch.float64, block_size=block)
    for got, want in zip(grads, grads_n):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_block_size_changes_only_rounding():
    q, k, v = rand((2, 300, 4, 64), 20).float(), rand((2, 333, 2, 64), 21).float(), rand((2, 333, 2, 64), 22).float()
    dout = rand((2, 300, 4, 64), 23).float()
    o_a, l_a = reference.attention_ref(q, k, v, causal=True)
    o_b, l_b = reference.attention_ref(q, k, v, causal=True, block_size=48)
    torch.testing.assert_close(o_a, o_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_a, l_b, rtol=1e-6, atol=1e-6)
    for a, b_ in zip(reference.attention_bwd_ref(dout, q, k, v, o_a, causal=True),
                     reference.attention_bwd_ref(dout, q, k, v, o_a, causal=True, block_size=48)):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_outputs_are_contiguous_whatever_the_input_layout():
    # q, k, v as views of a (batch, heads, seqlen, dim) layout, as frameworks hand them over.
    q = rand((2, 4, 19, 64), 30).transpose(1, 2)
    k = rand((2, 2, 23, 64), 31).transpose(1, 2)
    v = rand((2, 2, 23, 64), 32).transpose(1, 2)
    dout = rand((2, 4, 19, 64), 33).transpose(1, 2)
    out, lse = reference.attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    assert out.shape == (2, 19, 4, 64) and out.is_contiguous()
    assert lse.shape == (2, 4, 19) and lse.is_contiguous()
    out_c, lse_c = reference.attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                                           compute_dtype=torch.float64)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    grads = reference.attention_bwd_ref(dout, q, k, v, out, causal=True, compute_dtype=torch.float64)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.is_contiguous()


def test_rejects_bad_block_size():
    q = rand((1, 4, 1, 8), 0)
    with pytest.raises(ValueError, match="block_size"):
        reference.attention_ref(q, q, q, block_size=0)


def test_default_block_size_bounds_the_score_tile():
    for batch, heads in ((1, 1), (2, 16), (8, 64), (64, 128)):
        edge = reference._block_size(batch, heads, None)
        assert 64 <= edge <= 1024 and edge & (edge - 1) == 0
        assert batch * heads * edge * edge <= reference._TILE_ELEMENTS or edge == 64


@pytest.fixture
def fresh_slow_warning(monkeypatch):
    monkeypatch.setattr(reference, "_warned_slow", False)


def test_large_cpu_call_warns_once(fresh_slow_warning, monkeypatch):
    monkeypatch.setattr(reference, "SLOW_WORK_THRESHOLD", 64 * 64)
    small = rand((1, 8, 2, 8), 40).float()
    big = rand((1, 64, 2, 8), 41).float()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        reference.attention_ref(small, small, small)            # 1*2*8*8 < threshold
        assert not seen
        reference.attention_ref(big, big, big, causal=True)     # 1*2*64*64/2 = threshold
        reference.attention_ref(big, big, big)
        reference.attention_bwd_ref(big, big, big, big, big)
    assert [type(w.message) for w in seen] == [reference.SlowReferenceWarning]
    assert issubclass(reference.SlowReferenceWarning, UserWarning)
    assert "slow" in str(seen[0].message) and "seqlen 64x64" in str(seen[0].message)


_MEMORY_PROBE = r"""
import resource, sys, warnings
import torch
from dash_fa3 import reference

b, s, h, hkv, d = 1, 16384, 8, 2, 16
g = torch.Generator().manual_seed(int(sys.argv[1]))
q = torch.randn(b, s, h, d, generator=g)
k, v = torch.randn(b, s, hkv, d, generator=g), torch.randn(b, s, hkv, d, generator=g)
dout = torch.randn(b, s, h, d, generator=g)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    out, lse = reference.attention_ref(q, k, v, causal=True)
    dq, dk, dv = reference.attention_bwd_ref(dout, q, k, v, out, causal=True)
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
rows = torch.tensor([0, 1, s // 2, s - 1])
# Spot check a few rows against a direct computation of just those rows.
qs = q[0, rows].transpose(0, 1)                                   # (h, 4, d)
ks = k[0].transpose(0, 1).repeat_interleave(h // hkv, 0)          # (h, s, d)
vs = v[0].transpose(0, 1).repeat_interleave(h // hkv, 0)
sc = qs @ ks.transpose(1, 2) / d ** 0.5
sc = sc.masked_fill(torch.arange(s)[None, None, :] > rows[None, :, None], float("-inf"))
want = torch.softmax(sc, -1) @ vs
err = (out[0, rows].transpose(0, 1) - want).abs().max().item()
lse_err = (lse[0, :, rows] - torch.logsumexp(sc, -1)).abs().max().item()
finite = all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
contiguous = all(t.is_contiguous() for t in (out, lse, dq, dk, dv))
print(peak_kib, err, lse_err, finite, contiguous, len(seen), seen[0].category.__name__ if seen else "-")
"""


@pytest.mark.slow
def test_16k_tokens_on_cpu_use_linear_memory():
    # A full fp32 score matrix at this shape is 8 heads x 16384^2 x 4 B = 8.6 GB; the
    # blockwise reference must stay far below that, forward and backward. A fresh
    # process, so that its peak RSS counts only this call.
    import os
    import random
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(random.randrange(1 << 30))],
                         capture_output=True, text=True, cwd=root, timeout=600,
                         env={**os.environ, "PYTHONPATH": root})
    assert res.returncode == 0, res.stderr[-3000:]
    peak_kib, err, lse_err, finite, contiguous, n_warn, category = res.stdout.split()
    assert int(peak_kib) < 1024 * 1024, f"peak extra memory {int(peak_kib) / 1024:.0f} MiB, expected O(seqlen)"
    assert float(err) < 1e-5 and float(lse_err) < 1e-4, (err, lse_err)
    assert finite == "True" and contiguous == "True"
    assert n_warn == "1" and category == "SlowReferenceWarning"


def test_one_thread_runs_on_one_thread_and_restores_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with reference.one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"):
            with reference.one_thread():
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, True, 64.0, "64"])
def test_block_size_must_be_a_positive_int(bad):
    q = torch.randn(1, 4, 2, 64)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        reference.attention_ref(q, q, q, block_size=bad)


def test_block_size_takes_numpy_ints():
    q = torch.randn(1, 70, 2, 64)
    assert torch.equal(reference.attention_ref(q, q, q, block_size=np.int64(64))[0],
                       reference.attention_ref(q, q, q, block_size=64)[0])
