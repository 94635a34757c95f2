"""The public ops ``torch.ops.dash_fa3.fwd`` / ``bwd`` and the autograd function over them.

One eager call crosses into Python as little as possible, because host time
per call is what a training step pays for small shapes:

* ``dash_fa3::fwd`` on CUDA is the C++ dispatch function itself (registered by
  the extension, csrc/api/binding.cpp): no Python runs between the dispatcher
  and the kernel launch.
* ``dash_fa3::bwd`` on CUDA is one Python function: a cache lookup of the
  validated schedule for the shape, then one C++ call that runs the
  preprocess, the main kernel and the postprocess with one workspace
  allocation.
* Autograd is a plain ``torch.autograd.Function`` (``attention``) around the
  two ops; ``torch.compile`` traces it and the ops' fake implementations, and
  the ops never read device data on the host, so CUDA graphs capture them.

CPU tensors go to the fp32 reference, so the API works, slowly, on machines
without a GPU.

``dash_fa3::fwd_general`` / ``bwd_general`` (and the autograd function
``attention_general``) carry sliding windows, softcap and packed
variable-length batches (issue 17). On CUDA tensors, windows on
(batch, seqlen, heads, d) tensors run the Hopper kernels of the window's mask
kind (``local``; one Python call into the C++ dispatch per direction, as the
backward of the plain ops), and so does the forward over packed documents
(``fwd_varlen`` / ``bwd_varlen``; the backward reads the documents' lengths
on the host, once per cu_seqlens tensor: ``host_offsets``). Softcap runs the
softcap kernels (``DASH_FA3_SOFTCAP=1`` builds; a build without them raises,
never a slow fallback). CPU tensors run the reference.
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import _ext, _schemas, reference, validation, variants


class ReferenceBackwardWarning(UserWarning):
    """No longer raised: every head dim has a backward kernel, and a variant missing from
    the build is an error. Kept so that code filtering it keeps working."""


_lib = _schemas.LIB


# ---------------------------------------------------------------- forward


def _fwd_reference(q, k, v, softmax_scale, causal, sm_margin):
    out, lse = reference.attention_ref(q, k, v, softmax_scale, causal)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


@torch.library.register_fake("dash_fa3::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, sm_margin):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32)


_lib.impl("fwd", _fwd_reference, "CPU")


# ---------------------------------------------------------------- backward


def _bwd_kernel_and_sms(hdim, dtype, mask, sm_margin, device, packed=False, softcap=False, hdim_v=None) -> int:
    """The device's SM count, after checking that the backward kernel of (hdim, dtype, mask) (V's
    head dim ``hdim_v``, default hdim) is
    built for dense tensors or, ``packed``, packed documents, with plain or, ``softcap``,
    softcapped scores (an error that says how to build it otherwise: nothing falls back to a
    slow path) and that sm_margin leaves an SM."""
    variant = variants.Variant(hdim, "bf16" if dtype == torch.bfloat16 else "fp16", mask, hdim_v)
    built = _ext.built_variants("bwd", packed, softcap)
    if variant.name not in built:
        raise RuntimeError(
            f"dash_fa3: no {validation.family_name(packed, softcap)}backward kernel for {variant.name} in this "
            f"build (built: {', '.join(built) or 'none'}); {validation.rebuild_hint(variant.name, packed, softcap)}")
    total = _ext.num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if total - sm_margin < 1:
        raise ValueError(f"sm_margin={sm_margin} leaves no SM of the device's {total}")
    return total


def _bwd_schedule(q_shape, k_shape, dtype, window_left, window_right, softcap: bool, deterministic, schedule,
                  sm_margin, device, hdim_v=None, dkv_fp32=False):
    """(schedule metadata, the C++ op, whether the kernel runs its deterministic mode) of one
    backward call: see :func:`_bwd_plan`; ``dkv_fp32``: for :func:`bwd_dkv_fp32` (a schedule that
    writes fp32 dK/dV partials)."""
    from .schedule import Geometry, bwd_block_sizes, resolve_call
    from .schedule.lowering import get_kernel_metadata

    batch, seqlen_q, heads, hdim = q_shape
    mask = variants.mask_of_window(window_left, window_right)
    total = _bwd_kernel_and_sms(hdim, dtype, mask, sm_margin, device, softcap=softcap, hdim_v=hdim_v)
    block_m, block_n = bwd_block_sizes(hdim)
    geometry = Geometry(batch=batch, heads=heads, heads_kv=k_shape[2], seqlen_q=seqlen_q, seqlen_k=k_shape[1],
                        block_m=block_m, block_n=block_n, mask=mask, window_left=window_left,
                        window_right=window_right)
    # "auto" depends on the mode; a non-deterministic one may run the deterministic mode, where
    # that is the faster (policy.nd_runs_ordered).
    name, ordered = resolve_call(schedule, geometry, deterministic, num_sms=total - sm_margin, headdim=hdim,
                                 dkv_fp32=dkv_fp32)
    return get_kernel_metadata(name, geometry, total - sm_margin), _ext.ops().bwd.default, ordered


def _as_plan(meta, run, ordered, device):
    flat = torch.from_numpy(meta.as_int32_array())
    return flat.to(device), flat.clone(), run, ordered


@functools.lru_cache(maxsize=1024)
def _bwd_plan(q_shape, k_shape, dtype, window_left, window_right, softcap: bool, deterministic, schedule, sm_margin,
              device, hdim_v=None, dkv_fp32=False):
    """What one backward call of this shape and window (-1 unbounded; (-1, -1) full,
    (-1, 0) causal) runs, on the softcap kernels if ``softcap``, built once per shape (the
    cap's value is the C++ op's argument, not the plan's): (schedule on the device, its header on
    the host, the C++ op, the ``deterministic`` to pass it). A variant this build lacks is an error that says how to build it:
    nothing falls back to a slow path."""
    return _as_plan(*_bwd_schedule(q_shape, k_shape, dtype, window_left, window_right, softcap, deterministic,
                                   schedule, sm_margin, device, hdim_v, dkv_fp32), device)


@functools.lru_cache(maxsize=256)
def _bwd_plan_part(q_shape, k_shape, dtype, causal, deterministic, device, heads, heads_kv, kv_lo):
    """The plan of a call that holds KV heads [kv_lo, kv_lo + k_shape[2]) (and their query heads) of
    a problem with ``heads`` / ``heads_kv`` heads: the whole problem's schedule restricted to them
    (``metadata.restrict_heads``), so every head gets the dQ add order it has in the whole call."""
    from .schedule.metadata import restrict_heads

    full_q = (q_shape[0], q_shape[1], heads, q_shape[3])
    full_k = (k_shape[0], k_shape[1], heads_kv, k_shape[3])
    meta, run, ordered = _bwd_schedule(full_q, full_k, dtype, -1, 0 if causal else -1, False, deterministic, "auto",
                                       0, device)
    return _as_plan(restrict_heads(meta, kv_lo, kv_lo + k_shape[2]), run, ordered, device)


def bwd_heads_part(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, heads, heads_kv, kv_lo):
    """The backward of KV heads [kv_lo, kv_lo + k.shape[2]) of a problem with ``heads`` /
    ``heads_kv`` heads, given only those heads' tensors (CUDA): bitwise what ``flash_attn_func``'s
    backward (schedule "auto") gives those heads on the whole problem. For head-parallel context
    parallelism (dash_fa3/distributed/heads.py)."""
    flat, header, run, ordered = _bwd_plan_part(tuple(q.shape), tuple(k.shape), q.dtype, bool(causal),
                                                bool(deterministic), q.device, int(heads), int(heads_kv), int(kv_lo))
    return run(dout, q, k, v, out, lse, flat, header, softmax_scale, -1, 0 if causal else -1, 0.0, ordered)


def bwd_dkv_fp32(dout, q, k, v, out, lse, softmax_scale, causal):
    """The deterministic backward (schedule "auto" among those with fp32 dK/dV partials:
    ``resolve_schedule_name(..., dkv_fp32=True)``) with dK and dV in fp32, not rounded: (dq in q's
    dtype, dk, dv fp32 shaped like k, v). A partial that context parallelism adds to other calls'
    before rounding once (``distributed/superblocks.py``); its bits depend only on the call's
    shapes and values. CUDA: the Hopper kernels (dK/dV are each KV head's group sum of the fp32
    per-head slabs, the values the plain call rounds); CPU: the fp32 reference on one intra-op
    thread, so the bits do not depend on the thread count."""
    if q.device.type == "cuda":
        flat, header, _, _ = _bwd_plan(tuple(q.shape), tuple(k.shape), q.dtype, -1, 0 if causal else -1, False,
                                       True, "auto", 0, q.device, v.shape[-1], True)
        return _ext.ops().bwd_dkv_fp32.default(dout, q, k, v, out, lse, flat, header, softmax_scale, -1,
                                                0 if causal else -1)
    with reference.one_thread():
        dq, dk, dv = reference.attention_bwd_ref(dout, q, k, v, out, softmax_scale, causal)
    return dq.to(q.dtype).contiguous(), dk.float().contiguous(), dv.float().contiguous()


def _bwd_cuda_window(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, deterministic,
                     schedule, sm_margin):
    """The backward kernels for a window (full and causal included) and a softcap (0: none)."""
    schedule_flat, schedule_header, run, ordered = _bwd_plan(q.shape, k.shape, q.dtype, window_left, window_right,
                                                             softcap > 0, deterministic, schedule, sm_margin,
                                                             q.device, v.shape[-1])
    return run(dout, q, k, v, out, lse, schedule_flat, schedule_header, softmax_scale, window_left, window_right,
               softcap, ordered)


def _bwd_cuda(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, schedule, sm_margin):
    return _bwd_cuda_window(dout, q, k, v, out, lse, softmax_scale, -1, 0 if causal else -1, 0.0, deterministic,
                            schedule, sm_margin)


def _bwd_reference(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, schedule, sm_margin):
    dq, dk, dv = reference.attention_bwd_ref(dout, q, k, v, out, softmax_scale, causal)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@torch.library.register_fake("dash_fa3::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, schedule, sm_margin):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_lib.impl("bwd", _bwd_reference, "CPU")
_lib.impl("bwd", _bwd_cuda, "CUDA")

if not _ext.available():
    # Without the extension, CUDA tensors get this error instead of the
    # dispatcher's "no kernel for the CUDA backend".
    def _fwd_no_extension(q, k, v, softmax_scale, causal, sm_margin):
        raise RuntimeError(f"dash_fa3: {_ext.ext_error()}")

    _lib.impl("fwd", _fwd_no_extension, "CUDA")

fwd = torch.ops.dash_fa3.fwd.default
bwd = torch.ops.dash_fa3.bwd.default


# ---------------------------------------------------------------- windows, softcap, varlen


def _ref_kwargs(window_left, window_right, softcap):
    return {"window_size": (window_left, window_right), "softcap": softcap}


def _fwd_general_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                           window_left, window_right, softcap, sm_margin):
    kw = _ref_kwargs(window_left, window_right, softcap)
    if cu_seqlens_q is None:
        out, lse = reference.attention_ref(q, k, v, softmax_scale, **kw)
    else:
        out, lse = reference.attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, **kw)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def _bwd_general_reference(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    kw = _ref_kwargs(window_left, window_right, softcap)
    if cu_seqlens_q is None:
        dq, dk, dv = reference.attention_bwd_ref(dout, q, k, v, out, softmax_scale, **kw)
    else:
        dq, dk, dv = reference.attention_varlen_bwd_ref(dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k,
                                                        softmax_scale, **kw)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


# Host copies of CUDA cu_seqlens, per tensor object and version: the backward's schedule
# needs the documents' lengths on the host, and one copy (one synchronisation) per distinct
# tensor serves every layer of a step that passes the same tensor.
_HOST_LENGTHS: dict[int, tuple] = {}


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """The values of ``cu`` (int32 offsets) on the host, read once per (object, version) and
    kept while the tensor lives (from a CUDA tensor the read synchronises)."""
    key = id(cu)
    hit = _HOST_LENGTHS.get(key)
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        return hit[2]
    remember_host_offsets(cu, cu.tolist())  # from a CUDA tensor: synchronises with the device
    return _HOST_LENGTHS[key][2]


def remember_host_offsets(cu: torch.Tensor, values) -> None:
    """Records the host values of ``cu`` (e.g. a framework's own host copy), so that
    ``host_offsets`` does not read them from the device."""
    key = id(cu)
    _HOST_LENGTHS[key] = (weakref.ref(cu, lambda _, key=key: _HOST_LENGTHS.pop(key, None)), cu._version,
                          tuple(int(x) for x in values))


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                 softcap: bool, deterministic, schedule, sm_margin):
    """(schedule on the device, its header on the host) of a backward over packed documents, on
    the softcap kernels if ``softcap``."""
    from .schedule import bwd_block_sizes
    from .schedule.varlen import resolve_varlen_schedule, varlen_metadata_cached

    hdim = q.shape[-1]
    mask = variants.mask_of_window(window_left, window_right)
    total = _bwd_kernel_and_sms(hdim, q.dtype, mask, sm_margin, q.device, packed=True, softcap=softcap,
                                hdim_v=v.shape[-1])
    cq, ck = host_offsets(cu_seqlens_q), host_offsets(cu_seqlens_k)
    # The checks flash_attn_varlen_func makes on CPU tensors, now that the values are on the host.
    validation.check_offsets("cu_seqlens_q", cq, q.shape[0], max_seqlen_q)
    validation.check_offsets("cu_seqlens_k", ck, k.shape[0], max_seqlen_k)
    lengths = tuple((cq[b + 1] - cq[b], ck[b + 1] - ck[b]) for b in range(len(cq) - 1))
    block_m, block_n = bwd_block_sizes(hdim)
    name = resolve_varlen_schedule(schedule, deterministic)
    meta = varlen_metadata_cached(name, lengths, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], block_m,
                                  block_n, mask, window_left, window_right, total - sm_margin)
    flat = torch.from_numpy(meta.as_int32_array())
    return flat.to(q.device, non_blocking=True), flat


def _fwd_general_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      window_left, window_right, softcap, sm_margin):
    if cu_seqlens_q is None:
        return _ext.ops().fwd_window(q, k, v, softmax_scale, window_left, window_right, softcap, sm_margin)
    if q.shape[0] == 0 or k.shape[0] == 0:
        # No query rows, or no keys anywhere: every row attends nothing (out 0, lse -inf).
        return (q.new_zeros((*q.shape[:2], v.shape[-1])),
                torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float32, device=q.device))
    return _ext.ops().fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 window_left, window_right, softcap, sm_margin)


def _bwd_general_cuda(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    if cu_seqlens_q is not None:
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        schedule_flat, schedule_header = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                      window_left, window_right, softcap > 0, deterministic,
                                                      schedule, sm_margin)
        return _ext.ops().bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, schedule_flat, schedule_header, softmax_scale, window_left,
                                     window_right, softcap, deterministic)

    return _bwd_cuda_window(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, softcap, deterministic,
                            schedule, sm_margin)


@torch.library.register_fake("dash_fa3::fwd_general")
def _fwd_general_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                      window_left, window_right, softcap, sm_margin):
    if cu_seqlens_q is None:
        b, sq, h, _ = q.shape
        return q.new_empty((b, sq, h, v.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32)
    total_q, h, _ = q.shape
    return q.new_empty((total_q, h, v.shape[-1])), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.register_fake("dash_fa3::bwd_general")
def _bwd_general_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_lib.impl("fwd_general", _fwd_general_reference, "CPU")
_lib.impl("bwd_general", _bwd_general_reference, "CPU")
_lib.impl("fwd_general", _fwd_general_cuda, "CUDA")
_lib.impl("bwd_general", _bwd_general_cuda, "CUDA")

fwd_general = torch.ops.dash_fa3.fwd_general.default
bwd_general = torch.ops.dash_fa3.bwd_general.default


# ---------------------------------------------------------------- autograd


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, sm_margin, deterministic, schedule):
        out, lse = fwd(q, k, v, softmax_scale, causal, sm_margin)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd_args = (softmax_scale, causal, deterministic, schedule, sm_margin)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero tensor for lse's (always absent) gradient
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 8
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd(dout, q, k, v, out, lse, *ctx.bwd_args)
        return dq, dk, dv, None, None, None, None, None


def attention(q, k, v, softmax_scale: float, causal: bool, sm_margin: int, deterministic: bool, schedule: str):
    """(out, lse), differentiable in q, k, v; arguments already validated (``flash_attn_func``)."""
    return _Attention.apply(q, k, v, softmax_scale, causal, sm_margin, deterministic, schedule)


class _AttentionGeneral(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                window_right, softcap, sm_margin, deterministic, schedule):
        args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                softcap)
        out, lse = fwd_general(q, k, v, *args, sm_margin)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.bwd_args = args[2:] + (deterministic, schedule, sm_margin)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 14
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = bwd_general(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.bwd_args)
        return (dq, dk, dv) + (None,) * 11


def attention_general(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float, window_left: int, window_right: int, softcap: float, sm_margin: int,
                      deterministic: bool, schedule: str):
    """(out, lse) with a window / softcap / packed documents, differentiable in q, k, v; arguments
    already validated (``flash_attn_func`` / ``flash_attn_varlen_func``)."""
    return _AttentionGeneral.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                   window_left, window_right, softcap, sm_margin, deterministic, schedule)
