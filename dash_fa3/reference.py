"""Reference attention in fp32 (or fp64): the ground truth of the tests and the
CPU implementation behind the public ops.

Layout follows FA3: q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k,
heads_kv, d) with heads % heads_kv == 0 (GQA/MQA). The causal mask is aligned to
the bottom-right corner as in FlashAttention: query i sees key j iff
j <= i + seqlen_k - seqlen_q. A query row that sees no key gets out = 0 and
lse = -inf, and zero gradients.

Both directions work blockwise: a block of queries at a time, and within it a
block of keys at a time (the forward keeps a running max and sum per row; the
backward first recomputes each row's logsumexp, then the gradients). The extra
memory is O(seqlen), never a (seqlen_q, seqlen_k) score matrix, and every
result is accumulated in ``compute_dtype`` (fp32, or fp64 for the tests' exact
checks). Outputs are contiguous: out (b, sq, h, d), lse (b, h, sq), dq like q's
shape, dk/dv like k's shape, which is what the custom ops' fake (meta)
implementations declare.

On CPU tensors this is what ``flash_attn_func`` runs. It is correct but slow:
a CPU call of at least ``SLOW_WORK_THRESHOLD`` score entries (batch * heads *
seqlen_q * seqlen_k, halved when causal) warns once per process with
``SlowReferenceWarning``.
"""

from __future__ import annotations

import math
import warnings

import torch

__all__ = [
    "attention_ref",
    "attention_bwd_ref",
    "causal_mask",
    "default_softmax_scale",
    "SlowReferenceWarning",
    "SLOW_WORK_THRESHOLD",
]

# A CPU call with at least this many (unmasked) score entries warns once: about a
# second or more of fp32 work per direction on a small CPU at head dim 64.
SLOW_WORK_THRESHOLD = 1 << 27

# Upper bound on the elements of one (query block x key block) score tile across
# batch and heads; the block edge is the largest power of two under it (64..1024).
_TILE_ELEMENTS = 1 << 22
_MIN_BLOCK, _MAX_BLOCK = 64, 1024

_warned_slow = False


class SlowReferenceWarning(UserWarning):
    """A large attention call ran on the CPU: the fp32 reference computes it, correctly but slowly."""


def default_softmax_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may attend key j (bottom-right aligned)."""
    return _visible(0, seqlen_q, 0, seqlen_k, seqlen_k - seqlen_q, device)


def _visible(i0: int, i1: int, j0: int, j1: int, offset: int, device) -> torch.Tensor:
    """(i1 - i0, j1 - j0) bool: key j is visible to query i iff j <= i + offset."""
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(j0, j1, device=device).unsqueeze(0)
    return j <= i + offset


def _check_compute_dtype(compute_dtype: torch.dtype) -> None:
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")


def _bhsd(x: torch.Tensor, heads: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """(b, s, h_x, d) -> (b, heads, s, d) in compute_dtype, repeating KV heads for GQA.

    Not used by the blockwise code; the tests' low-precision baseline builds on it."""
    x = x.to(compute_dtype).transpose(1, 2)
    if x.shape[1] != heads:
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
    return x


