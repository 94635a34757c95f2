"""Softcapped scores (softcap > 0: softcap * tanh(scale * q.k / softcap), FA3's; the Gemma 2
family) on the Hopper kernels of a DASH_FA3_SOFTCAP=1 build: forward and backward against the
fp32 reference (error within 2x a plain PyTorch 16-bit implementation's that caps the same way,
fresh random inputs, poisoned outputs), full, causal and window masks, dense and packed
documents, GQA, and bitwise determinism of the deterministic backward for every schedule (GPU)."""

import math

import pytest
import torch

from attn_utils import assert_bitwise_repeatable, assert_close_to_ref, attention_lowp, make_inputs, require_built
from conftest import poison_cuda_allocator
import dash_fa3
from dash_fa3 import reference, variants
from dash_fa3.schedule import SCHEDULES

from test_gpu_varlen import cumsum, doc_mix, lowp_grads_per_doc, lowp_per_doc, packed_inputs

pytestmark = pytest.mark.gpu

# (window_size, causal) as passed to flash_attn_func, and the kernel family it runs.
MASKS = [((-1, -1), False, "full"), ((-1, -1), True, "causal"), ((100, 37), False, "local")]
SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv
    (2, 300, 300, 4, 4),
    (1, 700, 1200, 4, 2),  # seqlen_q < seqlen_k, GQA
    (1, 1100, 333, 2, 1),  # seqlen_q > seqlen_k, MQA: with causal the first rows see no key
]
# 30 and 50 are the Gemma 2 caps (attention, final logits); 2 caps hard (scores of a few units).
CAPS = [2.0, 30.0]


def mask_id(m):
    return m[2] + ("_causal" if m[1] else "")


def variant_of(hdim, kind, hdim_v=None):
    return variants.Variant(hdim, "bf16", kind, hdim_v)


# Every head-dim pair with kernels (MLA's (192, 128) included), named as variants name them.
PAIRS = dict(argvalues=variants.HEADDIM_PAIRS, ids=lambda p: variants.Variant(p[0], "bf16", "full", p[1]).hdims)


def grads(q, k, v, dout, scale, window, causal, softcap, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    poison_cuda_allocator(1 << 28)
    out = dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                   **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def lowp_grads(q, k, v, dout, scale, window, causal, softcap):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = attention_lowp(q, k, v, scale, causal, window, softcap)
    return torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("hdims", **PAIRS)
def test_forward_matches_reference(hdims, mask, shape, softcap):
    hdim, hdim_v = hdims
    window, causal, kind = mask
    v = variant_of(hdim, kind, hdim_v)
    require_built(v, "fwd", softcap=True)
    q, k, vv, _ = make_inputs(v, shape, seed=sum(shape) + hdim)
    scale = 1.0 / math.sqrt(hdim) * 2  # scores of several units: the cap bites
    poison_cuda_allocator(1 << 28)
    out, lse = dash_fa3.flash_attn_func(q, k, vv, softmax_scale=scale, causal=causal, window_size=window,
                                        softcap=softcap, return_attn_probs=True)
    ref_out, ref_lse = reference.attention_ref(q, k, vv, scale, causal, window_size=window, softcap=softcap)
    lp_out, lp_lse = attention_lowp(q, k, vv, scale, causal, window, softcap)
    assert_close_to_ref("out", out, lp_out, ref_out)
    assert_close_to_ref("lse", lse, lp_lse, ref_lse)
    # The cap changes the result: the kernel did not ignore it.
    plain = dash_fa3.flash_attn_func(q, k, vv, softmax_scale=scale, causal=causal, window_size=window)
    assert (plain.float() - ref_out.float()).abs().max() > 2 * (out.float() - ref_out.float()).abs().max()


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("hdims", **PAIRS)
def test_gradients_match_reference(hdims, mask, shape, softcap, deterministic):
    hdim, hdim_v = hdims
    window, causal, kind = mask
    v = variant_of(hdim, kind, hdim_v)
    require_built(v, "bwd", softcap=True)
    q, k, vv, dout = make_inputs(v, shape, seed=sum(shape) + hdim + 1)
    scale = 1.0 / math.sqrt(hdim) * 2
    out, dq, dk, dv = grads(q, k, vv, dout, scale, window, causal, softcap, deterministic=deterministic)
    ref = reference.attention_bwd_ref(dout, q, k, vv, out, scale, causal, window_size=window, softcap=softcap)
    lowp = lowp_grads(q, k, vv, dout, scale, window, causal, softcap)
    for name, ours, want, base in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, lowp):
        assert ours.shape == want.shape and ours.dtype == q.dtype
        assert_close_to_ref(name, ours, base, want)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_deterministic_backward_is_bitwise_for_every_schedule(schedule):
    v = variant_of(128, "causal")
    require_built(v, "bwd", softcap=True)
    q, k, vv, dout = make_inputs(v, (2, 1024, 1024, 8, 2), seed=7)
    assert_bitwise_repeatable(
        lambda: grads(q, k, vv, dout, 0.15, (-1, -1), True, 30.0, deterministic=True, schedule=schedule)[1:], 3)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_packed_documents_match_reference(mask, deterministic):
    window, causal, kind = mask
    v = variant_of(128, kind)
    require_built(v, "bwd", "packed", softcap=True)
    lq, lk = doc_mix(5, 9, 900, True)
    q, k, vv = packed_inputs(v, lq, lk, 4, 2, 5)
    dout = torch.randn_like(q)
    cu_q, cu_k = cumsum(lq), cumsum(lk)
    scale, softcap = 0.2, 5.0
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, vv))
    poison_cuda_allocator(1 << 28)
    out, lse = dash_fa3.flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(lq), max(lk), softmax_scale=scale,
                                               causal=causal, window_size=window, softcap=softcap,
                                               deterministic=deterministic, return_attn_probs=True)
    got = torch.autograd.grad(out, (qg, kg, vg), dout)
    kw = dict(window_size=window, softcap=softcap)
    ref_out, ref_lse = reference.attention_varlen_ref(q, k, vv, cu_q, cu_k, scale, causal, **kw)
    ref = reference.attention_varlen_bwd_ref(dout, q, k, vv, ref_out, cu_q, cu_k, scale, causal, **kw)
    # The 16-bit baseline per document, capped the same way.
    lp_out, lp_lse = lowp_per_doc(q, k, vv, cu_q, cu_k, scale, window, causal, softcap)
    lp_grads = lowp_grads_per_doc(q, k, vv, dout, cu_q, cu_k, scale, window, causal, softcap)
    assert_close_to_ref("out", out, lp_out, ref_out)
    assert_close_to_ref("lse", lse, lp_lse, ref_lse)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lp_grads, ref):
        assert_close_to_ref(name, ours, torch.zeros_like(ours) if lp is None else lp, r)
