"""Sliding windows, softcap and packed variable-length batches (issue 17 groundwork, CPU).

The reference and the public API against a naive fp64 implementation written
here from FA3's stated semantics: per document, query i sees key j iff
i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded; causal: right = 0),
scores capped as softcap * tanh(scale * q·k / softcap), rows with no visible
key give out 0 and lse -inf. Gradients come from fp64 autograd through it.
"""

import math
import random

import numpy as np
import pytest
import torch

import dash_fa3
from dash_fa3 import ops, reference


def naive_dense(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """q (sq, h, d), k/v (sk, hkv, d) of one document -> out (sq, h, d), lse (h, sq); fp64, autograd-friendly."""
    sq, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= i + sk - sq + right
    if left >= 0:
        visible &= j >= i + sk - sq - left
    kk = k.repeat_interleave(h // hkv, dim=1)
    vv = v.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no visible key
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    out = torch.einsum("hij,jhd->ihd", p, vv)
    return out, lse


def naive_varlen(q, k, v, cu_q, cu_k, scale, **kw):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        o, lse = naive_dense(q[q0:q1], k[k0:k1], v[k0:k1], scale, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def rand(shape, gen, dtype=torch.float64):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def fresh_gen():
    seed = random.randrange(1 << 30)
    return torch.Generator().manual_seed(seed), seed


def check_dense(b, sq, sk, h, hkv, d, causal=False, window=(-1, -1), softcap=0.0, block_size=None):
    g, seed = fresh_gen()
    q = rand((b, sq, h, d), g).requires_grad_()
    k = rand((b, sk, hkv, d), g).requires_grad_()
    v = rand((b, sk, hkv, d), g).requires_grad_()
    dout = rand((b, sq, h, d), g)
    scale = 0.9 / math.sqrt(d)
    outs, lses = zip(*(naive_dense(q[i], k[i], v[i], scale, causal, window, softcap) for i in range(b)))
    out_n, lse_n = torch.stack(outs), torch.stack(lses)
    grads_n = torch.autograd.grad(out_n, (q, k, v), dout)
    q, k, v = q.detach(), k.detach(), v.detach()
    kw = dict(window_size=window, softcap=softcap, block_size=block_size)
    out, lse = reference.attention_ref(q, k, v, scale, causal, torch.float64, **kw)
    torch.testing.assert_close(out, out_n.detach(), rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse, lse_n.detach(), rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
    grads = reference.attention_bwd_ref(dout, q, k, v, out, scale, causal, torch.float64, **kw)
    for name, got, want in zip("qkv", grads, grads_n):
        assert torch.isfinite(got).all(), f"seed {seed}: d{name} not finite"
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"seed {seed}: d{name}: {m}")


WINDOW_CASES = [
    # batch, sq, sk, h, hkv, d, causal, window
    (1, 23, 23, 2, 1, 16, False, (5, -1)),    # left only
    (1, 23, 23, 2, 2, 16, False, (-1, 4)),    # right only
    (2, 19, 19, 4, 2, 8, False, (3, 2)),      # both
    (1, 21, 21, 2, 1, 16, True, (6, -1)),     # with causal
    (1, 21, 21, 2, 1, 16, True, (6, 0)),      # with causal, right given as 0
    (1, 9, 9, 1, 1, 8, False, (40, 50)),      # wider than the sequence
    (1, 13, 29, 3, 1, 16, False, (4, 2)),     # seqlen_q < seqlen_k
    (1, 29, 13, 2, 1, 16, False, (2, 3)),     # seqlen_q > seqlen_k: early rows see nothing
    (1, 29, 13, 2, 1, 16, True, (2, -1)),
    (1, 17, 17, 1, 1, 8, False, (0, 0)),      # the diagonal only
    (1, 17, 17, 1, 1, 8, False, (-1, 0)),     # = causal
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[1]}x{c[2]}-causal{int(c[6])}-w{c[7]}")
def test_window_matches_naive(case):
    b, sq, sk, h, hkv, d, causal, window = case
    check_dense(b, sq, sk, h, hkv, d, causal, window)


@pytest.mark.parametrize("window", [(3, 2), (9, -1), (-1, 5), (20, 0)])
def test_window_small_blocks_skip_and_mask(window):
    # Blocks of 4 rows/keys: the window leaves whole key blocks empty (skipped) and cuts others (masked).
    check_dense(1, 37, 41, 2, 1, 8, window=window, block_size=4)
    check_dense(1, 41, 37, 2, 1, 8, causal=True, window=(window[0], -1), block_size=4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_softcap_matches_naive(causal, softcap):
    check_dense(2, 15, 18, 4, 2, 16, causal=causal, softcap=softcap)


def test_softcap_with_window_and_blocks():
    check_dense(1, 33, 33, 2, 1, 8, window=(7, 3), softcap=2.0, block_size=8)


def test_softcap_placement_is_after_the_scale():
    # FA3 caps softmax_scale * q·k: with a large scale and a small cap, the scores saturate at ±softcap.
    g, _ = fresh_gen()
    q, k, v = rand((1, 4, 1, 8), g), rand((1, 6, 1, 8), g), rand((1, 6, 1, 8), g)
    _, lse = reference.attention_ref(q, k, v, 1e6, compute_dtype=torch.float64, softcap=1.0)
    assert (lse <= 1.0 + math.log(6) + 1e-12).all()


def test_window_rows_with_no_key_give_zero_and_minus_inf():
    g, _ = fresh_gen()
    q, k, v = rand((1, 8, 1, 8), g), rand((1, 3, 1, 8), g), rand((1, 3, 1, 8), g)
    # offset -5, window (1, 1): rows 0..3 see nothing (upper bound i - 4 < 0).
    out, lse = reference.attention_ref(q, k, v, compute_dtype=torch.float64, window_size=(1, 1))
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()
    dq, dk, dv = reference.attention_bwd_ref(rand((1, 8, 1, 8), g), q, k, v, out, compute_dtype=torch.float64,
                                             window_size=(1, 1))
    assert torch.equal(dq[:, :4], torch.zeros_like(dq[:, :4]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_visible_mask_matches_the_formula():
    m = reference.visible_mask(4, 6, (1, 0))
    # offset 2: row i sees [i + 1, i + 2].
    want = torch.tensor([[j in (i + 1, i + 2) for j in range(6)] for i in range(4)])
    assert torch.equal(m, want)
    assert torch.equal(reference.visible_mask(5, 5, causal=True), reference.causal_mask(5, 5))
    assert torch.equal(reference.visible_mask(4, 4, (2, 3), causal=True), reference.visible_mask(4, 4, (2, 0)))
    with pytest.raises(ValueError, match="entries must be >= -1"):
        reference.attention_ref(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8),
                                window_size=(-3, 0))


# ---------------------------------------------------------------- varlen


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


VARLEN_CASES = [
    # (q lengths, k lengths), h, hkv, d, causal, window, softcap
    (([5, 0, 7, 1, 3], [5, 4, 0, 1, 9]), 2, 1, 16, False, (-1, -1), 0.0),   # empty q doc, empty k doc, one token
    (([5, 0, 7, 1, 3], [5, 4, 0, 1, 9]), 2, 1, 16, True, (-1, -1), 0.0),
    (([1, 1, 1], [1, 1, 1]), 3, 3, 8, True, (-1, -1), 0.0),                 # one-token documents
    (([6, 11, 4], [9, 11, 2]), 4, 2, 16, True, (3, -1), 0.0),               # GQA, window inside documents
    (([6, 11, 4], [9, 11, 2]), 4, 2, 16, False, (2, 1), 0.0),
    (([6, 11, 4], [9, 11, 2]), 4, 1, 8, True, (-1, -1), 10.0),              # MQA, softcap
    (([0, 0], [0, 3]), 2, 1, 8, False, (-1, -1), 0.0),                      # nothing to compute
    (([13], [13]), 2, 1, 8, False, (4, 4), 3.0),                            # one document
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"q{c[0][0]}-k{c[0][1]}-c{int(c[4])}-w{c[5]}-s{c[6]}")
def test_varlen_reference_matches_naive(case):
    (lq, lk), h, hkv, d, causal, window, softcap = case
    g, seed = fresh_gen()
    cu_q, cu_k = cu(lq), cu(lk)
    tq, tk = sum(lq), sum(lk)
    q = rand((tq, h, d), g).requires_grad_()
    k = rand((tk, hkv, d), g).requires_grad_()
    v = rand((tk, hkv, d), g).requires_grad_()
    dout = rand((tq, h, d), g)
    scale = 1.1 / math.sqrt(d)
    kw = dict(causal=causal, window=window, softcap=softcap)
    out_n, lse_n = naive_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, **kw)
    assert out_n.shape == (tq, h, d) and lse_n.shape == (h, tq)
    grads_n = torch.autograd.grad(out_n, (q, k, v), dout, allow_unused=True) if tq else (None,) * 3
    q, k, v = q.detach(), k.detach(), v.detach()
    rkw = dict(window_size=window, softcap=softcap, block_size=4)
    out, lse = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, scale, causal, torch.float64, **rkw)
    torch.testing.assert_close(out, out_n.detach(), rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse, lse_n.detach(), rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}")
    grads = reference.attention_varlen_bwd_ref(dout, q, k, v, out, cu_q, cu_k, scale, causal, torch.float64, **rkw)
    for name, got, want, like in zip("qkv", grads, grads_n, (q, k, v)):
        assert got.shape == like.shape and torch.isfinite(got).all()
        want = torch.zeros_like(like) if want is None else want
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"seed {seed}: d{name}: {m}")


def test_varlen_equals_padded_dense_per_document():
    # Packing must not change a document's result: each one alone through the dense reference.
    g, _ = fresh_gen()
    lq, lk = [7, 3, 10], [7, 5, 10]
    cu_q, cu_k = cu(lq), cu(lk)
    q, k, v = rand((20, 4, 8), g, torch.float32), rand((22, 2, 8), g, torch.float32), rand((22, 2, 8), g, torch.float32)
    out, lse = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, window_size=(2, -1))
    for b in range(3):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        o, l = reference.attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, window_size=(2, -1))
        assert torch.equal(out[q0:q1], o[0]) and torch.equal(lse[:, q0:q1], l[0])


