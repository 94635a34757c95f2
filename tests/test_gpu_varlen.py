"""Packed documents (flash_attn_varlen_func) on the Hopper forward kernels: against the fp32
reference per document (error within 2x a plain PyTorch 16-bit implementation's, fresh random
inputs, poisoned outputs), empty and one-token documents, seqlen_q != seqlen_k per document,
windows, GQA; and bitwise equal to the dense kernels where the two describe the same problem
(GPU)."""

import math
import random

import pytest
import torch

from attn_utils import TORCH_DTYPES, assert_close_to_ref, attention_lowp, require_built
from conftest import poison_cuda_allocator
import dash_fa3
from dash_fa3 import reference, variants

pytestmark = pytest.mark.gpu

# (window_size, causal) as passed to flash_attn_varlen_func, with the kernel family it runs.
MASKS = [((-1, -1), False, "full"), ((-1, -1), True, "causal"), ((100, 37), False, "local"),
         ((64, -1), True, "local")]


def doc_mix(seed, docs, longest, same_qk):
    """Document lengths (q, k): a fixed-seed mix with empty and one-token documents."""
    rng = random.Random(seed)
    lq = [rng.choice([0, 1, 2, 63, 128, 129, rng.randint(1, longest)]) for _ in range(docs)]
    lk = list(lq) if same_qk else [rng.choice([0, 1, 77, rng.randint(1, longest)]) for _ in range(docs)]
    return lq, lk


def cumsum(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def packed_inputs(v, lq, lk, heads, heads_kv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DTYPES[v.dtype]
    q = torch.randn(sum(lq), heads, v.hdim, device="cuda", dtype=dt, generator=g)
    k = torch.randn(sum(lk), heads_kv, v.hdim, device="cuda", dtype=dt, generator=g)
    vv = torch.randn(sum(lk), heads_kv, v.hdim_v, device="cuda", dtype=dt, generator=g)
    return q, k, vv


def lowp_per_doc(q, k, v, cu_q, cu_k, scale, window, causal, softcap=0.0):
    """The 16-bit baseline, one document at a time, in FA3's varlen layout (scores capped by
    ``softcap`` > 0 as attention_lowp does)."""
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        o, l = attention_lowp(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal, window, softcap)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


EQUAL_DOCS = (3, 333)  # documents, tokens each


def equal_documents(v, seed):
    """q, k, v, dout of a dense batch of EQUAL_DOCS rows (heads 4 / 2), to be packed."""
    b, s = EQUAL_DOCS
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = TORCH_DTYPES[v.dtype]
    q = torch.randn(b, s, 4, v.hdim, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, s, 2, v.hdim, device="cuda", dtype=dt, generator=g)
    vv = torch.randn(b, s, 2, v.hdim_v, device="cuda", dtype=dt, generator=g)
    return q, k, vv, torch.randn(b, s, 4, v.hdim_v, device="cuda", dtype=dt, generator=g)


def run_varlen(q, k, v, cu_q, cu_k, lq, lk, scale, window, causal):
    poison_cuda_allocator(1 << 28)
    out, lse = dash_fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq + [0]), max(lk + [0]),
                                               softmax_scale=scale, causal=causal, window_size=window,
                                               return_attn_probs=True)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("v", [v for v in variants.ALL_VARIANTS if v.mask == "causal"], ids=lambda v: v.name)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m[2] + ("_causal" if m[1] else "") + f"_{m[0][0]}_{m[0][1]}")
@pytest.mark.parametrize("case", [(0, 7, 700, True, 4, 4), (1, 12, 1500, True, 4, 2), (2, 9, 600, False, 2, 1),
                                  (3, 1, 2048, True, 3, 3)])
