"""The Hopper forward kernel against the fp32 reference (GPU)."""

import math
import random

import pytest
import torch

from attn_utils import assert_close_to_ref, attention_lowp, make_inputs, require_built
from conftest import poison_cuda_allocator
import dash_fa3
from dash_fa3 import reference, variants

pytestmark = pytest.mark.gpu

# Ragged lengths, seqlen_q != seqlen_k both ways, GQA/MQA, batch > 1.
SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv
    (2, 256, 256, 4, 4),
    (1, 1, 1, 2, 1),
    (3, 113, 203, 6, 2),
    (1, 333, 129, 4, 1),
    (2, 1024, 1024, 2, 2),
    (1, 77, 1500, 8, 8),
]


def run_case(v, shape, seed):
    b, sq, sk, h, hkv = shape
    q, k, vv, _ = make_inputs(v, shape, seed)
    scale = 1.0 / math.sqrt(v.hdim) * (0.5 + seed % 3 * 0.5)
    poison_cuda_allocator(1 << 28)
    out, lse = dash_fa3.flash_attn_func(q, k, vv, softmax_scale=scale, causal=v.causal, return_attn_probs=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.attention_ref(q, k, vv, scale, v.causal)
    lp_out, lp_lse = attention_lowp(q, k, vv, scale, v.causal)
    assert out.shape == (b, sq, h, v.hdim_v) and lse.shape == (b, h, sq)
    assert_close_to_ref("out", out, lp_out, ref_out)
    assert_close_to_ref("lse", lse, lp_lse, ref_lse)


# The full and causal kernels; the local (window) ones: tests/test_gpu_window.py.
FIXED_MASK_VARIANTS = [v for v in variants.ALL_VARIANTS if not v.local]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v", FIXED_MASK_VARIANTS, ids=lambda v: v.name)
def test_forward_matches_reference(v, shape):
    require_built(v, "fwd")
    run_case(v, shape, seed=hash((v.name, shape)) % 1000)


@pytest.mark.parametrize("v", FIXED_MASK_VARIANTS, ids=lambda v: v.name)
def test_forward_random_shapes(v):
    require_built(v, "fwd")
    rng = random.Random(v.name)
    for i in range(4):
        hkv = rng.choice([1, 2, 3])
        shape = (rng.randint(1, 3), rng.randint(1, 700), rng.randint(1, 700), hkv * rng.choice([1, 2, 4]), hkv)
        run_case(v, shape, seed=i)


# Both sides of the run-time switches (csrc/kernels/fwd/fwd_launch.cuh): dense causal
# hdim 64 runs three MMA warpgroups from kCausalThreeWarpgroupsFrom (2048) query rows
# on; full hdim 128 and (192, 128) write O through V's buffer instead of a shared O slot
# from kSharedOutputSlotBelowKeys (2048) keys on; ragged, seqlen_q != seqlen_k both ways, GQA.
LONG_SHAPES = [
    (1, 2047, 2047, 2, 1),
    (2, 2048, 2048, 4, 2),
    (1, 2100, 1500, 2, 2),
    (1, 4095, 4095, 2, 1),
    (1, 4096, 4096, 2, 2),
    (1, 4200, 5000, 4, 2),
    (1, 5000, 4100, 2, 1),
]


@pytest.mark.parametrize("shape", LONG_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "v", [v for v in FIXED_MASK_VARIANTS if v.hdim in (64, 128) or v.hdim_v != v.hdim], ids=lambda v: v.name
)
def test_forward_long_sequences(v, shape):
    require_built(v, "fwd")
    run_case(v, shape, seed=sum(shape))


def test_forward_arbitrary_strides():
    v = variants.Variant(128, "bf16", "causal")
    require_built(v, "fwd")
    base = torch.randn(2, 300, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, vv = base[:, :, 0], base[:, :, 1, :4], base[:, :, 2, :4]  # interleaved qkv, GQA 8/4
    out = dash_fa3.flash_attn_func(q, k, vv, causal=True)
    ref, _ = reference.attention_ref(q, k, vv, None, True)
    lp, _ = attention_lowp(q, k, vv, 128 ** -0.5, True)
    assert_close_to_ref("out", out, lp, ref)
