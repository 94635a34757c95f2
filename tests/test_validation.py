"""Input validation of flash_attn_func: every bad input gets a clear error (CPU)."""

import numpy as np
import pytest
import torch

import dash_fa3
from dash_fa3 import _ext, reference, validation


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
        (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError,
         r"bfloat16 or torch.float16 \(or torch.float32 on the CPU\), got torch.float64"),
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


# ---------------------------------------------------------------- NumPy and 0-d tensor scalars


def _varlen(**kw):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(torch.bfloat16) for n, h in ((6, 2), (7, 1), (7, 1)))
    args = dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=4)
    return dash_fa3.flash_attn_varlen_func(**{**args, **kw})


SCALAR_CASES = [
    # (keyword, NumPy / tensor form, the Python number it stands for)
    ("softmax_scale", np.float32(0.1), float(np.float32(0.1))),
    ("softmax_scale", np.float64(0.1), 0.1),
    ("softmax_scale", np.int64(1), 1),
    ("softmax_scale", torch.tensor(0.1), float(torch.tensor(0.1))),
    ("softmax_scale", np.array(0.1), 0.1),
    ("softcap", np.float32(5.0), 5.0),
    ("softcap", torch.tensor(5.0, dtype=torch.float64), 5.0),
    ("softcap", np.int32(0), 0),
    ("window_size", (np.int64(3), np.int32(0)), (3, 0)),
    ("window_size", (torch.tensor(2), None), (2, -1)),
    ("window_size", [np.int16(-1), torch.tensor(1, dtype=torch.int32)], (-1, 1)),
    ("sm_margin", np.int64(2), 2),
    ("sm_margin", torch.tensor(2), 2),
    ("num_splits", np.int64(1), 1),
    ("num_splits", torch.tensor(0), 0),
    ("attention_chunk", np.int32(0), 0),
]


@pytest.mark.parametrize("name, value, plain", SCALAR_CASES)
def test_numpy_and_zero_dim_scalars_give_the_python_numbers_result(name, value, plain):
    q, k, v = qkv(sq=9, sk=11)
    want = dash_fa3.flash_attn_func(q, k, v, causal=False, **{name: plain})
    assert torch.equal(dash_fa3.flash_attn_func(q, k, v, causal=False, **{name: value}), want)
    assert torch.equal(_varlen(**{name: value}), _varlen(**{name: plain}))


@pytest.mark.parametrize("value", [np.int64(4), np.int32(5), np.uint8(9), torch.tensor(4), np.array(6)])
def test_numpy_and_zero_dim_max_seqlen(value):
    assert torch.equal(_varlen(max_seqlen_q=value, max_seqlen_k=value), _varlen(max_seqlen_q=9, max_seqlen_k=9))


@pytest.mark.parametrize("name, value, exc, match", [
    # Booleans are refused where a number is expected, in every spelling.
    ("softmax_scale", np.True_, ValueError, "softmax_scale must be a positive finite number"),
    ("softmax_scale", torch.tensor(True), ValueError, "softmax_scale must be a positive finite number"),
    ("softcap", np.False_, ValueError, "softcap must be a finite number >= 0"),
    ("sm_margin", np.True_, ValueError, "sm_margin must be a non-negative int"),
    ("sm_margin", torch.tensor(True), ValueError, "sm_margin must be a non-negative int"),
    ("window_size", (np.True_, 0), ValueError, "window_size must be a pair"),
    ("window_size", (torch.tensor(False), 0), ValueError, "window_size must be a pair"),
    ("num_splits", True, NotImplementedError, "num_splits=True"),
    ("num_splits", np.True_, NotImplementedError, "num_splits=True"),
    ("attention_chunk", False, NotImplementedError, "attention_chunk=False"),
    # The range checks are those of Python numbers.
    ("softmax_scale", np.float32(0.0), ValueError, "softmax_scale must be a positive finite number"),
    ("softmax_scale", np.float32("nan"), ValueError, "softmax_scale must be a positive finite number"),
    ("softmax_scale", torch.tensor(-0.1), ValueError, "softmax_scale must be a positive finite number"),
    ("softcap", np.float64("inf"), ValueError, "softcap must be a finite number >= 0"),
    ("softcap", torch.tensor(-1.0), ValueError, "softcap must be a finite number >= 0"),
    ("sm_margin", np.int64(-1), ValueError, "sm_margin must be a non-negative int"),
    ("window_size", (np.int64(-2), 0), ValueError, "window_size must be a pair"),
    ("num_splits", np.int64(2), NotImplementedError, "num_splits=2"),
    # Not scalars, or not integers where an int is expected.
    ("softmax_scale", torch.tensor([0.1]), ValueError, "softmax_scale must be a positive finite number"),
    ("softmax_scale", np.array([0.1]), ValueError, "softmax_scale must be a positive finite number"),
    ("softmax_scale", np.complex64(0.1), ValueError, "softmax_scale must be a positive finite number"),
    ("sm_margin", np.float64(1.0), ValueError, "sm_margin must be a non-negative int"),
    ("sm_margin", torch.tensor(1.0), ValueError, "sm_margin must be a non-negative int"),
    ("window_size", (torch.tensor(2.0), 0), ValueError, "window_size must be a pair"),
])
def test_scalar_forms_keep_the_checks(name, value, exc, match):
    q, k, v = qkv()
    with pytest.raises(exc, match=match):
        dash_fa3.flash_attn_func(q, k, v, **{name: value})
    with pytest.raises(exc, match=match):
        _varlen(**{name: value})


@pytest.mark.parametrize("value", [True, np.True_, torch.tensor(True), np.int64(-1), np.float64(4.0),
                                   torch.tensor(4.0), torch.tensor([4]), "4"])
def test_max_seqlen_refuses_what_is_no_count(value):
    with pytest.raises(ValueError, match="max_seqlen_k must be a non-negative int"):
        _varlen(max_seqlen_k=value)


# ---------------------------------------------------------------- fp32 on the CPU


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_cpu_inputs_run_the_fp32_reference(causal):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, n, h, 64, generator=g).requires_grad_() for n, h in ((9, 4), (12, 2), (12, 2)))
    out, lse = dash_fa3.flash_attn_func(q, k, v, causal=causal, deterministic=True, return_attn_probs=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    want_out, want_lse = reference.attention_ref(q.detach(), k.detach(), v.detach(), None, causal)
    want_grads = reference.attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), None, causal)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for t, want in zip((q, k, v), want_grads):
        assert t.grad.dtype == torch.float32 and torch.equal(t.grad, want)
    # ... and fp32 is accurate: against fp64 within fp32 rounding, far below bf16's.
    exact, _ = reference.attention_ref(q.detach().double(), k.detach().double(), v.detach().double(), None, causal,
                                       compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_fp32_cpu_varlen_runs_the_reference():
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(n, h, 64, generator=g) for n, h in ((6, 2), (7, 1), (7, 1)))
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    out = dash_fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, causal=True)
    want, _ = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, None, True)
    assert out.dtype == torch.float32 and torch.equal(out, want)


def test_fp32_off_the_cpu_is_refused_with_the_reason():
    # Meta tensors stand for a GPU's here: the kernels take bf16 / fp16 only.
    q, k, v = (torch.empty(1, 8, 2, 64, device="meta") for _ in range(3))
    with pytest.raises(TypeError, match="bfloat16 or torch.float16 on meta, got torch.float32; torch.float32 runs "
                                        "on CPU tensors only"):
        dash_fa3.flash_attn_func(q, k, v)
