"""Reference attention in fp32 (or fp64): the ground truth of the tests and the
CPU implementation behind the public ops.

Layout follows FA3: q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k,
heads_kv, d) with heads % heads_kv == 0 (GQA/MQA). Masks are aligned to the
bottom-right corner as in FlashAttention: with ``offset = seqlen_k - seqlen_q``
and ``window_size = (left, right)``, query i sees key j iff
``i + offset - left <= j <= i + offset + right``, where -1 leaves that side
unbounded; ``causal=True`` is ``right = 0``. A query row that sees no key gets
out = 0 and lse = -inf (FA3's kernels write the same), and zero gradients.

``softcap > 0`` caps the scaled scores as FA3 does:
``s = softcap * tanh(softmax_scale * q·k / softcap)``, then the softmax (and the
lse) over ``s``; the backward multiplies dS by ``1 - tanh²``.

Packed variable-length batches (``attention_varlen_ref`` /
``attention_varlen_bwd_ref``, FA3's ``cu_seqlens`` layout: q (total_q, heads,
d), k/v (total_k, heads_kv, d)) run the same code per document, so each
document attends only within itself, its masks aligned to its own corner.

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

import contextlib
import math
import operator
import warnings

import torch

from . import variants

__all__ = [
    "attention_ref",
    "attention_bwd_ref",
    "attention_varlen_ref",
    "attention_varlen_bwd_ref",
    "causal_mask",
    "visible_mask",
    "window_bounds",
    "default_softmax_scale",
    "SlowReferenceWarning",
    "SLOW_WORK_THRESHOLD",
    "one_thread",
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


def window_bounds(window_size=(-1, -1), causal: bool = False) -> tuple[int, int]:
    """(left, right) of a validated FA3 ``window_size`` with ``causal`` folded in.

    ``None`` on a side means -1 (unbounded). ``causal=True`` sets the right
    bound to 0 whatever ``window_size[1]`` says, as FA3 does (its own tests pass
    causal=True with random windows and expect exactly that)."""
    left, right = (-1 if w is None else int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {tuple(window_size)}")
    return variants.fold_causal(left, right, causal)


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may attend key j (bottom-right aligned)."""
    return _visible(0, seqlen_q, 0, seqlen_k, seqlen_k - seqlen_q, device)