def test_varlen_forward_matches_reference(v, mask, case):
    window, causal, kind = mask
    require_built(variants.Variant(v.hdim, v.dtype, kind, v.hdim_v), "fwd", "packed")
    seed, docs, longest, same_qk, heads, heads_kv = case
    lq, lk = doc_mix(seed, docs, longest, same_qk)
    q, k, vv = packed_inputs(v, lq, lk, heads, heads_kv, seed)
    cu_q, cu_k = cumsum(lq), cumsum(lk)
    scale = 1.0 / math.sqrt(v.hdim) * (0.5 + seed % 3 * 0.5)
    out, lse = run_varlen(q, k, vv, cu_q, cu_k, lq, lk, scale, window, causal)
    assert out.shape == (*q.shape[:2], v.hdim_v) and lse.shape == (heads, q.shape[0])
    ref_out, ref_lse = reference.attention_varlen_ref(q, k, vv, cu_q, cu_k, scale, causal, window_size=window)
    lp_out, lp_lse = lowp_per_doc(q, k, vv, cu_q, cu_k, scale, window, causal)
    # Rows that attend no key: out exactly 0, lse -inf (the reference's too).
    assert_close_to_ref("out", out, lp_out, ref_out)
    assert_close_to_ref("lse", lse, lp_lse, ref_lse)


