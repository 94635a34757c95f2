"""The public custom ops, ``torch.ops.dash_fa3.fwd`` / ``bwd``, and their autograd.

CUDA tensors go to the compiled kernels (torch.ops.dash_fa3_C); CPU tensors go
to the fp32 reference, so the API works, slowly, on machines without a GPU.
Being torch custom ops with fake (meta) implementations, they trace under
torch.compile and replay under CUDA graphs.
"""

from __future__ import annotations

import warnings

import torch

from . import _ext, reference


class ReferenceBackwardWarning(UserWarning):
    """The GPU backward ran the fp32 reference because the backward kernel is not built yet."""


@torch.library.custom_op("dash_fa3::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    num_sms: int,
    deterministic: bool,
    schedule: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: (out (b, sq, h, d) in q's dtype, lse (b, h, sq) fp32, natural log).

    ``deterministic`` and ``schedule`` only matter to the backward; they are
    arguments here so autograd can hand them to it.
    """
    if q.is_cuda:
        return _ext.ops().fwd(q, k, v, softmax_scale, causal, num_sms)
    out, lse = reference.attention_ref(q, k, v, softmax_scale, causal)
    return out.to(q.dtype), lse.float()


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, num_sms, deterministic, schedule):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("dash_fa3::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    schedule: str,
    num_sms: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv) in the inputs' dtype."""
    if dout.is_cuda:
        warnings.warn(
            "dash_fa3: the Hopper backward kernel is not built yet, so the GPU backward runs the "
            "fp32 reference: correct and deterministic, but slow and O(seqlen_q * seqlen_k) in memory",
            ReferenceBackwardWarning,
            stacklevel=2,
        )
    dq, dk, dv = reference.attention_bwd_ref(dout, q, k, v, out, softmax_scale, causal)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, schedule, num_sms):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, num_sms, deterministic, schedule = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.num_sms = num_sms
    ctx.deterministic = deterministic
    ctx.schedule = schedule
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = bwd(
        dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.schedule, ctx.num_sms
    )
    return dq, dk, dv, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
