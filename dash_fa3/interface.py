"""``flash_attn_func`` and ``flash_attn_varlen_func``: drop-ins for FlashAttention-3's
``flash_attn_interface`` functions of those names.

Argument names, order and return convention follow FA3. FA3 features that
dash_fa3 does not implement raise ``NotImplementedError`` rather than being
ignored. dash_fa3 adds ``schedule=``, the deterministic backward's schedule.

Sliding windows (``window_size``) run on the Hopper kernels (the local mask
kind) for ``flash_attn_func``; a window that masks nothing beyond causal or
full attention (FA3 normalises it the same way: a side reaching past the
sequence is unbounded, and ``(-1, 0)`` is causal) runs the causal or full
kernels. Packed variable-length batches (``flash_attn_varlen_func``, windows
included) run the Hopper kernels, forward and backward. ``softcap`` > 0
(scores softcap * tanh(scores / softcap), FA3's) runs on the softcap kernels,
a build option (``DASH_FA3_SOFTCAP=1``; without it CUDA calls raise, naming it).

Numeric arguments (``softmax_scale``, ``softcap``, ``window_size``'s sides,
``max_seqlen_q/k``, ``sm_margin``, ...) may be Python numbers, NumPy scalars or
0-d tensors and arrays, with the same checks; booleans are refused where a
number is expected.
"""

from __future__ import annotations

import torch

from . import ops, reference, validation, variants
from .schedule.varlen import resolve_varlen_schedule


def _unsupported(feature: str, func: str = "flash_attn_func") -> NotImplementedError:
    return NotImplementedError(f"dash_fa3.{func} does not support {feature}")


def _check_fa3_extras(func, qv, q_descale, k_descale, v_descale, attention_chunk, num_splits, pack_gqa, flags,
                      sm_margin):
    """The FA3 arguments dash_fa3 accepts only at their defaults, and the flag types; returns
    sm_margin as an int."""
    if qv is not None:
        raise _unsupported("qv", func)
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise _unsupported("fp8 descaling (q_descale/k_descale/v_descale)", func)
    if attention_chunk is not None and validation.as_int(attention_chunk) != 0:
        raise _unsupported(f"attention_chunk={attention_chunk}", func)
    # FA3's callers pass num_splits=0 (its heuristic) or 1 and pack_gqa=None/False: both mean one split, no packing.
    if validation.as_int(num_splits) not in (0, 1):
        raise _unsupported(f"num_splits={num_splits}", func)
    if pack_gqa not in (None, False):
        raise _unsupported(f"pack_gqa={pack_gqa!r}", func)
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    return validation.check_count("sm_margin", sm_margin)


