"""The public API on the CPU: reference-backed custom ops, autograd, tracing."""

import math

import pytest
import torch

import dash_fa3
from dash_fa3 import ops, reference


def rand(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_match_reference(dtype, causal):
    q = rand((2, 9, 4, 64), dtype, 1).requires_grad_()
    k = rand((2, 12, 2, 64), dtype, 2).requires_grad_()
    v = rand((2, 12, 2, 64), dtype, 3).requires_grad_()
    scale = 0.5 / math.sqrt(64)
    out, lse = dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 9)
    ref_out, ref_lse = reference.attention_ref(q.detach(), k.detach(), v.detach(), scale, causal)
    torch.testing.assert_close(out.float(), ref_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse)

    dout = rand(out.shape, dtype, 4)
    out.backward(dout)
    grads = reference.attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), scale, causal)
    for t, want in zip((q, k, v), grads):
        assert t.grad.dtype == dtype
        torch.testing.assert_close(t.grad.float(), want, rtol=2e-2, atol=2e-2)


def test_return_convention_follows_fa3():
    q, k, v = (rand((1, 4, 2, 64), seed=s) for s in range(3))
    out = dash_fa3.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    out2, lse = dash_fa3.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 4)


def test_default_scale_is_inverse_sqrt_headdim():
    q, k, v = (rand((1, 5, 2, 128), seed=s) for s in range(3))
    a = dash_fa3.flash_attn_func(q, k, v)
    b = dash_fa3.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(128))
    assert torch.equal(a, b)


def test_gradient_through_expanded_dout():
    # sum() hands backward a stride-0 dout: the op must not assume contiguity.
    q, k, v = (rand((1, 6, 2, 64), seed=s).requires_grad_() for s in range(3))
    dash_fa3.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_opcheck_fwd_and_bwd():
    q, k, v = (rand((1, 5, 2, 64), seed=s) for s in range(3))
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.fwd, (q, k, v, 0.125, True, 0), test_utils=checks)
    out, lse = ops.fwd(q, k, v, 0.125, True, 0)
    torch.library.opcheck(ops.bwd, (rand(out.shape, seed=9), q, k, v, out, lse, 0.125, True, True, "auto", 0),
                          test_utils=checks)


def test_api_rejects_wrong_argument_types():
    q, k, v = (rand((1, 4, 2, 64), seed=s) for s in range(3))
    for kwargs, err, pattern in (
        ({"causal": "False"}, TypeError, "causal must be a bool"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"deterministic": None}, TypeError, "deterministic must be a bool"),
        ({"softmax_scale": True}, ValueError, "softmax_scale"),
        ({"softmax_scale": "0.1"}, ValueError, "softmax_scale"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        ({"sm_margin": True}, ValueError, "sm_margin"),
        ({"num_splits": 4}, NotImplementedError, "num_splits=4"),
        ({"pack_gqa": True}, NotImplementedError, "pack_gqa=True"),
        ({"softcap": -30.0}, ValueError, "softcap must be a finite number >= 0"),
    ):
        with pytest.raises(err, match=pattern):
            dash_fa3.flash_attn_func(q, k, v, **kwargs)


def test_fa3_harmless_defaults_are_accepted():
    q, k, v = (rand((1, 4, 2, 64), seed=s) for s in range(3))
    want = dash_fa3.flash_attn_func(q, k, v, causal=True)
    for kwargs in ({"num_splits": 0}, {"num_splits": 1}, {"pack_gqa": None}, {"pack_gqa": False},
                   {"softcap": 0.0}, {"softcap": 0}):
        assert torch.equal(dash_fa3.flash_attn_func(q, k, v, causal=True, **kwargs), want)


def test_causal_sets_the_right_window_bound_to_zero_as_fa3():
    """FA3 replaces window_size[1] by 0 when causal=True (its own tests rely on it)."""
    q, k, v = (rand((1, 9, 2, 64), seed=s) for s in range(3))
    want = dash_fa3.flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    for right in (-1, 1, 5):
        assert torch.equal(dash_fa3.flash_attn_func(q, k, v, causal=True, window_size=(2, right)), want)
    assert not torch.equal(dash_fa3.flash_attn_func(q, k, v, window_size=(2, 1)), want)


def test_unused_output_needs_no_backward():
    # lse's gradient is never materialised, and an output that reaches no loss asks for no backward.
    q, k, v = (rand((1, 6, 2, 64), seed=s).requires_grad_() for s in range(3))
    out, lse = dash_fa3.flash_attn_func(q, k, v, return_attn_probs=True)
    assert not lse.requires_grad
    (out.float().sum() + lse.sum()).backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_torch_compile_traces_the_ops():
    q, k, v = (rand((1, 8, 2, 64), seed=s).requires_grad_() for s in range(3))
    fn = torch.compile(lambda q, k, v: dash_fa3.flash_attn_func(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    out.float().square().sum().backward()
    ref = dash_fa3.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
    assert torch.equal(out.detach(), ref)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cpu_outputs_have_the_fake_layout():
    # (b, s, h, d) views of a (b, h, s, d) layout, as frameworks hand them over.
    q, k, v = (rand((2, h, 11, 64), seed=50 + h).transpose(1, 2) for h in (4, 2, 2))
    out, lse = dash_fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.is_contiguous() and lse.is_contiguous()
    assert out.view(2, 11, -1).shape == (2, 11, 256)
    # Every opcheck test, fake-tensor strides included (torch >= 2.13 compares them).
    torch.library.opcheck(ops.fwd, (q, k, v, 0.125, True, 0))
    out, lse = ops.fwd(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, False, 0)
    torch.library.opcheck(ops.bwd, (rand(out.shape, seed=59), q.contiguous(), k.contiguous(), v.contiguous(),
                                    out, lse, 0.125, False, True, "auto", 0))


@pytest.mark.slow
def test_inductor_compiles_the_cpu_path():
    # Inductor plans its buffers from the fake implementations: a real output with
    # other strides breaks the compiled graph (it did before the reference returned
    # contiguous outputs).
    q, k, v = (rand((1, 8, 2, 64), seed=60 + s).requires_grad_() for s in range(3))
    fn = torch.compile(lambda q, k, v: dash_fa3.flash_attn_func(q, k, v, causal=True).view(1, 8, -1) * 2,
                       fullgraph=True)
    out = fn(q, k, v)
    out.float().sum().backward()
    ref = dash_fa3.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True).view(1, 8, -1) * 2
    assert torch.equal(out.detach(), ref)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