def visible_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal: bool = False, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where query i may attend key j under ``window_size`` / ``causal``."""
    left, right = window_bounds(window_size, causal)
    return _visible(0, seqlen_q, 0, seqlen_k, seqlen_k - seqlen_q, device, left, right)


def _visible(i0: int, i1: int, j0: int, j1: int, offset: int, device, left: int = -1, right: int = 0) -> torch.Tensor:
    """(i1 - i0, j1 - j0) bool: key j is visible to query i iff
    i + offset - left <= j <= i + offset + right (a side of -1 is unbounded)."""
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(j0, j1, device=device).unsqueeze(0)
    d = j - i
    keep = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= d <= offset + right
    if left >= 0:
        keep &= d >= offset - left
    return keep


@contextlib.contextmanager
def one_thread():
    """Runs the block on one intra-op thread, then restores the thread count.

    How a BLAS library splits a product among threads, and how many of them it takes (MKL may take
    fewer than torch asks when the machine is busy), can change the order of a sum and so the last
    bits. On one thread each product of a given shape takes one order, so a computation whose
    shapes are fixed gives the same bits whatever ``torch.get_num_threads()`` is and however loaded
    the machine (on one machine and torch build). The count is the process's: other Python threads
    running torch ops meanwhile get one thread too."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
        try:
            edge = None if isinstance(block_size, bool) else operator.index(block_size)
        except TypeError:
            edge = None
        if edge is None or edge < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        return edge
    edge = math.isqrt(max(1, _TILE_ELEMENTS // max(1, batch * heads)))
    edge = 1 << (edge.bit_length() - 1)
    return min(_MAX_BLOCK, max(_MIN_BLOCK, edge))


def _warn_slow_work(q: torch.Tensor, work: int, what: str) -> None:
    global _warned_slow
    if _warned_slow or q.device.type != "cpu" or work < SLOW_WORK_THRESHOLD:
        return
    _warned_slow = True
    warnings.warn(
        f"dash_fa3: attention on CPU tensors runs the fp32 reference, which is slow (this call: {what}; it "
        f"computes blockwise, so memory stays O(seqlen)). The fast kernels need CUDA tensors on a Hopper GPU. "
        f"Shown once per process.",
        SlowReferenceWarning,
        stacklevel=4,
    )


class _Layout:
    """Shapes and per-block views shared by the forward and the backward.

    Queries of a block are laid out as (b, h_kv, group * rows, d): the ``group``
    q-heads that share a KV head are stacked along the row axis, so one batched
    matmul against that KV head's keys serves the whole group, with no copy of
    K/V per q-head, and Pᵀ·dO / dSᵀ·Q sum over the group by themselves.
    """

    def __init__(self, q, k, softmax_scale, causal, compute_dtype, block_size, window_size=(-1, -1), softcap=0.0):
        _check_compute_dtype(compute_dtype)
        self.batch, self.seqlen_q, self.heads, self.headdim = q.shape
        self.seqlen_k, self.heads_kv = k.shape[1], k.shape[2]
        self.group = self.heads // self.heads_kv
        self.scale = default_softmax_scale(self.headdim) if softmax_scale is None else float(softmax_scale)
        self.left, self.right = window_bounds(window_size, causal)
        self.softcap = 0.0 if softcap is None else float(softcap)
        if not (math.isfinite(self.softcap) and self.softcap >= 0):
            raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
        self.dtype = compute_dtype
        self.device = q.device
        self.offset = self.seqlen_k - self.seqlen_q
        self.block = _block_size(self.batch, self.heads, block_size)

    def work(self) -> int:
        """Score entries times batch and heads, the slow-warning's measure: all of them,
        half when causal, the visible ones under another window."""
        sq, sk = self.seqlen_q, self.seqlen_k
        if self.left < 0 and self.right < 0:
            pairs = sq * sk
        elif self.left < 0 and self.right == 0:
            pairs = sq * sk // 2
        else:
            i = torch.arange(sq)
            hi = (i + self.offset + self.right).clamp(max=sk - 1) if self.right >= 0 else torch.full_like(i, sk - 1)
            lo = (i + self.offset - self.left).clamp(min=0) if self.left >= 0 else torch.zeros_like(i)
            pairs = int((hi - lo + 1).clamp(min=0).sum())
        return self.batch * self.heads * pairs

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
        where every pair of the block is visible, else (group * n, j1 - j0) bool.
        Keys outside the rows' window [i0 + offset - left, i1 - 1 + offset + right]
        are skipped, so a window costs O(window) per row, not O(seqlen_k)."""
        start, end = 0, self.seqlen_k
        if self.right >= 0:
            end = min(end, i1 - 1 + self.offset + self.right + 1)
        if self.left >= 0:
            start = max(start, i0 + self.offset - self.left)
        for j0 in range(start, end, self.block):
            j1 = min(j0 + self.block, end)
            mask = None
            # Some pair of the block lies right of the first row's bound or left of the last row's.
            if (self.right >= 0 and j1 - 1 > i0 + self.offset + self.right) or (
                    self.left >= 0 and j0 < i1 - 1 + self.offset - self.left):
                mask = _visible(i0, i1, j0, j1, self.offset, self.device, self.left, self.right).repeat(self.group, 1)
            yield j0, j1, mask

    def scores(self, qb, kf, j0, j1, mask, keep_tanh=False):
        """(s, t): the scaled, soft-capped and masked scores of the block, and with
        ``keep_tanh`` (and a softcap) t = tanh(scale * q·k / softcap) for the backward, else None."""
        s = torch.matmul(qb, kf[:, :, j0:j1].transpose(-1, -2))
        s.mul_(self.scale)
        t = None
        if self.softcap > 0:
            s.div_(self.softcap).tanh_()
            if keep_tanh:
                t, s = s, s * self.softcap
            else:
                s.mul_(self.softcap)
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
        return s, t


def _finite_or(x: torch.Tensor, value: float) -> torch.Tensor:
    """x with its -inf entries replaced by ``value`` (row maxima of rows that saw no key)."""
    return x.masked_fill(x == float("-inf"), value)


def _row_lse(L: _Layout, qb, kf, i0, i1) -> torch.Tensor:
    """logsumexp over the visible keys of each row of the block (-inf for a row with none)."""
    m = torch.full(qb.shape[:-1], float("-inf"), dtype=L.dtype, device=L.device)
    total = torch.zeros_like(m)
    for j0, j1, mask in L.key_blocks(i0, i1):
        s, _ = L.scores(qb, kf, j0, j1, mask)
        m_new = torch.maximum(m, s.amax(-1))
        shift = _finite_or(m_new, 0.0)
        total = total * torch.exp(m - shift) + s.sub_(shift.unsqueeze(-1)).exp_().sum(-1)
        m = m_new
    return m + torch.log(total)  # -inf + log(0) = -inf for rows with no key


def _forward(L: _Layout, q, k, v):
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
            s, _ = L.scores(qb, kf, j0, j1, mask)
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


def _backward(L: _Layout, dout, q, k, v, out):
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
            s, t = L.scores(qb, kf, j0, j1, mask, keep_tanh=True)
            p = s.sub_(shift).exp_()
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), dob)
            ds = p.mul_(torch.matmul(dob, vf[:, :, j0:j1].transpose(-1, -2)).sub_(dpsum))
            if t is not None:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh²
                ds.mul_(t.square_().neg_().add_(1.0))
            dqb += torch.matmul(ds, kf[:, :, j0:j1])
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb)
        dq[:, i0:i1] = L.unrows(dqb, i1 - i0)
    dq.mul_(L.scale)
    dk.mul_(L.scale)
    return dq, dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()


def _warn_dense(q, L: _Layout) -> None:
    _warn_slow_work(q, L.work(), f"batch {L.batch}, heads {L.heads}, seqlen {L.seqlen_q}x{L.seqlen_k}, "
                                 f"headdim {L.headdim}")


def attention_ref(q, k, v, softmax_scale=None, causal=False, compute_dtype=torch.float32, *, block_size=None,
                  window_size=(-1, -1), softcap=0.0):
    """Returns (out, lse): out (b, sq, h, d) and lse (b, h, sq), contiguous, in compute_dtype.

    ``window_size`` (left, right) and ``softcap`` follow FA3 (module docstring).
    ``block_size`` overrides the query/key block edge (default: chosen from batch * heads)."""
    L = _Layout(q, k, softmax_scale, causal, compute_dtype, block_size, window_size, softcap)
    _warn_dense(q, L)
    return _forward(L, q, k, v)


def attention_bwd_ref(dout, q, k, v, out, softmax_scale=None, causal=False, compute_dtype=torch.float32, *,
                      block_size=None, window_size=(-1, -1), softcap=0.0):
    """Gradients (dq, dk, dv) of attention, contiguous, in compute_dtype, shaped like q, k, v.

    Uses the given ``out`` for rowsum(dO * O), as the FlashAttention backward does,
    and recomputes each row's logsumexp in ``compute_dtype``.
    """
    L = _Layout(q, k, softmax_scale, causal, compute_dtype, block_size, window_size, softcap)
    _warn_dense(q, L)
    return _backward(L, dout, q, k, v, out)


# ---------------------------------------------------------------- packed variable-length batches


def _documents(cu_seqlens_q, cu_seqlens_k):
    """[(q0, q1, k0, k1)] per document of validated cu_seqlens (read on the host)."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck) or len(cq) < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length >= 1, got {len(cq)} and {len(ck)}")
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _varlen_layouts(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, compute_dtype, block_size,
                    window_size, softcap):
    """[(q0, q1, k0, k1, layout)] per document, and the slow-warning check over the whole call."""
    docs = []
    work = 0
    for q0, q1, k0, k1 in _documents(cu_seqlens_q, cu_seqlens_k):
        L = _Layout(q[None, q0:q1], k[None, k0:k1], softmax_scale, causal, compute_dtype, block_size, window_size,
                    softcap)
        work += L.work()
        docs.append((q0, q1, k0, k1, L))
    _warn_slow_work(q, work, f"{len(docs)} documents, {q.shape[0]}x{k.shape[0]} tokens, heads {q.shape[1]}, "
                             f"headdim {q.shape[2]}")
    return docs


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                         compute_dtype=torch.float32, *, block_size=None, window_size=(-1, -1), softcap=0.0):
    """Packed documents (FA3's varlen layout): q (total_q, h, d), k/v (total_k, h_kv, d);
    document b is q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) against k/v rows
    [cu_seqlens_k[b], cu_seqlens_k[b + 1]), masks aligned per document. Empty documents are legal.

    Returns (out, lse): out (total_q, h, d) and lse (h, total_q), as FA3 lays them
    out, contiguous, in compute_dtype. cu_seqlens are read on the host."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=compute_dtype, device=q.device)
    for q0, q1, k0, k1, L in _varlen_layouts(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                             compute_dtype, block_size, window_size, softcap):
        if q1 == q0 or k1 == k0:  # nothing to compute: out 0, lse -inf
            continue
        o, l = _forward(L, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def attention_varlen_bwd_ref(dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                             compute_dtype=torch.float32, *, block_size=None, window_size=(-1, -1), softcap=0.0):
    """Gradients (dq, dk, dv) of ``attention_varlen_ref``, contiguous, in compute_dtype, shaped like q, k, v."""
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=q.device)
    for q0, q1, k0, k1, L in _varlen_layouts(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                             compute_dtype, block_size, window_size, softcap):
        if q1 == q0 or k1 == k0:
            continue
        g = _backward(L, dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1])
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