def _effective_window(window, causal, seqlen_q, seqlen_k):
    """(left, right) with causal folded in and, as FA3 does, a side that reaches past the
    sequence made unbounded (-1): the same mask, so (-1, -1) / (-1, 0) run the full / causal kernels."""
    left, right = reference.window_bounds(window, causal)
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    return left, right


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    schedule="auto",
):
    """Scaled dot-product attention, FA3 layout.

    q: (batch, seqlen_q, heads, headdim); k: (batch, seqlen_k, heads_kv, headdim);
    v: (batch, seqlen_k, heads_kv, headdim_v), headdim_v == headdim or (MLA) 128
    with headdim 192; bf16 or fp16 (fp32 too on CPU tensors, which run the fp32
    reference), last dim contiguous, heads % heads_kv == 0.
    softmax_scale defaults to 1/sqrt(headdim). causal aligns the mask to the
    bottom-right corner when seqlen_q != seqlen_k. window_size=(left, right)
    (FA3's: -1 unbounded, bottom-right aligned; causal sets the right side to 0
    whatever it is given, as FA3 does) runs the local kernels on CUDA.
    deterministic: the backward is bitwise reproducible; schedule names its
    accumulation order ("auto", or one of dash_fa3.schedule's names). With
    deterministic=False the backward's adds land in any order and the schedule
    only fixes the task order; "auto" then picks "lpt" (longest task first).
    sm_margin: SMs to leave free (e.g. for overlapped communication).
    Returns out, or (out, softmax_lse) with return_attn_probs; softmax_lse is
    (batch, heads, seqlen_q) fp32, natural log; out has v's head dim.
    """
    sm_margin = _check_fa3_extras("flash_attn_func", qv, q_descale, k_descale, v_descale, attention_chunk,
                                  num_splits, pack_gqa, (("causal", causal), ("deterministic", deterministic),
                                                         ("return_attn_probs", return_attn_probs)), sm_margin)
    window = validation.check_window_size(window_size)
    softcap = validation.check_softcap(softcap)
    left, right = (-1, 0 if causal else -1)
    if (window != (-1, -1) or causal) and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and (
            q.dim() == k.dim() == 4):
        left, right = _effective_window(window, causal, q.shape[1], k.shape[1])
        if window == (-1, -1):  # plain causal stays on the causal kernel even where it masks nothing (seqlen_q 1)
            right = 0
    mask = variants.mask_of_window(left, right)  # the kernel family: full, causal or local (a window)
    validation.check_attention_inputs(q, k, v, causal=mask == "causal", mask=mask, schedule=schedule,
                                      softcap=softcap > 0)
    softmax_scale = validation.check_softmax_scale(softmax_scale, q.shape[-1])
    if mask != "local" and softcap == 0:
        out, lse = ops.attention(q, k, v, softmax_scale, mask == "causal", sm_margin, deterministic, schedule)
    else:
        out, lse = ops.attention_general(q, k, v, None, None, 0, 0, softmax_scale, left, right, softcap, sm_margin,
                                         deterministic, schedule)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    schedule="auto",
):
    """Attention over packed documents, FA3's varlen layout.

    q: (total_q, heads, headdim); k: (total_k, heads_kv, headdim); v: (total_k,
    heads_kv, headdim_v) as in ``flash_attn_func``; bf16 or fp16 (fp32 too on
    CPU tensors), last dim contiguous. cu_seqlens_q / cu_seqlens_k: int32, (batch + 1,),
    on q's device: document b is q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
    against k/v rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]); it attends only
    within itself, causal and window masks aligned to its own bottom-right
    corner. Empty documents are legal (their rows, if any, get out 0 and lse
    -inf). max_seqlen_q / max_seqlen_k: the longest documents (checked on CPU
    tensors with the cu_seqlens values; on CUDA tensors the values are not
    read, which would synchronize). window_size, softcap, softmax_scale and
    the flags as in ``flash_attn_func``. seqused_q / seqused_k (int32, one
    entry per document) are accepted when they equal the documents' lengths
    (checked, which synchronizes); fewer used tokens raise NotImplementedError.
    Returns out (total_q, heads, headdim_v), or (out, softmax_lse) with
    return_attn_probs; softmax_lse is (heads, total_q) fp32, natural log.

    Runs on CPU tensors (the fp32 reference, differentiable in q, k, v) and on
    the Hopper kernels, forward and backward. The backward needs the documents'
    lengths on the host: the cu_seqlens tensors are copied once per tensor
    object and version (one synchronisation, shared by every layer that passes
    the same tensors). Its schedules: "auto" ("spt"
    deterministic, "lpt" otherwise), "fa3", "spt", "descending", "lpt";
    "shift" and "symmetric_shift" plan over one geometry and are refused.
    """
    func = "flash_attn_varlen_func"
    sm_margin = _check_fa3_extras(func, qv, q_descale, k_descale, v_descale, attention_chunk, num_splits, pack_gqa,
                                  (("causal", causal), ("deterministic", deterministic),
                                   ("return_attn_probs", return_attn_probs)), sm_margin)
    window = validation.check_window_size(window_size)
    softcap = validation.check_softcap(softcap)
    left, right = reference.window_bounds(window, causal)
    shape = validation.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           schedule=schedule)
    validation.check_seqused("seqused_q", seqused_q, cu_seqlens_q)
    validation.check_seqused("seqused_k", seqused_k, cu_seqlens_k)
    softmax_scale = validation.check_softmax_scale(softmax_scale, q.shape[-1])
    max_seqlen_q, max_seqlen_k = shape.max_seqlen_q, shape.max_seqlen_k
    if q.is_cuda:
        # The kernel family as flash_attn_func picks it, a document's bounds being max_seqlen's at most.
        if window != (-1, -1) or causal:
            left, right = _effective_window(window, causal, max_seqlen_q, max_seqlen_k)
            if window == (-1, -1):
                right = 0
        validation.check_varlen_kernel(q, shape, variants.mask_of_window(left, right), softcap=softcap > 0)
    # A schedule packed documents cannot run is refused on every device, before the forward.
    resolve_varlen_schedule(schedule, deterministic)
    out, lse = ops.attention_general(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                     left, right, softcap, sm_margin, deterministic, schedule)
    return (out, lse) if return_attn_probs else out
