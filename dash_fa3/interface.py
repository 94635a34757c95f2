"""``flash_attn_func``: a drop-in for FlashAttention-3's ``flash_attn_interface.flash_attn_func``.

Argument names, order and return convention follow FA3. FA3 features that
dash_fa3 does not implement raise ``NotImplementedError`` rather than being
ignored. dash_fa3 adds ``schedule=``, the deterministic backward's schedule.
"""

from __future__ import annotations

import math

from . import ops, reference, validation


def _unsupported(feature: str) -> NotImplementedError:
    return NotImplementedError(f"dash_fa3.flash_attn_func does not support {feature}")


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

    q: (batch, seqlen_q, heads, headdim); k, v: (batch, seqlen_k, heads_kv, headdim),
    bf16 or fp16, last dim contiguous, heads % heads_kv == 0.
    softmax_scale defaults to 1/sqrt(headdim). causal aligns the mask to the
    bottom-right corner when seqlen_q != seqlen_k.
    deterministic: the backward is bitwise reproducible; schedule names its
    accumulation order ("auto", or one of dash_fa3.schedule's names). With
    deterministic=False the backward's adds land in any order and the schedule
    only fixes the task order; "auto" then picks "lpt" (longest task first).
    sm_margin: SMs to leave free (e.g. for overlapped communication).
    Returns out, or (out, softmax_lse) with return_attn_probs; softmax_lse is
    (batch, heads, seqlen_q) fp32, natural log.
    """
    if qv is not None:
        raise _unsupported("qv")
    if q_descale is not None or k_descale is not None or v_descale is not None:
        raise _unsupported("fp8 descaling (q_descale/k_descale/v_descale)")
    if tuple(window_size) not in ((-1, -1), (None, None)):
        raise _unsupported(f"local attention (window_size={tuple(window_size)})")
    if attention_chunk not in (0, None):
        raise _unsupported(f"attention_chunk={attention_chunk}")
    if softcap not in (0, 0.0, None):
        raise _unsupported(f"softcap={softcap}")
    # FA3's callers pass num_splits=0 (its heuristic) or 1 and pack_gqa=None/False: both mean one split, no packing.
    if num_splits not in (0, 1):
        raise _unsupported(f"num_splits={num_splits}")
    if pack_gqa not in (None, False):
        raise _unsupported(f"pack_gqa={pack_gqa!r}")
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"sm_margin must be a non-negative int, got {sm_margin!r}")

    validation.check_attention_inputs(q, k, v, causal=causal, schedule=schedule)
    if softmax_scale is None:
        softmax_scale = reference.default_softmax_scale(q.shape[-1])
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not (
            math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    out, lse = ops.attention(q, k, v, float(softmax_scale), causal, sm_margin, deterministic, schedule)
    return (out, lse) if return_attn_probs else out
