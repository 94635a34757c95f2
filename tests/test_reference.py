"""The reference against naive fp64 math and fp64 autograd (CPU)."""

import math

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
