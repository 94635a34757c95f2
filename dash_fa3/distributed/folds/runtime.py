"""Executes a validated fold schedule on one rank: messages in step order, folds on a block backend.

Per step t, per wave: post this rank's packed sends and receives of (t, wave) through a
``transport.P2PExchange``; during wave 0 compute the step's work items; then wait for the wave's
messages, each wait bounded by the process group's timeout (``comm.wait_works``): a peer that died
or stalled raises :class:`~..comm.CommunicationError` naming the step and peers, so no rank hangs.
There is no barrier: a rank waits only for the messages it takes part in.

A message is every transfer of one (src, dst, step, wave), packed as raw bytes in the order both
sides derive from the schedule (kind, then block), so one send/receive pair moves it whatever mix
of dtypes it holds.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import transport as tr
from ..layout import G, local_blocks
from .backend import BlockBackend
from .plan import OWN, PARTNER, PASS_INPUTS
from .validate import get_schedule, rank_program

@functools.lru_cache(maxsize=64)
def plan(num_ranks: int, seqlen: int, causal: bool, pass_: str, layout: str, rank: int):
    """This rank's program; per fold it computes, the step of the fold's last item (when its result
    is final); per step, the input blocks used for the last time (dropped after it, so a rank holds
    about two chunks of other ranks' data, not everything it ever needs); local block indices."""
    sched, report = get_schedule(num_ranks, seqlen, causal, pass_, layout)
    prog = rank_program(sched, report, rank)
    last, last_use = {}, {}
    for st in prog:
        for w in st.works:
            last[(w.kind, w.block)] = st.step
            last_use[(OWN[w.kind], w.block)] = st.step
            for j in range(w.lo, w.hi):
                last_use[(PARTNER[w.kind], j)] = st.step
        for sends, _ in st.waves:
            for m in sends:
                for x in m.transfers:
                    if x.kind in PASS_INPUTS[pass_]:
                        for j in range(x.lo, x.hi):
                            last_use[(x.kind, j)] = st.step
    expire = [[] for _ in prog]
    for key, t in last_use.items():
        expire[t].append(key)
    local = local_blocks(layout, num_ranks, sched.num_blocks, rank).tolist()
    return prog, last, expire, {b: i for i, b in enumerate(local)}


class _Store:
    """Raw per-block tensors this rank holds (owned, received or computed), by (data kind, block).
    The raw form is what travels; the backend's working form is made on first use."""

    def __init__(self, shapes: dict, device, loaders: dict):
        self.device = device
        self.loaders = loaders   # kind -> the backend's load_* for the kinds computed with
        self.raw: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self.forms: dict[tuple[str, int], object] = {}
        self.shapes = shapes   # kind -> ((shape, dtype), ...)

    def form(self, kind: str, blk: int):
        """The working form of a block's data (made once, on first use)."""
        key = (kind, blk)
        if key not in self.forms:
            self.forms[key] = self.loaders[kind](*self.raw[key])
        return self.forms[key]

    def nbytes(self, kind: str) -> int:
        n = 0
        for shape, dtype in self.shapes[kind]:
            numel = 1
            for x in shape:
                numel *= x
            n += numel * torch.empty((), dtype=dtype).element_size()
        return n

    def pack(self, transfers) -> torch.Tensor:
        parts = []
        for x in transfers:
            for b in range(x.lo, x.hi):
                for t in self.raw[(x.kind, b)]:
                    parts.append(t.contiguous().view(torch.uint8).reshape(-1))
        return torch.cat(parts)

    def unpack(self, transfers, buf: torch.Tensor) -> None:
        off = 0
        for x in transfers:
            for b in range(x.lo, x.hi):
                ts = []
                for shape, dtype in self.shapes[x.kind]:
                    n = 1
                    for s in shape:
                        n *= s
                    n *= torch.empty((), dtype=dtype).element_size()
                    ts.append(buf[off:off + n].view(dtype).view(shape))
                    off += n
                self.raw[(x.kind, b)] = tuple(ts)


def _exchange(store: _Store, sends, recvs, group, rank: int, step: int, wave: int, compute=None):
    """Post one wave's messages, run ``compute`` meanwhile, wait (bounded), unpack the receives."""
    ex = tr.P2PExchange(group, rank, f"step {step} wave {wave}", store.device, tag=step * 1024 + wave)
    for m in sends:
        ex.send(m.peer, store.pack(m.transfers))
    bufs = [ex.recv_buffer(m.peer, (sum(store.nbytes(x.kind) * (x.hi - x.lo) for x in m.transfers),), torch.uint8)
            for m in recvs]
    ex.post()
    if compute is not None:
        compute()
    ex.wait()
    for m, buf in zip(recvs, bufs):
        store.unpack(m.transfers, buf)


def _run(prog, expire, store: _Store, group, rank: int, compute_step) -> None:
    for st in prog:
        if not st.waves:
            compute_step(st)
        for v, (sends, recvs) in enumerate(st.waves):
            _exchange(store, sends, recvs, group, rank, st.step, v,
                      compute=(lambda: compute_step(st)) if v == 0 else None)
        for key in expire[st.step]:
            store.raw.pop(key, None)
            store.forms.pop(key, None)


def _local_slices(index: dict, blocks):
    for b in blocks:
        i = index[b]
        yield b, slice(i * G, (i + 1) * G)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, causal: bool, layout: str,
            backend: BlockBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (out (b, n, h, d) in q's dtype, lse (b, h, n) fp32) for local shards q, k, v."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    hk = k.shape[2]
    prog, last, expire, index = plan(P, n * P, bool(causal), "fwd", layout, rank)
    dt = q.dtype
    store = _Store({"q": (((b, G, h, d), dt),), "kv": (((b, G, hk, d), dt),) * 2,
                    "o": (((b, G, h, d), dt), ((b, h, G), torch.float32))}, q.device,
                   {"q": backend.load_q, "kv": backend.load_kv})
    for blk, sl in _local_slices(index, index):
        store.raw[("q", blk)] = (q[:, sl],)
        store.raw[("kv", blk)] = (k[:, sl], v[:, sl])

    form = store.form
    states = {}

    def compute_step(st):
        for w in st.works:
            qf = form("q", w.block)
            state = states.get(w.block)
            if state is None:
                state = states[w.block] = backend.fwd_init(qf)
            backend.fwd_segment(state, qf, [form("kv", j) for j in range(w.lo, w.hi)],
                                diagonal_last=causal and w.hi - 1 == w.block)
            if last[(w.kind, w.block)] == st.step:
                store.raw[("o", w.block)] = backend.fwd_finish(states.pop(w.block), dt)

    _run(prog, expire, store, group, rank, compute_step)
    out = torch.empty((b, n, h, d), dtype=dt, device=q.device)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    for blk, sl in _local_slices(index, index):
        o, l_ = store.raw[("o", blk)]
        out[:, sl] = o
        lse[:, :, sl] = l_
    return out, lse


def backward(dout, q, k, v, out, lse, *, group, causal: bool, layout: str,
             backend: BlockBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (dq, dk, dv), shaped and typed like its q, k, v shards."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    hk = k.shape[2]
    prog, last, expire, index = plan(P, n * P, bool(causal), "bwd", layout, rank)
    dt = q.dtype
    row, kvrow = ((b, G, h, d), dt), ((b, G, hk, d), dt)
    stats = ((b, h, G), torch.float32)
    store = _Store({"kv": (kvrow, kvrow), "qrow": (row, row, stats, stats), "dq": (row,), "dkv": (kvrow, kvrow)},
                   q.device, {"qrow": backend.load_qrow, "kv": backend.load_kv})
    for blk, sl in _local_slices(index, index):
        store.raw[("kv", blk)] = (k[:, sl], v[:, sl])
        delta = backend.delta(out[:, sl], dout[:, sl])
        store.raw[("qrow", blk)] = (q[:, sl], dout[:, sl], lse[:, :, sl], delta)

    form = store.form
    dq_states, dkv_states = {}, {}

    def compute_step(st):
        pairs = {}   # (i, j) -> [dq fold of i?, dkv fold of j?]
        for w in st.works:
            if w.kind == "bwd_dq":
                if w.block not in dq_states:
                    dq_states[w.block] = backend.dq_init(form("qrow", w.block))
                for j in range(w.lo, w.hi):
                    pairs.setdefault((w.block, j), [False, False])[0] = True
            else:
                if w.block not in dkv_states:
                    dkv_states[w.block] = backend.dkv_init(form("kv", w.block))
                for i in range(w.lo, w.hi):
                    pairs.setdefault((i, w.block), [False, False])[1] = True
        # row-major order is ascending along every row (dQ folds) and every column (dK/dV folds)
        backend.bwd_step([(dq_states[i] if a else None, dkv_states[j] if c else None,
                           form("qrow", i), form("kv", j), causal and i == j)
                          for (i, j), (a, c) in sorted(pairs.items())])
        for w in st.works:
            if last[(w.kind, w.block)] != st.step:
                continue
            if w.kind == "bwd_dq":
                store.raw[("dq", w.block)] = (backend.dq_finish(dq_states.pop(w.block), dt),)
            else:
                store.raw[("dkv", w.block)] = backend.dkv_finish(dkv_states.pop(w.block), dt)

    _run(prog, expire, store, group, rank, compute_step)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for blk, sl in _local_slices(index, index):
        dq[:, sl] = store.raw[("dq", blk)][0]
        dk[:, sl], dv[:, sl] = store.raw[("dkv", blk)]
    return dq, dk, dv