# ---------------------------------------------------------------- the public API on the CPU


def lowp(shape, g, dtype=torch.bfloat16):
    return rand(shape, g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, window, softcap", [(False, (4, 2), 0.0), (True, (5, -1), 0.0),
                                                     (False, (-1, -1), 20.0), (True, (3, 0), 7.5)])
def test_flash_attn_func_window_softcap_cpu(dtype, causal, window, softcap):
    g, seed = fresh_gen()
    q = lowp((2, 17, 4, 64), g, dtype).requires_grad_()
    k = lowp((2, 20, 2, 64), g, dtype).requires_grad_()
    v = lowp((2, 20, 2, 64), g, dtype).requires_grad_()
    scale = 0.5 / math.sqrt(64)
    out, lse = dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                        softcap=softcap, return_attn_probs=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (2, 4, 17) and lse.dtype == torch.float32
    kw = dict(window_size=window, softcap=softcap)
    ref_out, ref_lse = reference.attention_ref(q.detach(), k.detach(), v.detach(), scale, causal, **kw)
    torch.testing.assert_close(out.float(), ref_out, rtol=1e-2, atol=1e-2, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse, ref_lse)
    dout = lowp(out.shape, g, dtype)
    out.backward(dout)
    grads = reference.attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), scale, causal, **kw)
    for t, want in zip((q, k, v), grads):
        assert t.grad.dtype == dtype
        torch.testing.assert_close(t.grad.float(), want, rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}")


