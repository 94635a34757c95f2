"""``context_parallel_attn`` and its custom ops ``dash_fa3::cp_fwd`` / ``dash_fa3::cp_bwd``.

Two executions, chosen by the mode:

* ``deterministic=True``: the fold schedules (``runtime.py``), bitwise the same for every number of
  ranks. CPU only for now: on CUDA the forward alone is available (it is P-invariant on the run
  path too), a backward is refused before the forward runs.
* ``deterministic=False``: the run plan (``cuda_runtime.py``): each rank calls the single-GPU
  kernels (on CPU, the reference) on whole runs of query blocks; partial dK/dV summed in fp32.

Custom ops (not a bare autograd.Function) so that selective activation
checkpointing (``dash_fa3.checkpoint``) can save their outputs and skip them --
computation and communication -- when a checkpointed region is recomputed.
The process group travels as its name (ops take no ProcessGroup objects).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..schedule import distributed as S
from . import cuda_runtime, runtime
from .backend import get_backend
from .sharding import resolve_group, resolve_layout

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("dash_fa3::cp_fwd", mutates_args=())
def cp_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, causal: bool,
           softmax_scale: float, deterministic: bool, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel attention forward on local shards: (out, lse (b, h, n) fp32)."""
    if deterministic and q.device.type == "cpu":
        backend = get_backend(q.device, q.shape[2], k.shape[2], softmax_scale)
        return runtime.forward(q, k, v, group=_group(group_name), causal=causal, layout=layout, backend=backend)
    # The run path's forward is bitwise a single-GPU call's rows, so it serves both modes.
    return cuda_runtime.forward(q, k, v, group=_group(group_name), causal=causal, layout=layout,
                                softmax_scale=softmax_scale)


@cp_fwd.register_fake
def _cp_fwd_fake(q, k, v, group_name, causal, softmax_scale, deterministic, layout):
    b, n, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("dash_fa3::cp_bwd", mutates_args=())
def cp_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, group_name: str, causal: bool, softmax_scale: float, deterministic: bool,
           layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context-parallel attention backward on local shards: (dq, dk, dv) like q, k, v."""
    if deterministic:
        backend = get_backend(q.device, q.shape[2], k.shape[2], softmax_scale)
        return runtime.backward(dout, q, k, v, out, lse, group=_group(group_name), causal=causal,
                                layout=layout, backend=backend)
    return cuda_runtime.backward(dout, q, k, v, out, lse, group=_group(group_name), causal=causal,
                                 layout=layout, softmax_scale=softmax_scale)


@cp_bwd.register_fake
def _cp_bwd_fake(dout, q, k, v, out, lse, group_name, causal, softmax_scale, deterministic, layout):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, causal, softmax_scale, deterministic, layout = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (group_name, causal, softmax_scale, deterministic, layout)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = cp_bwd(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


cp_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check(q, k, v, pg):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, local_seqlen, heads, headdim)")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; dash_fa3.distributed takes bf16, fp16 or fp32")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, n, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != n or k.shape[3] != d:
        raise ValueError(f"k and v must be (batch, local_seqlen, heads_kv, headdim) matching q {tuple(q.shape)}: "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % k.shape[2]:
        raise ValueError(f"heads ({h}) must be a multiple of heads_kv ({k.shape[2]})")
    P = dist.get_world_size(pg)
    try:
        S.check_seqlen(n * P, P)
    except ValueError as e:
        raise ValueError(f"local length {n} x {P} ranks = {n * P} tokens: {e}") from None


def context_parallel_attn(q, k, v, group, causal=False, softmax_scale=None, deterministic=False, layout=None):
    """Attention over a sequence split across the ranks of ``group``; returns this rank's output.

    q: (batch, local_seqlen, heads, headdim); k, v: (batch, local_seqlen, heads_kv, headdim),
    heads % heads_kv == 0; bf16 or fp16 (fp32 too on CPU). Each rank passes its shard as
    ``shard(x, group, layout=layout)`` gives it; the global length P * local_seqlen must be a
    multiple of 2 * P * 128. ``group``: a ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, dim);
    required. ``layout``: "contiguous" (default, helper-worker load balancing) or "zigzag".
    Differentiable.

    ``deterministic=True``: output and gradients bitwise identical for every number of ranks and
    both layouts (docs/distributed.md); on CUDA only the forward exists so far, and a call that
    would need a backward raises NotImplementedError. ``deterministic=False``: the Hopper kernels
    on whole runs of query blocks (the reference on CPU); the output is bitwise a single-GPU
    call's, the gradients agree with one GPU to rounding (partial dK/dV summed in fp32).
    """
    pg = resolve_group(group)
    layout = resolve_layout(layout)
    _check(q, k, v, pg)
    if q.device.type == "cuda":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dash_fa3.distributed on CUDA takes bf16 or fp16, got {q.dtype}")
        if deterministic and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError(
                "dash_fa3.distributed: the deterministic (bitwise the same for every number of GPUs) "
                "backward needs fold kernels that are not built yet (issue 16); on CUDA use "
                "deterministic=False for training, or run the deterministic forward under torch.no_grad()")
    elif q.device.type != "cpu":
        raise ValueError(f"dash_fa3.distributed runs on CUDA or CPU tensors, got {q.device.type}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    elif not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    out, _ = cp_fwd(q, k, v, pg.group_name, bool(causal), float(softmax_scale), bool(deterministic), layout)
    return out