def _block_size(batch: int, heads: int, block_size: int | None) -> int:
    if block_size is not None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        return block_size
    edge = math.isqrt(max(1, _TILE_ELEMENTS // max(1, batch * heads)))
    edge = 1 << (edge.bit_length() - 1)
    return min(_MAX_BLOCK, max(_MIN_BLOCK, edge))


def _maybe_warn_slow(q: torch.Tensor, seqlen_k: int, causal: bool) -> None:
    global _warned_slow
    if _warned_slow or q.device.type != "cpu":
        return
    batch, seqlen_q, heads, headdim = q.shape
    work = batch * heads * seqlen_q * seqlen_k // (2 if causal else 1)
    if work < SLOW_WORK_THRESHOLD:
        return
    _warned_slow = True
    warnings.warn(
        f"dash_fa3: attention on CPU tensors runs the fp32 reference, which is slow (this call: batch {batch}, "
        f"heads {heads}, seqlen {seqlen_q}x{seqlen_k}, headdim {headdim}; it computes blockwise, so memory stays "
        f"O(seqlen)). The fast kernels need CUDA tensors on a Hopper GPU. Shown once per process.",
        SlowReferenceWarning,
        stacklevel=3,
    )


class _Layout:
    """Shapes and per-block views shared by the forward and the backward.

    Queries of a block are laid out as (b, h_kv, group * rows, d): the ``group``
    q-heads that share a KV head are stacked along the row axis, so one batched
    matmul against that KV head's keys serves the whole group, with no copy of
    K/V per q-head, and Pᵀ·dO / dSᵀ·Q sum over the group by themselves.
    """

    def __init__(self, q, k, softmax_scale, causal, compute_dtype, block_size):
        _check_compute_dtype(compute_dtype)
        self.batch, self.seqlen_q, self.heads, self.headdim = q.shape
        self.seqlen_k, self.heads_kv = k.shape[1], k.shape[2]
        self.group = self.heads // self.heads_kv
        self.scale = default_softmax_scale(self.headdim) if softmax_scale is None else float(softmax_scale)
        self.causal = bool(causal)
        self.dtype = compute_dtype
        self.device = q.device
        self.offset = self.seqlen_k - self.seqlen_q
        self.block = _block_size(self.batch, self.heads, block_size)

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        """(b, sk, h_kv, d) -> contiguous (b, h_kv, sk, d) in the compute dtype (O(seqlen) memory)."""
        return x.to(self.dtype).transpose(1, 2).contiguous()

    def rows(self, x: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """Query rows [i0, i1) of (b, sq, h, d') -> (b, h_kv, group * (i1 - i0), d')."""
        b, n = self.batch, i1 - i0
        blk = x[:, i0:i1].to(self.dtype).reshape(b, n, self.heads_kv, self.group, x.shape[-1])
        return blk.permute(0, 2, 3, 1, 4).reshape(b, self.heads_kv, self.group * n, x.shape[-1])

    def unrows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Inverse of ``rows``: (b, h_kv, group * n, d') -> (b, n, h, d') (a view)."""
        b, d = self.batch, x.shape[-1]
        return x.view(b, self.heads_kv, self.group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, self.heads, d)

    def key_blocks(self, i0: int, i1: int):
        """(j0, j1, mask) for the key blocks that rows [i0, i1) can see; mask is None
        where every pair of the block is visible, else (group * n, j1 - j0) bool."""
        end = self.seqlen_k
        if self.causal:
            end = min(end, i1 - 1 + self.offset + 1)
        for j0 in range(0, max(end, 0), self.block):
            j1 = min(j0 + self.block, end)
            mask = None
            if self.causal and j1 - 1 > i0 + self.offset:
                mask = _visible(i0, i1, j0, j1, self.offset, self.device).repeat(self.group, 1)
            yield j0, j1, mask

    def scores(self, qb, kf, j0, j1, mask):
        s = torch.matmul(qb, kf[:, :, j0:j1].transpose(-1, -2))
        s.mul_(self.scale)
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
        return s


def _finite_or(x: torch.Tensor, value: float) -> torch.Tensor:
    """x with its -inf entries replaced by ``value`` (row maxima of rows that saw no key)."""
    return x.masked_fill(x == float("-inf"), value)


def _row_lse(L: _Layout, qb, kf, i0, i1) -> torch.Tensor:
    """logsumexp over the visible keys of each row of the block (-inf for a row with none)."""
    m = torch.full(qb.shape[:-1], float("-inf"), dtype=L.dtype, device=L.device)
    total = torch.zeros_like(m)
    for j0, j1, mask in L.key_blocks(i0, i1):
        s = L.scores(qb, kf, j0, j1, mask)
        m_new = torch.maximum(m, s.amax(-1))
        shift = _finite_or(m_new, 0.0)
        total = total * torch.exp(m - shift) + s.sub_(shift.unsqueeze(-1)).exp_().sum(-1)
        m = m_new
    return m + torch.log(total)  # -inf + log(0) = -inf for rows with no key


def attention_ref(q, k, v, softmax_scale=None, causal=False, compute_dtype=torch.float32, *, block_size=None):
    """Returns (out, lse): out (b, sq, h, d) and lse (b, h, sq), contiguous, in compute_dtype.

    ``block_size`` overrides the query/key block edge (default: chosen from batch * heads)."""
    L = _Layout(q, k, softmax_scale, causal, compute_dtype, block_size)
    _maybe_warn_slow(q, L.seqlen_k, L.causal)
    kf, vf = L.kv(k), L.kv(v)
    out = torch.zeros(L.batch, L.seqlen_q, L.heads, v.shape[-1], dtype=L.dtype, device=L.device)
    lse = torch.full((L.batch, L.heads_kv, L.group, L.seqlen_q), float("-inf"), dtype=L.dtype, device=L.device)
    for i0 in range(0, L.seqlen_q, L.block):
        i1 = min(i0 + L.block, L.seqlen_q)
        qb = L.rows(q, i0, i1)
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=L.dtype, device=L.device)
        total = torch.zeros_like(m)
        acc = None
        for j0, j1, mask in L.key_blocks(i0, i1):
            s = L.scores(qb, kf, j0, j1, mask)
            m_new = torch.maximum(m, s.amax(-1))
            shift = _finite_or(m_new, 0.0)
            p = s.sub_(shift.unsqueeze(-1)).exp_()
            rescale = torch.exp(m - shift)  # 0 on the first block (m = -inf)
            pv = torch.matmul(p, vf[:, :, j0:j1])
            acc = pv if acc is None else acc * rescale.unsqueeze(-1) + pv
            total = total * rescale + p.sum(-1)
            m = m_new
        if acc is None:  # no row of this block sees a key
            continue
        # Rows that saw no key have total = 0 and acc = 0: out stays 0.
        acc = acc / total.clamp_min(torch.finfo(L.dtype).tiny).unsqueeze(-1)
        out[:, i0:i1] = L.unrows(acc, i1 - i0)
        lse[..., i0:i1] = (m + torch.log(total)).view(L.batch, L.heads_kv, L.group, i1 - i0)
    return out, lse.view(L.batch, L.heads, L.seqlen_q)


def attention_bwd_ref(dout, q, k, v, out, softmax_scale=None, causal=False, compute_dtype=torch.float32, *,
                      block_size=None):
    """Gradients (dq, dk, dv) of attention, contiguous, in compute_dtype, shaped like q, k, v.

    Uses the given ``out`` for rowsum(dO * O), as the FlashAttention backward does,
    and recomputes each row's logsumexp in ``compute_dtype``.
    """
    L = _Layout(q, k, softmax_scale, causal, compute_dtype, block_size)
    _maybe_warn_slow(q, L.seqlen_k, L.causal)
    kf, vf = L.kv(k), L.kv(v)
    dq = torch.zeros(L.batch, L.seqlen_q, L.heads, L.headdim, dtype=L.dtype, device=L.device)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for i0 in range(0, L.seqlen_q, L.block):
        i1 = min(i0 + L.block, L.seqlen_q)
        qb = L.rows(q, i0, i1)
        dob = L.rows(dout, i0, i1)
        dpsum = (dob * L.rows(out, i0, i1)).sum(-1, keepdim=True)
        # Rows with no visible key: shift by +inf so that P is exactly 0, not NaN.
        shift = _finite_or(_row_lse(L, qb, kf, i0, i1), float("inf")).unsqueeze(-1)
        dqb = torch.zeros_like(qb)
        for j0, j1, mask in L.key_blocks(i0, i1):
            p = L.scores(qb, kf, j0, j1, mask).sub_(shift).exp_()
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), dob)
            ds = p.mul_(torch.matmul(dob, vf[:, :, j0:j1].transpose(-1, -2)).sub_(dpsum))
            dqb += torch.matmul(ds, kf[:, :, j0:j1])
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb)
        dq[:, i0:i1] = L.unrows(dqb, i1 - i0)
    dq.mul_(L.scale)
    dk.mul_(L.scale)
    return dq, dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()