@pytest.mark.parametrize("v", [v for v in variants.ALL_VARIANTS if v.mask != "local"], ids=lambda v: v.name)
def test_varlen_of_equal_documents_is_the_dense_kernel_bitwise(v):
    # Equal documents packed are the dense batch: the same tiles in the same order, the same bits.
    require_built(v, "fwd", "packed")
    require_built(v, "fwd")
    b, s = EQUAL_DOCS
    q, k, vv, _ = equal_documents(v, 11)
    dense_out, dense_lse = dash_fa3.flash_attn_func(q, k, vv, causal=v.causal, return_attn_probs=True)
    cu_s = cumsum([s] * b)
    out, lse = dash_fa3.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), vv.flatten(0, 1), cu_s, cu_s, s, s,
                                               causal=v.causal, return_attn_probs=True)
    assert torch.equal(out, dense_out.flatten(0, 1))
    assert torch.equal(lse, dense_lse.transpose(0, 1).flatten(1, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_with_more_documents_than_the_order_kernel_has_threads(causal):
    """1100 documents: the order kernel (kernels/fwd/fwd_packed_order.cu, 1024 threads) sorts
    and scans them in two steps, many documents share a bucket, and the CTAs take many
    more units than there are SMs off the counter."""
    v = variants.Variant(64, "bf16", "causal" if causal else "full")
    require_built(v, "fwd", "packed")
    rng = random.Random(7)
    lq = [rng.choice([0, 1, 5, 40, 40, 129, 300]) for _ in range(1100)] + [1000, 2000]
    rng.shuffle(lq)
    q, k, vv = packed_inputs(v, lq, lq, 2, 1, 7)
    cu = cumsum(lq)
    scale = 1.0 / math.sqrt(v.hdim)
    out, lse = run_varlen(q, k, vv, cu, cu, lq, lq, scale, (-1, -1), causal)
    ref_out, ref_lse = reference.attention_varlen_ref(q, k, vv, cu, cu, scale, causal)
    lp_out, lp_lse = lowp_per_doc(q, k, vv, cu, cu, scale, (-1, -1), causal)
    assert_close_to_ref("out", out, lp_out, ref_out)
    assert_close_to_ref("lse", lse, lp_lse, ref_lse)


def test_varlen_forward_without_tokens():
    v = variants.Variant(64, "bf16", "causal")
    require_built(v, "fwd", "packed")
    q = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    empty = torch.zeros(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(3, dtype=torch.int32, device="cuda")
    out, lse = dash_fa3.flash_attn_varlen_func(q, empty, empty, cu_q, cu_k, 3, 0, causal=True, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(q)) and bool((lse == -math.inf).all())


# ---------------------------------------------------------------- backward

def lowp_grads_per_doc(q, k, v, dout, cu_q, cu_k, scale, window, causal, softcap=0.0):
    """Gradients of the 16-bit baseline, one document at a time."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = lowp_per_doc(q, k, v, cu_q, cu_k, scale, window, causal, softcap)
    return torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)


def varlen_grads(q, k, v, dout, cu_q, cu_k, lq, lk, scale, window, causal, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    poison_cuda_allocator(1 << 28)
    out = dash_fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq + [0]), max(lk + [0]), softmax_scale=scale,
                                          causal=causal, window_size=window, **kw)
    return tuple(torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("v", [v for v in variants.ALL_VARIANTS if v.mask == "causal"], ids=lambda v: v.name)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m[2] + ("_causal" if m[1] else "") + f"_{m[0][0]}_{m[0][1]}")
@pytest.mark.parametrize("case", [(0, 7, 700, True, 4, 4), (1, 12, 1500, True, 4, 2), (2, 9, 600, False, 2, 1)])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_varlen_gradients_match_reference(v, mask, case, deterministic):
    window, causal, kind = mask
    require_built(variants.Variant(v.hdim, v.dtype, kind, v.hdim_v), "bwd", "packed")
    seed, docs, longest, same_qk, heads, heads_kv = case
    lq, lk = doc_mix(seed, docs, longest, same_qk)
    q, k, vv = packed_inputs(v, lq, lk, heads, heads_kv, seed)
    dout = torch.randn(*q.shape[:2], v.hdim_v, device="cuda", dtype=q.dtype)
    cu_q, cu_k = cumsum(lq), cumsum(lk)
    scale = 1.0 / math.sqrt(v.hdim)
    got = varlen_grads(q, k, vv, dout, cu_q, cu_k, lq, lk, scale, window, causal, deterministic=deterministic)
    out_ref = reference.attention_varlen_ref(q, k, vv, cu_q, cu_k, scale, causal, window_size=window)[0]
    ref = reference.attention_varlen_bwd_ref(dout, q, k, vv, out_ref, cu_q, cu_k, scale, causal, window_size=window)
    lowp = lowp_grads_per_doc(q, k, vv, dout, cu_q, cu_k, scale, window, causal)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lowp, ref):
        lp = torch.zeros_like(ours) if lp is None else lp
        assert_close_to_ref(name, ours, lp, r)


@pytest.mark.parametrize("schedule", ["auto", "fa3", "spt", "descending", "lpt"])
def test_varlen_deterministic_is_bitwise_for_every_schedule(schedule):
    v = variants.Variant(128, "bf16", "causal")
    require_built(v, "bwd", "packed")
    lq, lk = doc_mix(4, 11, 1800, True)
    q, k, vv = packed_inputs(v, lq, lk, 8, 2, 4)
    dout = torch.randn_like(q)
    cu_q, cu_k = cumsum(lq), cumsum(lk)
    first = varlen_grads(q, k, vv, dout, cu_q, cu_k, lq, lk, 0.1, (-1, -1), True, deterministic=True,
                         schedule=schedule)
    for _ in range(5):
        again = varlen_grads(q, k, vv, dout, cu_q, cu_k, lq, lk, 0.1, (-1, -1), True, deterministic=True,
                             schedule=schedule)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("v", [v for v in variants.ALL_VARIANTS if v.mask != "local"], ids=lambda v: v.name)
def test_varlen_backward_of_equal_documents_is_the_dense_kernel_bitwise(v):
    # fa3 order, deterministic: the same tasks and the same dQ add order as the dense call.
    require_built(v, "bwd", "packed")
    require_built(v, "bwd")
    b, s = EQUAL_DOCS
    q, k, vv, dout = equal_documents(v, 12)
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, vv))
    out = dash_fa3.flash_attn_func(qd, kd, vd, causal=v.causal, deterministic=True, schedule="fa3")
    dense = torch.autograd.grad(out, (qd, kd, vd), dout)
    cu_s = cumsum([s] * b)
    packed = varlen_grads(q.flatten(0, 1), k.flatten(0, 1), vv.flatten(0, 1), dout.flatten(0, 1), cu_s, cu_s,
                          [s] * b, [s] * b, 1.0 / math.sqrt(v.hdim), (-1, -1), v.causal, deterministic=True,
                          schedule="fa3")
    for a, d in zip(packed, dense):
        assert torch.equal(a, d.flatten(0, 1))


def test_varlen_backward_refuses_wave_schedules():
    v = variants.Variant(64, "bf16", "causal")
    require_built(v, "bwd", "packed")
    q = torch.randn(100, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_s = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="does not run on packed documents"):
        dash_fa3.flash_attn_varlen_func(q, q, q, cu_s, cu_s, 60, 60, causal=True, deterministic=True, schedule="shift")