def test_windows_that_mask_nothing_more_take_the_plain_path(monkeypatch):
    # FA3's normalisation: a side reaching past the sequence is unbounded; (-1, 0) is causal.
    g, _ = fresh_gen()
    q, k, v = lowp((1, 9, 2, 64), g), lowp((1, 9, 2, 64), g), lowp((1, 9, 2, 64), g)
    calls = []
    monkeypatch.setattr(ops, "attention_general", lambda *a: calls.append(a))
    full = dash_fa3.flash_attn_func(q, k, v)
    causal = dash_fa3.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(8, 8)), full)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(None, None)), full)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(100, -1), causal=True), causal)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=[8, 0]), causal)
    assert not calls


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (3, -1), 0.0),
                                                     (False, (2, 2), 15.0)])
def test_flash_attn_varlen_func_cpu(causal, window, softcap):
    g, seed = fresh_gen()
    lq, lk = [5, 0, 9, 1, 6], [7, 3, 9, 0, 4]
    cu_q, cu_k = cu(lq), cu(lk)
    q = lowp((21, 4, 64), g).requires_grad_()
    k = lowp((23, 2, 64), g).requires_grad_()
    v = lowp((23, 2, 64), g).requires_grad_()
    out, lse = dash_fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                               window_size=window, softcap=softcap, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, 21) and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    out_n, lse_n = naive_varlen(q.detach().double(), k.detach().double(), v.detach().double(), cu_q.tolist(),
                                cu_k.tolist(), 1 / 8, causal=causal, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), out_n, rtol=2e-2, atol=2e-2, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse.double(), lse_n, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    dout = lowp(out.shape, g)
    out.backward(dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_n, _ = naive_varlen(qd, kd, vd, cu_q.tolist(), cu_k.tolist(), 1 / 8, causal=causal, window=window,
                          softcap=softcap)
    grads_n = torch.autograd.grad(o_n, (qd, kd, vd), dout.double(), allow_unused=True)
    for t, want in zip((q, k, v), grads_n):
        assert t.grad is not None and t.grad.dtype == t.dtype
        want = torch.zeros_like(t.grad, dtype=torch.float64) if want is None else want
        torch.testing.assert_close(t.grad.double(), want, rtol=3e-2, atol=3e-2, msg=lambda m: f"seed {seed}: {m}")
    # The empty k document (b = 3) leaves its q row at out 0, lse -inf, dq 0.
    row = cu_q[3].item()
    assert torch.equal(out[row], torch.zeros_like(out[row])) and torch.isneginf(lse[:, row]).all()
    assert torch.equal(q.grad[row], torch.zeros_like(q.grad[row]))


def test_varlen_return_convention_and_deterministic_flag():
    g, _ = fresh_gen()
    q, k, v = lowp((6, 2, 64), g), lowp((6, 2, 64), g), lowp((6, 2, 64), g)
    cu_s = cu([2, 4])
    out = dash_fa3.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 4, 4)
    assert isinstance(out, torch.Tensor)
    out2, lse = dash_fa3.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 4, 4, deterministic=True, return_attn_probs=True)
    assert torch.equal(out, out2) and lse.shape == (2, 6)
    # Larger max_seqlen than any document is fine (FA3 only needs an upper bound).
    assert torch.equal(dash_fa3.flash_attn_varlen_func(q, k, v, cu_s, cu_s, 100, 100), out)


