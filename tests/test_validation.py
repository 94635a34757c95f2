"""Input validation of flash_attn_func: every bad input gets a clear error (CPU)."""

import pytest
import torch

import dash_fa3
from dash_fa3 import _ext, validation


def qkv(b=2, sq=16, sk=16, h=4, hkv=2, d=64, dtype=torch.bfloat16):
    return (
        torch.randn(b, sq, h, d, dtype=dtype),
        torch.randn(b, sk, hkv, d, dtype=dtype),
        torch.randn(b, sk, hkv, d, dtype=dtype),
    )


def test_valid_inputs_pass():
    q, k, v = qkv()
    shape = validation.check_attention_inputs(q, k, v, causal=True)
    assert (shape.batch, shape.seqlen_q, shape.heads, shape.heads_kv, shape.headdim, shape.dtype) == (2, 16, 4, 2, 64, "bf16")


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, "bfloat16 or torch.float16"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share a dtype"),
        (lambda q, k, v: (q[0], k, v), ValueError, "4 dims"),
        (lambda q, k, v: (q, k, v[:, :8]), ValueError, "agree on all dims but the last"),
        (lambda q, k, v: (q, k, v[..., :32]), ValueError, "q/k 64 with v 32 is not supported"),
        (lambda q, k, v: (q[:1], k, v), ValueError, "batch sizes differ"),
        (lambda q, k, v: (q[..., :32], k, v), ValueError, "head dims differ"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "zero-length"),
        (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, "zero-length"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "heads % heads_kv"),
        (lambda q, k, v: (q.transpose(1, 3), k.transpose(1, 3), v.transpose(1, 3)), ValueError, "contiguous last dim"),
        (lambda q, k, v: (q, k, "v"), TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs(mutate, exc, match):
    q, k, v = mutate(*qkv())
    with pytest.raises(exc, match=match):
        dash_fa3.flash_attn_func(q, k, v)


def test_unsupported_head_dim():
    q, k, v = qkv(d=80)
    with pytest.raises(ValueError, match="head dim 80 is not supported"):
        dash_fa3.flash_attn_func(q, k, v)


def test_value_head_dim_of_mla_is_accepted():
    """(192, v 128) runs (here on the CPU reference); out has v's head dim."""
    q, k, v = qkv(d=192)
    shape = validation.check_attention_inputs(q, k, v[..., :128], causal=True)
    assert (shape.headdim, shape.headdim_v) == (192, 128)
    assert shape.variant(True).name == "hdim192v128-bf16-causal"
    assert dash_fa3.flash_attn_func(q, k, v[..., :128].contiguous(), causal=True).shape == (2, 16, 4, 128)


def test_non_contiguous_last_dim_names_the_fix():
    q, k, v = qkv()
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match=r"q must have a contiguous last dim.*\.contiguous\(\)"):
        dash_fa3.flash_attn_func(q, k, v)


def test_unknown_schedule():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown schedule 'fastest'"):
        dash_fa3.flash_attn_func(q, k, v, schedule="fastest")


@pytest.mark.parametrize("name", validation.schedule_names())
def test_known_schedules_accepted(name):
    q, k, v = qkv(sq=4, sk=4, h=2, hkv=1)
    validation.check_attention_inputs(q, k, v, causal=False, schedule=name)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_splits=2), "num_splits"),
        (dict(pack_gqa=True), "pack_gqa"),
        (dict(qv=torch.zeros(1)), "qv"),
        (dict(q_descale=torch.ones(1)), "fp8"),
        (dict(attention_chunk=64), "attention_chunk"),
    ],
)
def test_unsupported_fa3_features_raise(kwargs, match):
    # Windows and softcap run on CPU tensors (tests/test_reference_varlen_window.py).
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=match):
        dash_fa3.flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf"), "0.1"])
def test_bad_softmax_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale"):
        dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale)


def test_bad_sm_margin():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="sm_margin"):
        dash_fa3.flash_attn_func(q, k, v, sm_margin=-1)


@pytest.fixture
def uncached_checks():
    """The device and build checks cache their verdicts; start and end each test with empty caches."""
    for check in (validation.check_cuda_device, validation.check_built):
        check.cache_clear()
    yield
    for check in (validation.check_cuda_device, validation.check_built):
        check.cache_clear()


def test_non_hopper_gpu_is_refused(monkeypatch, uncached_checks):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"need a Hopper GPU.*A100.*sm_80"):
        validation.check_cuda_device(torch.device("cuda:0"))


def test_variant_not_built_names_the_rebuild(monkeypatch, uncached_checks):
    built = ("hdim128-bf16-causal", "hdim128-bf16-full")
    monkeypatch.setattr(_ext, "built_variants", lambda direction, packed=False, softcap=False: built)
    with pytest.raises(ValueError, match=r"hdim64-fp16-full was not compiled.*DASH_FA3_VARIANTS=hdim64"):
        validation.check_built(dash_fa3.variants.Variant(64, "fp16", "full").name)
    validation.check_built(dash_fa3.variants.Variant(128, "bf16", "full").name)


def test_missing_extension_reason_is_actionable(monkeypatch):
    if _ext.available():
        pytest.skip("the extension is built here")
    with pytest.raises(RuntimeError, match="pip install"):
        _ext.ops()
