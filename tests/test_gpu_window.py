"""Sliding-window (local) attention on the Hopper kernels: forward and backward
against the fp32 reference (error within 2x a plain PyTorch 16-bit
implementation's, fresh random inputs, poisoned outputs), every schedule, and
bitwise determinism of the deterministic backward for every schedule (GPU)."""

import math
import random

import pytest
import torch

from attn_utils import assert_bitwise_repeatable, assert_close_to_ref, attention_lowp, make_inputs, require_built
from conftest import poison_cuda_allocator
import dash_fa3
from dash_fa3 import _ext, ops, reference, variants
from dash_fa3.schedule import SCHEDULES, Geometry, bwd_block_sizes
from dash_fa3.schedule.lowering import get_kernel_metadata

pytestmark = pytest.mark.gpu

LOCAL = [v for v in variants.ALL_VARIANTS if v.local]
SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv
    (2, 256, 256, 4, 4),
    (1, 1000, 1000, 2, 2),  # ragged last tiles
    (1, 700, 1200, 4, 2),   # seqlen_q < seqlen_k, GQA: with a left bound the first keys are seen by no query
    (2, 1100, 333, 2, 1),   # seqlen_q > seqlen_k, MQA: with a right bound the first rows see no key
    (1, 1, 77, 3, 3),
]
# (window_size, causal) as passed to flash_attn_func.
WINDOWS = [
    ((0, 0), False),      # the diagonal only
    ((1, 0), False),
    ((0, 1), False),
    ((64, -1), False),    # left only
    ((-1, 64), False),    # right only
    ((100, 37), False),   # both
    ((128, 0), False),    # causal with a left bound, as a window
    ((200, -1), True),    # ... as causal + left
    ((3, 250), False),
]


def case_id(w):
    return f"w{w[0][0]}_{w[0][1]}" + ("_causal" if w[1] else "")


def forward(q, k, v, scale, window, causal, **kw):
    poison_cuda_allocator(1 << 28)
    out, lse = dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                        return_attn_probs=True, **kw)
    torch.cuda.synchronize()
    return out, lse


def check_forward(v, shape, window, causal, seed):
    b, sq, sk, h, hkv = shape
    q, k, vv, _ = make_inputs(v, shape, seed)
    scale = 1.0 / math.sqrt(v.hdim) * (0.5 + seed % 3 * 0.5)
    out, lse = forward(q, k, vv, scale, window, causal)
    ref_out, ref_lse = reference.attention_ref(q, k, vv, scale, causal, window_size=window)
    lp_out, lp_lse = attention_lowp(q, k, vv, scale, causal, window)
    assert out.shape == (b, sq, h, v.hdim_v) and lse.shape == (b, h, sq)
    assert_close_to_ref("out", out, lp_out, ref_out)
    assert_close_to_ref("lse", lse, lp_lse, ref_lse)