def test_varlen_opcheck_and_compile():
    g, _ = fresh_gen()
    q, k, v = lowp((9, 2, 64), g), lowp((11, 1, 64), g), lowp((11, 1, 64), g)
    cu_q, cu_k = cu([4, 5]), cu([6, 5])
    checks = ("test_schema", "test_faketensor")
    args = (q, k, v, cu_q, cu_k, 5, 6, 0.125, 2, 0, 0.0, 0)
    torch.library.opcheck(ops.fwd_general, args, test_utils=checks)
    out, lse = ops.fwd_general(*args)
    torch.library.opcheck(ops.bwd_general, (lowp(out.shape, g), q, k, v, out, lse, cu_q, cu_k, 5, 6, 0.125, 2, 0, 0.0,
                                            True, "auto", 0), test_utils=checks)
    dense = (q[None], k[None, :9], v[None, :9], None, None, 0, 0, 0.125, 3, 1, 5.0, 0)
    torch.library.opcheck(ops.fwd_general, dense, test_utils=checks)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fn = torch.compile(lambda q, k, v: dash_fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True),
                       backend="aot_eager", fullgraph=True)
    res = fn(qg, kg, vg)
    res.float().square().sum().backward()
    assert torch.equal(res.detach(), dash_fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True))
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (qg, kg, vg))


