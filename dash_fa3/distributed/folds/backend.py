"""Block-compute backends: the arithmetic of the folds, apart from the scheduling and communication.

The runtime (``runtime.py``) decides which folds a rank advances at each step and
moves the data; a backend does the floating-point work on (G x G) tiles aligned to
global block boundaries. Bitwise invariance to the number of ranks rests on one
contract: **every method's result bits depend only on its arguments' values**,
never on which rank calls it, how many blocks that rank holds, or what it
computed before. Then a fold gives the same bits wherever it runs, because it
is the same sequence of calls on the same values.

:class:`TorchBlockBackend` implements it with plain torch ops in fp32 on fixed
shapes (one (G x d) @ (d x G) GEMM per head per tile, batched over batch and
heads; fresh contiguous operands, so the BLAS sees the same shapes, strides and
alignment every time). A kernel backend replaces it by overriding
:meth:`BlockBackend.fwd_segment` (a run of key blocks for one query block, one
launch) and :meth:`BlockBackend.bwd_step` (all of a step's block pairs, one
launch), keeping the accumulators in fp32.

Shapes, per block of G tokens: q/out/dO (b, G, h, d) and k/v (b, G, h_kv, d) in
the input dtype; lse and delta (b, h, G) fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..layout import G


@dataclass
class FwdState:
    m: torch.Tensor     # running row max (b, h, G), fp32
    l: torch.Tensor     # running row sum of exp (b, h, G)
    acc: torch.Tensor   # unnormalised output (b, h, G, d)


@dataclass
class DqState:
    acc: torch.Tensor   # sum of dS @ K (b, h, G, d), fp32; scaled at the end


@dataclass
class DkvState:
    dk: torch.Tensor    # (b, h_kv, G, d) fp32, heads of a GQA group already summed
    dv: torch.Tensor


class BlockBackend:
    """Interface. ``load_*`` turn raw blocks (the input dtype, as stored or received) into the
    backend's working form; folds start with ``*_init``, advance tile by tile in ascending
    partner order, and end with ``*_finish``, which converts to the output dtype once."""

    def __init__(self, heads: int, heads_kv: int, softmax_scale: float):
        self.heads, self.heads_kv, self.scale = heads, heads_kv, float(softmax_scale)

    # working forms
    def load_q(self, q: torch.Tensor) -> Any:
        raise NotImplementedError

    def load_kv(self, k: torch.Tensor, v: torch.Tensor) -> Any:
        raise NotImplementedError

    def load_qrow(self, q: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> Any:
        raise NotImplementedError

    def delta(self, out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
        """rowsum(dO * O) of one block, (b, h, G) fp32."""
        raise NotImplementedError

    # forward fold of a query block
    def fwd_init(self, q: Any) -> FwdState:
        raise NotImplementedError

    def fwd_tile(self, st: FwdState, q: Any, kv: Any, diagonal: bool) -> None:
        raise NotImplementedError

    def fwd_segment(self, st: FwdState, q: Any, kvs: list, diagonal_last: bool) -> None:
        """Fold consecutive key blocks in order; the last one is the causal diagonal if
        ``diagonal_last``. A kernel backend does this in one launch."""
        for n, kv in enumerate(kvs):
            self.fwd_tile(st, q, kv, diagonal_last and n == len(kvs) - 1)

    def fwd_finish(self, st: FwdState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # backward folds: dQ of a query block, dK/dV of a key block
    def dq_init(self, qrow: Any) -> DqState:
        raise NotImplementedError

    def dkv_init(self, kv: Any) -> DkvState:
        raise NotImplementedError

    def bwd_tile(self, dq: DqState | None, dkv: DkvState | None, qrow: Any, kv: Any, diagonal: bool) -> None:
        """One (query block, key block) pair: advance the dQ fold, the dK/dV fold, or both. When
        both are given, S, P and dS are computed once; the bits are those of two separate calls."""
        raise NotImplementedError

    def bwd_step(self, pairs: list) -> None:
        """A step's pairs ``(dq_state | None, dkv_state | None, qrow, kv, diagonal)`` in an order
        that is ascending along every row and every column. A kernel backend does this in one launch."""
        for dq, dkv, qrow, kv, diagonal in pairs:
            self.bwd_tile(dq, dkv, qrow, kv, diagonal)

    def dq_finish(self, st: DqState, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def dkv_finish(self, st: DkvState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def _fresh(x: torch.Tensor, shape=None) -> torch.Tensor:
    """An fp32 copy in a new allocation: same layout and alignment for every call, whatever
    view ``x`` is (a slice of a local shard, of a receive buffer, ...)."""
    out = torch.empty(shape or x.shape, dtype=torch.float32, device=x.device)
    out.copy_(x)
    return out


def _bhgd(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, G, h_x, d) raw block -> fresh fp32 (b, heads, G, d), KV heads repeated for GQA."""
    b, g, hx, d = x.shape
    x = x.transpose(1, 2)
    if hx != heads:
        x = x.unsqueeze(2).expand(b, hx, heads // hx, g, d).reshape(b, heads, g, d)
    return _fresh(x, (b, heads, g, d))


class TorchBlockBackend(BlockBackend):
    """The reference backend: torch ops, fp32, one tile at a time (any device torch supports;
    the runtime uses it on CPU)."""

    def __init__(self, heads: int, heads_kv: int, softmax_scale: float, device=None):
        super().__init__(heads, heads_kv, softmax_scale)
        self._above = torch.ones(G, G, dtype=torch.bool, device=device).triu_(1)   # masked in a diagonal tile

    def load_q(self, q):
        return _bhgd(q, self.heads)

    def load_kv(self, k, v):
        return _bhgd(k, self.heads), _bhgd(v, self.heads)

    def load_qrow(self, q, dout, lse, delta):
        return _bhgd(q, self.heads), _bhgd(dout, self.heads), _fresh(lse), _fresh(delta)

    def delta(self, out, dout):
        prod = _fresh(out) * _fresh(dout)
        return _fresh(prod.sum(-1).transpose(1, 2))

    def _scores(self, q, k, diagonal):
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if diagonal:
            s.masked_fill_(self._above, float("-inf"))
        return s

    def fwd_init(self, q):
        b, h, g, d = q.shape
        return FwdState(m=torch.full((b, h, g), float("-inf"), device=q.device),
                        l=torch.zeros((b, h, g), device=q.device),
                        acc=torch.zeros((b, h, g, d), device=q.device))

    def fwd_tile(self, st, q, kv, diagonal):
        k, v = kv
        s = self._scores(q, k, diagonal)
        m_new = torch.maximum(st.m, s.amax(-1))
        # rows that have seen no key yet keep m = -inf; shifting them by 0 makes exp() exactly 0, not NaN
        shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
        p = torch.exp(s - shift.unsqueeze(-1))
        alpha = torch.exp(st.m - shift)
        st.l = st.l * alpha + p.sum(-1)
        st.acc = st.acc * alpha.unsqueeze(-1) + torch.matmul(p, v)
        st.m = m_new

    def fwd_finish(self, st, dtype):
        seen = st.l > 0
        out = st.acc / torch.where(seen, st.l, torch.ones_like(st.l)).unsqueeze(-1)
        lse = torch.where(seen, st.m + torch.log(torch.where(seen, st.l, torch.ones_like(st.l))),
                          torch.full_like(st.l, float("-inf")))
        return out.transpose(1, 2).to(dtype), lse

    def dq_init(self, qrow):
        return DqState(acc=torch.zeros_like(qrow[0]))

    def dkv_init(self, kv):
        b, _, g, d = kv[0].shape
        z = torch.zeros((b, self.heads_kv, g, d), device=kv[0].device)
        return DkvState(dk=z, dv=z.clone())

    def _group_sum(self, x):
        """(b, h, G, d) -> (b, h_kv, G, d): a GQA group's query heads, summed in head order."""
        if self.heads == self.heads_kv:
            return x
        b, h, g, d = x.shape
        return x.view(b, self.heads_kv, h // self.heads_kv, g, d).sum(2)

    def bwd_tile(self, dq, dkv, qrow, kv, diagonal):
        q, do, lse, delta = qrow
        k, v = kv
        s = self._scores(q, k, diagonal)
        # lse is finite for every row (each query sees at least its own key), so P is exact 0 where masked
        p = torch.exp(s - lse.unsqueeze(-1))
        dp = torch.matmul(do, v.transpose(-1, -2))
        ds = p * (dp - delta.unsqueeze(-1))
        if dq is not None:
            dq.acc = dq.acc + torch.matmul(ds, k)
        if dkv is not None:
            dkv.dv = dkv.dv + self._group_sum(torch.matmul(p.transpose(-1, -2), do))
            dkv.dk = dkv.dk + self._group_sum(torch.matmul(ds.transpose(-1, -2), q))

    def dq_finish(self, st, dtype):
        return (st.acc * self.scale).transpose(1, 2).to(dtype)

    def dkv_finish(self, st, dtype):
        return (st.dk * self.scale).transpose(1, 2).to(dtype), st.dv.transpose(1, 2).to(dtype)


def get_backend(device: torch.device, heads: int, heads_kv: int, softmax_scale: float) -> BlockBackend:
    """The fold backend (``algorithm="folds"``) for tensors on ``device``. Only the CPU one exists
    (a CUDA one would need kernels with fp32 fold state in global memory)."""
    if device.type != "cpu":
        raise NotImplementedError(
            f"dash_fa3.distributed: the folds run on CPU tensors (gloo) only; on {device.type} use "
            f"algorithm='heads' (the deterministic default) or deterministic=False")
    return TorchBlockBackend(heads, heads_kv, softmax_scale, device)
