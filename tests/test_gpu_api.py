"""The public API on the GPU: autograd end to end, CUDA graphs, torch.compile."""


import pytest
import torch

import dash_fa3
from dash_fa3 import _ext, reference

pytestmark = pytest.mark.gpu

VARIANT = dash_fa3.variants.Variant(128, "bf16", "causal")


@pytest.fixture(autouse=True)
def need_variant():
    if VARIANT.name not in _ext.built_variants("fwd"):
        pytest.skip(f"{VARIANT.name} is not in this build")


def inputs(b=2, s=300, h=4, hkv=2, d=128, requires_grad=False):
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_training_step_gradients():
    q, k, v = inputs(requires_grad=True)
    out = dash_fa3.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = reference.attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), None, True)
    for t, w in zip((q, k, v), want):
        assert t.grad is not None and t.grad.dtype == torch.bfloat16
        err = ((t.grad.float() - w).norm() / w.norm()).item()
        assert err < 1e-2, err


def test_cuda_graph_replay_matches_eager():
    q, k, v = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dash_fa3.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dash_fa3.flash_attn_func(q, k, v, causal=True)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dash_fa3.flash_attn_func(q, k, v, causal=True))


def test_torch_compile_inductor():
    q, k, v = inputs()
    fn = torch.compile(lambda q, k, v: dash_fa3.flash_attn_func(q, k, v, causal=True) * 2, fullgraph=True)
    assert torch.equal(fn(q, k, v), dash_fa3.flash_attn_func(q, k, v, causal=True) * 2)
