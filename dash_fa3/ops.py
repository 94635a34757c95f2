"""The public custom ops, ``torch.ops.dash_fa3.fwd`` / ``bwd``, and their autograd.

CUDA tensors go to the compiled kernels (torch.ops.dash_fa3_C); CPU tensors go
to the fp32 reference, so the API works, slowly, on machines without a GPU.
Being torch custom ops with fake (meta) implementations, they trace under
torch.compile and replay under CUDA graphs.
"""

from __future__ import annotations

import functools
import warnings

import torch

from . import _ext, reference, variants


class ReferenceBackwardWarning(UserWarning):
    """The GPU backward ran the fp32 reference: no backward kernel exists for this head dim."""


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if the kernels can address it through TMA (16-byte aligned base
    and strides, contiguous last dim), else a contiguous copy. Called inside the
    op bodies: data pointers are not traceable by torch.compile."""
    elems = 16 // t.element_size()
    aligned = (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s % elems == 0 or n == 1 for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    )
    return t if aligned else t.contiguous()


def usable_sms(device: torch.device, sm_margin: int) -> int:
    """The persistent grid size: the device's SMs less ``sm_margin`` (read here,
    inside the op, so torch.compile never traces the device query)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = _ext.num_sms(index)
    if total - sm_margin < 1:
        raise ValueError(f"sm_margin={sm_margin} leaves no SM of the device's {total}")
    return total - sm_margin


@functools.lru_cache(maxsize=256)
def _schedule_tensors(schedule: str, geometry, num_sms: int, device: torch.device):
    """The validated static schedule metadata on ``device`` and its header on the
    host, cached per shape: a repeated shape costs one lookup, no host work and no
    copy (so the backward can be captured in a CUDA graph after one eager call)."""
    from .schedule.lowering import get_kernel_metadata

    flat = torch.from_numpy(get_kernel_metadata(schedule, geometry, num_sms).as_int32_array())
    return flat.to(device), flat.clone()


def _bwd_cuda(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, schedule, num_sms):
    from .schedule import Geometry, bwd_block_sizes, resolve_schedule_name

    c = _ext.ops()
    batch, seqlen_q, heads, hdim = q.shape
    block_m, block_n = bwd_block_sizes(hdim)
    dpsum, lse_log2, dq_accum, dq_semaphore = c.bwd_preprocess(out, dout, lse, block_m)
    geometry = Geometry(batch=batch, heads=heads, heads_kv=k.shape[2], seqlen_q=seqlen_q, seqlen_k=k.shape[1],
                        block_m=block_m, block_n=block_n, mask="causal" if causal else "full")
    # "auto" depends on the mode: without ordering constraints the best-balanced order wins.
    name = resolve_schedule_name(schedule, geometry, deterministic)
    flat, header = _schedule_tensors(name, geometry, num_sms, q.device)
    dk, dv = c.bwd(dout, q, k, v, dpsum, lse_log2, dq_accum, dq_semaphore, flat, header, softmax_scale, causal,
                   deterministic)
    dq = c.bwd_postprocess(dq_accum, seqlen_q, softmax_scale, q.dtype)
    return dq, dk, dv


@torch.library.custom_op("dash_fa3::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    sm_margin: int,
    deterministic: bool,
    schedule: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: (out (b, sq, h, d) in q's dtype, lse (b, h, sq) fp32, natural log).

    ``sm_margin`` SMs are left free. ``deterministic`` and ``schedule`` only
    matter to the backward; they are arguments here so autograd can hand them to it.
    """
    if q.is_cuda:
        q, k, v = (kernel_layout(t) for t in (q, k, v))
        return _ext.ops().fwd(q, k, v, softmax_scale, causal, usable_sms(q.device, sm_margin))
    out, lse = reference.attention_ref(q, k, v, softmax_scale, causal)
    return out.to(q.dtype), lse.float()


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, sm_margin, deterministic, schedule):
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
    sm_margin: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv) in the inputs' dtype.

    On CUDA the Hopper kernel runs the validated ``schedule``; ``deterministic``
    orders every dQ (and, for GQA, dK/dV) accumulation by it. ``auto`` resolves
    per mode (``resolve_schedule_name``: ``lpt`` when not deterministic). Head dims without a
    backward kernel run the fp32 reference and warn.
    """
    if dout.is_cuda:
        variant = variants.Variant(q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16",
                                   "causal" if causal else "full")
        if variant.name in _ext.built_bwd_variants():
            dout, q, k, v = (kernel_layout(t) for t in (dout, q, k, v))
            return _bwd_cuda(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
                             schedule, usable_sms(q.device, sm_margin))
        warnings.warn(
            f"dash_fa3: no Hopper backward kernel for {variant.name} (kernels exist for head dims "
            f"{', '.join(map(str, variants.BWD_HEADDIMS))}), so the GPU backward runs the fp32 reference: "
            f"correct and deterministic, but slow and O(seqlen_q * seqlen_k) in memory",
            ReferenceBackwardWarning,
            stacklevel=2,
        )
    dq, dk, dv = reference.attention_bwd_ref(dout, q, k, v, out, softmax_scale, causal)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, schedule, sm_margin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, sm_margin, deterministic, schedule = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.sm_margin = sm_margin
    ctx.deterministic = deterministic
    ctx.schedule = schedule
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = bwd(
        dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.schedule, ctx.sm_margin
    )
    return dq, dk, dv, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