# ---------------------------------------------------------------- errors


def varlen_args(**over):
    q, k, v = torch.zeros(6, 2, 64, dtype=torch.bfloat16), torch.zeros(7, 1, 64, dtype=torch.bfloat16), \
        torch.zeros(7, 1, 64, dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu([2, 4]), cu_seqlens_k=cu([3, 4]), max_seqlen_q=4, max_seqlen_k=4)
    args.update(over)
    return args


I32 = torch.int32


@pytest.mark.parametrize("over, exc, match", [
    (dict(cu_seqlens_q=[0, 2, 6]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 6])), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    (dict(cu_seqlens_k=torch.tensor([[0, 3, 7]], dtype=I32)), ValueError, "cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([0], dtype=I32), cu_seqlens_k=torch.tensor([0], dtype=I32)), ValueError,
     "batch \\+ 1 >= 2"),
    (dict(cu_seqlens_k=torch.tensor([0, 7], dtype=I32)), ValueError, "one batch: got 3 and 2 entries"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 6], dtype=I32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 3, 7], dtype=I32), cu_seqlens_q=torch.tensor([0, 2, 4, 6], dtype=I32)),
     ValueError, "cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=I32)), ValueError, r"cu_seqlens_q must end at .*\(6, q"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=I32)), ValueError, r"cu_seqlens_k must end at .*\(7, k"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=I32, device="meta")), ValueError,
     "cu_seqlens_k must be on q's device cpu, got meta"),
    (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is smaller than the longest document \(4 tokens\)"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be a non-negative int"),
    (dict(max_seqlen_k=4.0), ValueError, "max_seqlen_k must be a non-negative int"),
    (dict(q=torch.zeros(1, 6, 2, 64, dtype=torch.bfloat16)), ValueError, r"q must have 3 dims \(total_tokens"),
    (dict(q=torch.zeros(6, 2, 64, dtype=torch.float64)), TypeError, "bfloat16 or torch.float16"),
    (dict(q=torch.zeros(6, 3, 64, dtype=torch.bfloat16), k=torch.zeros(7, 2, 64, dtype=torch.bfloat16),
          v=torch.zeros(7, 2, 64, dtype=torch.bfloat16)), ValueError, "heads % heads_kv"),
    (dict(v=torch.zeros(7, 1, 32, dtype=torch.bfloat16)), ValueError, "q/k 64 with v 32 is not supported"),
    (dict(v=torch.zeros(8, 1, 64, dtype=torch.bfloat16)), ValueError, "agree on all dims but the last"),
    (dict(seqused_k=torch.tensor([2, 4], dtype=I32)), NotImplementedError, "seqused_k smaller than the documents"),
    (dict(seqused_q=torch.tensor([2, 4])), TypeError, "seqused_q must be a torch.Tensor of dtype torch.int32"),
    (dict(seqused_q=torch.tensor([2, 4, 0], dtype=I32)), ValueError, "seqused_q must be 1-D with one entry per"),
    (dict(qv=torch.zeros(1)), NotImplementedError, "qv"),
    (dict(k_descale=torch.ones(1)), NotImplementedError, "fp8"),
    (dict(attention_chunk=64), NotImplementedError, "attention_chunk=64"),
    (dict(num_splits=2), NotImplementedError, "num_splits=2"),
    (dict(pack_gqa=True), NotImplementedError, "pack_gqa=True"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must be a pair"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(schedule="fastest"), ValueError, "unknown schedule"),
])
def test_varlen_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        dash_fa3.flash_attn_varlen_func(**varlen_args(**over))