def grads(q, k, v, dout, scale, window, causal, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    poison_cuda_allocator(1 << 28)
    out = dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def lowp_grads(q, k, v, dout, scale, window, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = attention_lowp(q, k, v, scale, causal, window)
    return torch.autograd.grad(out, (q, k, v), dout)


def check_backward(v, shape, window, causal, seed, schedule="auto", deterministic=True):
    q, k, vv, dout = make_inputs(v, shape, seed)
    scale = 1.0 / math.sqrt(v.hdim) * (0.75 + 0.25 * (seed % 3))
    out, dq, dk, dv = grads(q, k, vv, dout, scale, window, causal, deterministic=deterministic, schedule=schedule)
    ref = reference.attention_bwd_ref(dout, q, k, vv, out, scale, causal, window_size=window)
    lowp = lowp_grads(q, k, vv, dout, scale, window, causal)
    for name, ours, want, base in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, lowp):
        assert ours.shape == want.shape and ours.dtype == q.dtype
        assert_close_to_ref(name, ours, base, want)
    return dq, dk, dv


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("window", WINDOWS, ids=case_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v", LOCAL, ids=lambda v: v.name)
def test_forward_matches_reference(v, shape, window):
    require_built(v, "fwd")
    check_forward(v, shape, *window, seed=hash((v.name, shape, window)) % 1000)


@pytest.mark.parametrize("v", LOCAL, ids=lambda v: v.name)
def test_forward_random_windows(v):
    require_built(v, "fwd")
    rng = random.Random(v.name)
    for i in range(6):
        hkv = rng.choice([1, 2])
        shape = (rng.randint(1, 2), rng.randint(1, 900), rng.randint(1, 900), hkv * rng.choice([1, 2, 3]), hkv)
        window = (rng.choice([-1, 0, rng.randint(0, 300)]), rng.choice([-1, 0, rng.randint(0, 300)]))
        check_forward(v, shape, window, False, seed=i)


@pytest.mark.parametrize("v", LOCAL, ids=lambda v: v.name)
def test_local_kernel_with_windows_wider_than_the_sequence(v):
    """flash_attn_func sends such windows to the full / causal kernels (FA3's normalisation);
    the local kernel itself, reached through the op, must give the same attention."""
    require_built(v, "fwd")
    shape = (1, 300, 500, 4, 2)
    q, k, vv, _ = make_inputs(v, shape, 5)
    scale = v.hdim ** -0.5
    for window in ((5000, 5000), (5000, 0), (499, 299), (-1, 299)):
        poison_cuda_allocator(1 << 28)
        out, lse = ops.attention_general(q, k, vv, None, None, 0, 0, scale, *window, 0.0, 0, True, "auto")
        ref_out, ref_lse = reference.attention_ref(q, k, vv, scale, window_size=window)
        lp_out, lp_lse = attention_lowp(q, k, vv, scale, False, window)
        assert_close_to_ref("out", out, lp_out, ref_out)
        assert_close_to_ref("lse", lse, lp_lse, ref_lse)


def test_windows_that_mask_nothing_more_run_the_fixed_kernels():
    v = variants.Variant(128, "bf16", "causal")
    require_built(v, "fwd")
    require_built(variants.Variant(128, "bf16", "full"), "fwd")
    q, k, vv, _ = make_inputs(v, (1, 200, 200, 2, 2), 1)
    assert torch.equal(dash_fa3.flash_attn_func(q, k, vv, window_size=(-1, 0)),
                       dash_fa3.flash_attn_func(q, k, vv, causal=True))
    assert torch.equal(dash_fa3.flash_attn_func(q, k, vv, window_size=(199, 199)), dash_fa3.flash_attn_func(q, k, vv))


def test_bad_windows_are_refused_by_the_dispatch():
    v = variants.Variant(128, "bf16", "local")
    require_built(v, "fwd")
    q, k, vv, _ = make_inputs(v, (1, 64, 64, 2, 2), 1)
    with pytest.raises(RuntimeError, match="window"):
        _ext.ops().fwd_window(q, k, vv, 0.1, -2, 0, 0.0, 0)


# ---------------------------------------------------------------- backward


@pytest.mark.parametrize("window", WINDOWS, ids=case_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v", LOCAL, ids=lambda v: v.name)
def test_gradients_match_reference(v, shape, window):
    require_built(v, "bwd")
    check_backward(v, shape, *window, seed=sum(shape), deterministic=True)
    check_backward(v, shape, *window, seed=sum(shape) + 1, deterministic=False)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("window", [((256, 0), False), ((100, 300), False), ((300, -1), False)], ids=case_id)
def test_every_schedule_is_correct(schedule, window):
    v = variants.Variant(128, "bf16", "local")
    require_built(v, "bwd")
    check_backward(v, (2, 1000, 1200, 4, 2), *window, seed=3, schedule=schedule, deterministic=True)


@pytest.mark.parametrize("v", LOCAL, ids=lambda v: v.name)
def test_random_windows(v):
    require_built(v, "bwd")
    rng = random.Random(v.name + "bwd")
    for i in range(4):
        hkv = rng.choice([1, 2])
        shape = (rng.randint(1, 2), rng.randint(1, 900), rng.randint(1, 900), hkv * rng.choice([1, 2, 3]), hkv)
        window = (rng.choice([-1, 0, rng.randint(0, 300)]), rng.choice([-1, 0, rng.randint(0, 300)]))
        check_backward(v, shape, window, False, seed=i, schedule=rng.choice(SCHEDULES), deterministic=bool(i % 2))


def test_keys_no_query_sees_get_zero_gradients():
    """(left 100, causal) with seqlen_k - seqlen_q = 700: keys below 600 are seen by no
    query; their KV tiles are tasks without steps, which store dK = dV = 0 exactly."""
    v = variants.Variant(128, "bf16", "local")
    require_built(v, "bwd")
    for deterministic, heads in ((True, (4, 2)), (False, (2, 2))):
        dq, dk, dv = check_backward(v, (1, 300, 1000, *heads), (100, 0), False, seed=9, deterministic=deterministic)
        assert torch.all(dk[:, :600] == 0) and torch.all(dv[:, :600] == 0)
        assert dk[:, 600:].abs().sum() > 0


def test_schedule_built_for_another_window_is_refused():
    v = variants.Variant(128, "bf16", "local")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, (1, 512, 512, 2, 2), 2)
    out, lse = ops.attention_general(q, k, vv, None, None, 0, 0, 0.1, 64, 0, 0.0, 0, True, "auto")
    bm, bn = bwd_block_sizes(128)
    g = Geometry(1, 2, 2, 512, 512, bm, bn, "local", 65, 0)
    flat = torch.from_numpy(get_kernel_metadata("fa3", g, torch.cuda.get_device_properties(0).multi_processor_count)
                            .as_int32_array())
    with pytest.raises(RuntimeError, match="window"):
        _ext.ops().bwd(dout, q, k, vv, out, lse, flat.cuda(), flat, 0.1, 64, 0, 0.0, True)


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", [
    ((2, 2048, 2048, 8, 4), (256, 0)),   # sliding causal window, GQA
    ((1, 1500, 2000, 4, 2), (300, 100)),  # both sides, seqlen_q < seqlen_k (first KV tiles unseen)
], ids=["2048_w256_0", "1500x2000_w300_100"])
def test_deterministic_is_bitwise_for_every_schedule(schedule, case):
    shape, window = case
    v = variants.Variant(128, "bf16", "local")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, shape, 5)
    assert_bitwise_repeatable(
        lambda: grads(q, k, vv, dout, None, window, False, deterministic=True, schedule=schedule)[1:], 20)


def test_schedules_agree_within_rounding():
    v = variants.Variant(128, "bf16", "local")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, (2, 1536, 1536, 4, 2), 11)
    results = {s: grads(q, k, vv, dout, None, (384, 0), False, deterministic=True, schedule=s)[1:]
               for s in SCHEDULES}
    base = results["fa3"]
    for s, gs in results.items():
        for a, b in zip(gs, base):
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert rel < 2e-3, (s, rel)
