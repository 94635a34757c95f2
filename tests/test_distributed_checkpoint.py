"""dash_fa3.checkpoint on one process (CPU reference ops): checkpoint_block runs the attention
forward once per layer per step -- plain checkpointing runs it twice -- with unchanged gradients.
(The context-parallel op is covered in test_distributed.py.)"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import dash_fa3
from dash_fa3 import checkpoint as ck
from dash_fa3 import reference

DIM, HEADS, LAYERS = 128, 2, 3


def make_model(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(DIM, 3 * DIM, generator=g) / DIM ** 0.5, torch.randn(DIM, DIM, generator=g) / DIM ** 0.5)
            for _ in range(LAYERS)]


def block(x, w_qkv, w_out):
    b, n, _ = x.shape
    q, k, v = (x @ w_qkv).view(b, n, 3, HEADS, DIM // HEADS).unbind(2)
    o = dash_fa3.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True).float()
    return x + torch.nn.functional.gelu(o.reshape(b, n, DIM)) @ w_out


def step(weights, x0, mode):
    params = [p.clone().requires_grad_() for w in weights for p in w]
    x = x0.clone().requires_grad_()
    h = x
    for i in range(LAYERS):
        w = params[2 * i], params[2 * i + 1]
        if mode == "none":
            h = block(h, *w)
        elif mode == "plain":
            h = checkpoint(block, h, *w, use_reentrant=False)
        else:
            h = ck.checkpoint_block(block, h, *w)
    h.square().mean().backward()
    return [x.grad] + [p.grad for p in params]


@pytest.fixture
def attention_calls(monkeypatch):
    """Counts attention forwards: the CPU op dash_fa3::fwd computes them with reference.attention_ref
    (the backward op does not call it)."""
    calls = [0]
    real = reference.attention_ref

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "attention_ref", counting)
    return calls


def test_checkpoint_block_runs_attention_once_per_layer(attention_calls):
    weights = make_model(3)
    x0 = torch.randn(2, 48, DIM, generator=torch.Generator().manual_seed(4))
    counts, grads = {}, {}
    for mode in ("none", "plain", "selective"):
        attention_calls[0] = 0
        grads[mode] = step(weights, x0, mode)
        counts[mode] = attention_calls[0]
    assert counts == {"none": LAYERS, "plain": 2 * LAYERS, "selective": LAYERS}
    for mode in ("plain", "selective"):
        for a, b in zip(grads[mode], grads["none"]):
            assert torch.equal(a, b), f"{mode} checkpointing changed a gradient"


def test_policy_saves_attention_outputs_only():
    from torch.utils.checkpoint import CheckpointPolicy

    policy = ck.attention_save_policy()
    assert policy(None, torch.ops.dash_fa3.fwd.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.dash_fa3.cp_fwd.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    extra = ck.attention_save_policy([torch.ops.aten.mm.default])
    assert extra(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
