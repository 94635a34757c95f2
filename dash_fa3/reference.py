"""Reference attention in fp32 (or fp64): the ground truth of the tests and the
CPU implementation behind the public ops.

Layout follows FA3: q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k,
heads_kv, d) with heads % heads_kv == 0 (GQA/MQA). The causal mask is aligned to
the bottom-right corner as in FlashAttention: query i sees key j iff
j <= i + seqlen_k - seqlen_q. A query row that sees no key gets out = 0 and
lse = -inf, and zero gradients.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_ref", "attention_bwd_ref", "causal_mask", "default_softmax_scale"]


def default_softmax_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may attend key j (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def _check_compute_dtype(compute_dtype: torch.dtype) -> None:
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")


def _bhsd(x: torch.Tensor, heads: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """(b, s, h_x, d) -> (b, heads, s, d) in compute_dtype, repeating KV heads for GQA."""
    x = x.to(compute_dtype).transpose(1, 2)
    if x.shape[1] != heads:
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
    return x


def _probs(q, k, softmax_scale, causal):
    """Scores' softmax pieces: P (b,h,sq,sk) and lse (b,h,sq); q, k already (b,h,s,d)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # Rows with no visible key: lse = -inf; shifting by +inf makes P exactly 0, not NaN.
    shift = lse.masked_fill(lse == float("-inf"), float("inf"))
    return torch.exp(s - shift.unsqueeze(-1)), lse


def attention_ref(q, k, v, softmax_scale=None, causal=False, compute_dtype=torch.float32):
    """Returns (out, lse): out (b, sq, h, d) and lse (b, h, sq), both in compute_dtype."""
    _check_compute_dtype(compute_dtype)
    heads = q.shape[2]
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    qf, kf, vf = (_bhsd(t, heads, compute_dtype) for t in (q, k, v))
    p, lse = _probs(qf, kf, scale, causal)
    out = torch.matmul(p, vf).transpose(1, 2)
    return out, lse


def attention_bwd_ref(dout, q, k, v, out, softmax_scale=None, causal=False, compute_dtype=torch.float32):
    """Gradients (dq, dk, dv) of attention, in compute_dtype, shaped like q, k, v.

    Uses the given ``out`` for rowsum(dO * O), as the FlashAttention backward does.
    """
    _check_compute_dtype(compute_dtype)
    batch, seqlen_k, heads_kv, d = k.shape
    heads = q.shape[2]
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    qf, kf, vf, dof, of = (_bhsd(t, heads, compute_dtype) for t in (q, k, v, dout, out))
    p, _ = _probs(qf, kf, scale, causal)
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    dpsum = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - dpsum)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale

    def fold_groups(x):  # (b, h, sk, d) -> (b, sk, h_kv, d), summing each group's q-heads
        return x.view(batch, heads_kv, heads // heads_kv, seqlen_k, d).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold_groups(dk), fold_groups(dv)