def test_seqused_equal_to_the_lengths_is_accepted():
    """FA3's callers pass seqused = the documents' lengths when no token is unused (FA3's own
    varlen test does): the same result as without it."""
    g = torch.Generator().manual_seed(3)
    args = varlen_args(**{name: torch.randn(*shape, generator=g).to(torch.bfloat16)
                          for name, shape in (("q", (6, 2, 64)), ("k", (7, 1, 64)), ("v", (7, 1, 64)))})
    want = dash_fa3.flash_attn_varlen_func(**args, causal=True)
    got = dash_fa3.flash_attn_varlen_func(**args, causal=True, seqused_q=torch.tensor([2, 4], dtype=I32),
                                          seqused_k=torch.tensor([3, 4], dtype=I32))
    assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(window_size=(1, 2, 3)), ValueError, "window_size must be a pair"),
    (dict(window_size=5), ValueError, "window_size must be a pair"),
    (dict(window_size=(-2, 4)), ValueError, "ints >= -1"),
    (dict(window_size=(1.5, 4)), ValueError, "ints >= -1"),
    (dict(window_size=(True, 4)), ValueError, "ints >= -1"),
    (dict(window_size=torch.tensor([1.0, 4.0])), ValueError, "ints >= -1"),
    (dict(window_size=torch.tensor([True, False])), ValueError, "ints >= -1"),
    (dict(window_size=torch.tensor([-2, 4])), ValueError, "ints >= -1"),
    (dict(window_size=torch.tensor([1, 2, 3])), ValueError, "window_size must be a pair"),
    (dict(softcap=-3.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="30"), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=True), ValueError, "softcap must be a finite number >= 0"),
])
def test_window_and_softcap_errors(kwargs, exc, match):
    q = k = v = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(exc, match=match):
        dash_fa3.flash_attn_func(q, k, v, **kwargs)


def test_host_offsets_are_read_once_per_tensor_version():
    c = cu([3, 0, 5])
    first = ops.host_offsets(c)
    assert first == (0, 3, 3, 8) and ops.host_offsets(c) is first  # the cached copy
    c[1:] += 1  # in place: a new version, read again
    assert ops.host_offsets(c) == (0, 4, 4, 9)
    d = cu([3, 0, 5])  # another tensor with the values of the first
    assert ops.host_offsets(d) == first and ops.host_offsets(d) is not first
    key = id(d)
    del d
    assert key not in ops._HOST_LENGTHS  # dropped with its tensor


@pytest.mark.gpu
@pytest.mark.parametrize("call", ["softcap", "window_softcap", "varlen_softcap"])
def test_cuda_softcap_without_its_kernels_names_the_build_switch(call):
    # A build with the softcap kernels runs these (tests/test_gpu_softcap.py); one without
    # them raises before any kernel runs, naming DASH_FA3_SOFTCAP=1, and never falls back.
    from dash_fa3 import _ext

    if _ext.built_variants("fwd", False, True) or _ext.built_variants("fwd", True, True):
        pytest.skip("this build has softcap kernels")
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu_s = torch.tensor([0, 7, 16], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap forward kernel .*DASH_FA3_SOFTCAP=1"):
        if call == "window_softcap":
            dash_fa3.flash_attn_func(q, q, q, window_size=(4, 0), softcap=30.0)
        elif call == "softcap":
            dash_fa3.flash_attn_func(q, q, q, causal=True, softcap=30.0)
        else:
            dash_fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu_s, cu_s, 9, 9, window_size=(3, 3), softcap=5.0)


@pytest.mark.gpu
def test_cuda_windows_that_mask_nothing_more_run_the_kernels():
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(-1, 0)), dash_fa3.flash_attn_func(q, k, v, causal=True))
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(63, 63)), dash_fa3.flash_attn_func(q, k, v))


def test_window_skips_key_blocks_outside_it():
    # O(window) work per row: rows [40, 44) with window (3, 2) meet keys [37, 45] only.
    x = torch.zeros(1, 100, 1, 8)
    L = reference._Layout(x, x, None, False, torch.float32, 4, (3, 2), 0.0)
    blocks = [(j0, j1) for j0, j1, _ in L.key_blocks(40, 44)]
    assert blocks[0][0] == 37 and blocks[-1][1] == 46 and sum(j1 - j0 for j0, j1 in blocks) == 9


def test_window_size_may_be_an_integer_tensor_or_numpy_ints():
    """FA3's own varlen test passes window_size as a 2-entry integer tensor."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 9, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    want = dash_fa3.flash_attn_func(q, k, v, window_size=(3, 1))
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=torch.tensor([3, 1])), want)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=np.array([3, 1])), want)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=[np.int64(3), torch.tensor(1)]), want)
