"""Head-parallel context parallelism: each rank computes whole heads over the whole sequence.

The plan (``dash_fa3/schedule/cp_heads.py``) gives each rank whole KV heads and their query heads.
Every rank sends each peer its tokens of the peer's heads and receives the peers' tokens of its
own; it then runs the single-GPU kernels (on CPU, the reference, one KV group at a time) on the
whole sequence and sends each peer its tokens of the result. The forward's gathered q, k, v, out
and lse are what autograd keeps, so the backward moves only dO in and dQ, dK, dV out. Every head is
thus one single-GPU computation: output, LSE and gradients are bitwise ``flash_attn_func``'s on one
GPU on the whole problem, in both modes (the deterministic one with its default schedule), for
every number of ranks and both layouts. The backward runs the whole problem's schedule restricted
to the rank's heads (``ops.bwd_heads_part``): the shift orders place a head's units by its index
among all heads, so a call holding only some heads would otherwise give them other dQ orders.

Messages go through ``batch_isend_irecv`` (NCCL runs them on its own stream, ordered after the
compute stream's producers; ``Work.wait()`` makes the compute stream wait, not the host). The
rank's heads can be cut into chunks (:func:`default_chunks`) whose transfers are posted around the
other chunks' compute; every rank posts the same sequence of batches (inputs 0, inputs 1, results 0,
inputs 2, results 1, ...), each pairing with its peers' batch of the same position. With
``DASH_FA3_CP_TRANSPORT=shared`` the same messages move through buffers every rank maps, on copy
engines (shared.py); the bits are the same either way. Gathered
tensors are stored sequence-major ((tokens, ...), the remaining dimensions in order), so that a
peer's piece of tokens is one contiguous region its message fills in place; the kernels read them
through strided views. On CPU (gloo) each wait is bounded by the process group's timeout and a
failed or stalled peer raises :class:`~.runtime.CommunicationError`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import ops, reference
from ..schedule import cp_heads
from ..schedule.distributed import G
from . import runtime, shared

# The CPU compute's block edge: fixed, so a head's arithmetic does not depend on the call's shape.
CPU_BLOCK = 128


# Chunks of each rank's heads in the transfer/compute pipeline (at most the smallest rank's KV-head
# count). One by default: on two H200s (2026-11-24) two or four chunks were no faster through NCCL
# (64k, 16 heads: 61.0 ms with one chunk, 64.5 with two, 61.0 with four): the transfers did not
# overlap the kernels. Our reading, not measured: NCCL's kernels find no free SM while the persistent
# attention kernels hold every SM. The ``shared`` transport (shared.py) moves data on copy engines
# instead; ``DASH_FA3_CP_CHUNKS`` sets the count for it (and for p2p), the same on every rank.
CHUNKS = 1
CHUNKS_ENV = "DASH_FA3_CP_CHUNKS"


def default_chunks() -> int:
    """``DASH_FA3_CP_CHUNKS`` if set (a positive integer), else :data:`CHUNKS`."""
    text = os.environ.get(CHUNKS_ENV)
    if text is None:
        return CHUNKS
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{CHUNKS_ENV}={text!r}: a positive integer is needed")
    return n


class _Exchange:
    """One batch of point-to-point messages: (peer, tensor) sends and receives, posted together and
    waited for together (bounded on gloo: :func:`~.runtime.wait_works`)."""

    def __init__(self, group, rank: int, what: str, device):
        self.group, self.rank, self.what, self.device = group, rank, what, device
        self.sends: list[tuple[int, torch.Tensor]] = []
        self.recvs: list[tuple[int, torch.Tensor]] = []
        self.works = []

    def send(self, peer: int, x: torch.Tensor) -> None:
        self.sends.append((peer, x.contiguous()))

    def recv_into(self, peer: int, dst: torch.Tensor) -> None:
        self.recvs.append((peer, dst))

    def recv_buffer(self, peer: int, shape, dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self.recvs.append((peer, buf))
        return buf

    def post(self) -> "_Exchange":
        self.works = runtime.post_p2p(self.sends, self.recvs, self.group)
        return self

    def wait(self) -> None:
        peers = [("send to", p) for p, _ in self.sends] + [("receive from", p) for p, _ in self.recvs]
        runtime.wait_works(self.works, peers, self.group, self.rank, self.what)
        self.works = []


class _SharedInputs:
    """The input side of a :class:`~.shared.Pass` in :class:`_Exchange`'s terms."""

    def __init__(self, ps: shared.Pass):
        self.send, self.recv_into = ps.send_input, ps.recv_input


class _SharedResults:
    """The result side of a :class:`~.shared.Pass` in :class:`_Exchange`'s terms."""

    def __init__(self, ps: shared.Pass):
        self.send, self.recv_buffer = ps.send_result, ps.recv_result


def _gather(x, s, hd, p: cp_heads.HeadPlan, rank, heads_of, ex: _Exchange):
    """This rank's heads ``heads_of(rank)`` of x over all tokens, from the token shards: a view of a
    sequence-major buffer whose peer pieces arrive through ``ex`` (x: local shard, sequence dim s,
    head dim hd)."""
    lo, hi = heads_of(rank)
    shape = list(x.shape)
    shape[s], shape[hd] = p.num_blocks * G, hi - lo
    buf = x.new_empty([shape[s]] + [shape[i] for i in range(x.dim()) if i != s])
    for a, b, o in p.local_pieces(rank):
        buf[a * G:b * G].copy_(x.narrow(s, o * G, (b - a) * G).narrow(hd, lo, hi - lo).movedim(s, 0))
    for peer in range(p.num_ranks):
        if peer == rank:
            continue
        plo, phi = heads_of(peer)
        for a, b, o in p.messages(rank, peer):
            ex.send(peer, x.narrow(s, o * G, (b - a) * G).narrow(hd, plo, phi - plo).movedim(s, 0))
        for a, b, _ in p.messages(peer, rank):
            ex.recv_into(peer, buf[a * G:b * G])
    return buf.movedim(0, s)


def _scatter(y, s, hd, p: cp_heads.HeadPlan, rank, heads_of, out, ex: _Exchange):
    """Sends each peer its tokens of y (this rank's heads over all tokens) and posts the receives of
    this rank's tokens of the peers' heads; returns the placements to run once ``ex`` has arrived.
    This rank's own tokens go into ``out`` (the local shard, all heads) at once."""
    lo, hi = heads_of(rank)
    for a, b, o in p.local_pieces(rank):
        out.narrow(s, o * G, (b - a) * G).narrow(hd, lo, hi - lo).copy_(y.narrow(s, a * G, (b - a) * G))
    landing = []
    for peer in range(p.num_ranks):
        if peer == rank:
            continue
        for a, b, _ in p.messages(peer, rank):
            ex.send(peer, y.narrow(s, a * G, (b - a) * G).movedim(s, 0))
        plo, phi = heads_of(peer)
        for a, b, o in p.messages(rank, peer):
            shape = list(out.shape)
            shape[s], shape[hd] = (b - a) * G, phi - plo
            buf = ex.recv_buffer(peer, [shape[s]] + [shape[i] for i in range(out.dim()) if i != s], out.dtype)
            landing.append((out.narrow(s, o * G, (b - a) * G).narrow(hd, plo, phi - plo), buf.movedim(0, s)))
    return landing


def _fwd_compute(q, k, v, softmax_scale, causal):
    if q.device.type == "cuda":
        return ops.fwd(q, k, v, softmax_scale, causal, 0)
    outs, lses = [], []
    g = q.shape[2] // k.shape[2]
    for h in range(k.shape[2]):       # one KV group per call: the same shapes for every P
        o, lse = reference.attention_ref(q[:, :, h * g:(h + 1) * g], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                         softmax_scale, causal, block_size=CPU_BLOCK)
        outs.append(o.to(q.dtype))
        lses.append(lse.float())
    return torch.cat(outs, 2), torch.cat(lses, 1)


def _bwd_compute(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, heads, heads_kv, kv_lo):
    """Gradients of KV heads [kv_lo, kv_lo + k.shape[2]) of a problem with heads / heads_kv heads."""
    if q.device.type == "cuda":
        return ops.bwd_heads_part(dout, q, k, v, out, lse.contiguous(), softmax_scale, causal, deterministic,
                                  heads, heads_kv, kv_lo)
    dqs, dks, dvs = [], [], []
    g = q.shape[2] // k.shape[2]
    for h in range(k.shape[2]):
        sl = slice(h * g, (h + 1) * g)
        dq, dk, dv = reference.attention_bwd_ref(dout[:, :, sl], q[:, :, sl], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                                 out[:, :, sl], softmax_scale, causal, block_size=CPU_BLOCK)
        dqs.append(dq.to(q.dtype))
        dks.append(dk.to(k.dtype))
        dvs.append(dv.to(v.dtype))
    return torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2)


def _heads_fn(p, c, per_q):
    return (lambda r: p.q_heads(c, r)) if per_q else (lambda r: p.kv_heads(c, r))


def _run(p, rank, group, inputs, compute, outputs, what):
    """The chunk pipeline of one pass. ``inputs``: [(local tensor, seq dim, head dim, per query
    head)]; ``compute(chunk, *gathered)`` -> results; ``outputs``: [(local result tensor, seq dim, head
    dim, per query head)] filled in place."""
    device = inputs[0][0].device
    if shared.transport(group, device) == "shared" and p.num_ranks > 1:   # the name is checked at every P
        return _run_shared(p, rank, group, inputs, compute, outputs, what)

    def post_inputs(c):
        ex = _Exchange(group, rank, f"{what} inputs, chunk {c}", device)
        views = [_gather(x, s, hd, p, rank, _heads_fn(p, c, pq), ex) for x, s, hd, pq in inputs]
        return ex.post(), views

    pending = [post_inputs(0)]
    results = []
    for c in range(len(p.chunks)):
        if c + 1 < len(p.chunks):
            pending.append(post_inputs(c + 1))
        ex_in, views = pending[c]
        ex_in.wait()
        ys = compute(c, *views)
        ex_out = _Exchange(group, rank, f"{what} results, chunk {c}", device)
        landing = []
        for y, (out, s, hd, pq) in zip(ys, outputs):
            landing += _scatter(y, s, hd, p, rank, _heads_fn(p, c, pq), out, ex_out)
        results.append((ex_out.post(), landing))
    for ex_out, landing in results:
        ex_out.wait()
        for dst, src in landing:
            dst.copy_(src)


class _Sizes:
    """An exchange that only counts the bytes each peer is sent, each message aligned as the shared
    transport lays it out (for :func:`slot_bytes`)."""

    def __init__(self):
        self.sent: dict[int, int] = {}

    def send(self, peer: int, x: torch.Tensor) -> None:
        self.sent[peer] = self.sent.get(peer, 0) + shared.message_bytes(x.shape, x.dtype)

    def recv_into(self, peer: int, dst: torch.Tensor) -> None:
        pass

    def recv_buffer(self, peer: int, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")


def slot_bytes(p: cp_heads.HeadPlan, inputs, outputs) -> int:
    """The most bytes one rank sends another in either exchange of a pass (all chunks): its slot.
    Counted by running the pass's own :func:`_gather` and :func:`_scatter` for every rank on meta
    tensors of the local shapes, so the messages are sized where they are made. The same on every
    rank, since every rank's local tensors have the same shapes."""
    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    most = 0
    for r in range(p.num_ranks):
        sent_in, sent_out = _Sizes(), _Sizes()
        for c in range(len(p.chunks)):
            for x, s, hd, pq in inputs:
                _gather(meta(x.shape, x.dtype), s, hd, p, r, _heads_fn(p, c, pq), sent_in)
            for o, s, hd, pq in outputs:
                lo, hi = _heads_fn(p, c, pq)(r)
                shape = list(o.shape)
                shape[s], shape[hd] = p.num_blocks * G, hi - lo
                _scatter(meta(shape, o.dtype), s, hd, p, r, _heads_fn(p, c, pq), meta(o.shape, o.dtype), sent_out)
        most = max([most, *sent_in.sent.values(), *sent_out.sent.values()])
    return most


def _run_shared(p, rank, group, inputs, compute, outputs, what):
    """:func:`_run` through the shared transport (shared.py): every chunk's inputs are packed and
    pulled up front, each chunk computes once its pulls are done, and its results are pushed while
    the next chunk computes."""
    ps = shared.Pass(group, rank, p.num_ranks, slot_bytes(p, inputs, outputs), inputs[0][0].device, what)
    side_in, side_out = _SharedInputs(ps), _SharedResults(ps)
    views, pulls = [], []
    for c in range(len(p.chunks)):
        views.append([_gather(x, s, hd, p, rank, _heads_fn(p, c, pq), side_in) for x, s, hd, pq in inputs])
        pulls.append(ps.registered())
    ps.publish()
    arrived = [ps.pull(chunk_pulls) for chunk_pulls in pulls]
    landing = []
    for c in range(len(p.chunks)):
        ps.ready(arrived[c])
        ys = compute(c, *views[c])
        for y, (out, s, hd, pq) in zip(ys, outputs):
            landing += _scatter(y, s, hd, p, rank, _heads_fn(p, c, pq), out, side_out)
        ps.push()
    ps.finish()
    for dst, src in landing:
        dst.copy_(src)


SAVED_PER_CHUNK = 5   # q, k, v, out, lse of the chunk's heads over the whole sequence


def saved_shapes(q_shape, heads_kv: int, p: cp_heads.HeadPlan, rank: int) -> list[tuple[int, ...]]:
    """Shapes of :func:`forward`'s saved tensors on ``rank`` (for the custom op's fake)."""
    b, _, _, d = q_shape
    N = p.num_blocks * G
    out = []
    for c in range(len(p.chunks)):
        qlo, qhi = p.q_heads(c, rank)
        klo, khi = p.kv_heads(c, rank)
        out += [(b, N, qhi - qlo, d), (b, N, khi - klo, d), (b, N, khi - klo, d), (b, N, qhi - qlo, d),
                (b, qhi - qlo, N)]
    return out


def plan_of(q_shape, heads_kv: int, group, layout: str, chunks: int | None = None) -> cp_heads.HeadPlan:
    P = dist.get_world_size(group)
    b, n, h, _ = q_shape
    return cp_heads.plan(P, n * P, h, heads_kv, layout, chunks or default_chunks())


def forward(q, k, v, *, group, causal: bool, layout: str, softmax_scale: float, chunks: int | None = None):
    """This rank's (out (b, n, h, d), lse (b, h, n) fp32) for local shards q, k, v, and what the
    backward needs: per chunk, its heads' q, k, v, out and lse over the whole sequence (so the
    backward moves only dO in and the gradients out)."""
    runtime.ensure_communicator(group, q.device)
    rank = dist.get_rank(group)
    b, n, h, d = q.shape
    p = plan_of(q.shape, k.shape[2], group, layout, chunks)
    out = q.new_empty((b, n, h, d))
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    saved = []

    def compute(c, qf, kf, vf):
        of, lf = _fwd_compute(qf, kf, vf, softmax_scale, causal)
        saved.extend((qf, kf, vf, of, lf))
        return of, lf

    _run(p, rank, group, [(q, 1, 2, True), (k, 1, 2, False), (v, 1, 2, False)], compute,
         [(out, 1, 2, True), (lse, 2, 1, True)], "forward")
    return out, lse, saved


def backward(dout, saved, *, heads_kv: int, group, causal: bool, layout: str, softmax_scale: float,
             deterministic: bool, chunks: int | None = None):
    """This rank's (dq, dk, dv) for its local dO and :func:`forward`'s saved tensors."""
    runtime.ensure_communicator(group, dout.device)
    rank = dist.get_rank(group)
    b, n, h, d = dout.shape
    # the forward's chunk count, whatever DASH_FA3_CP_CHUNKS says now
    p = plan_of(dout.shape, heads_kv, group, layout, chunks or len(saved) // SAVED_PER_CHUNK)
    if len(saved) != SAVED_PER_CHUNK * len(p.chunks):
        raise ValueError(f"the backward got {len(saved)} saved tensors for {len(p.chunks)} chunks")
    dq = torch.empty_like(dout)
    dk = dout.new_empty((b, n, heads_kv, d))
    dv = dout.new_empty((b, n, heads_kv, d))

    def compute(c, dof):
        qf, kf, vf, of, lf = saved[SAVED_PER_CHUNK * c:SAVED_PER_CHUNK * (c + 1)]
        return _bwd_compute(dof, qf, kf, vf, of, lf, softmax_scale, causal, deterministic, h, heads_kv,
                            p.kv_heads(c, rank)[0])

    _run(p, rank, group, [(dout, 1, 2, True)], compute,
         [(dq, 1, 2, True), (dk, 1, 2, False), (dv, 1, 2, False)], "backward")
    return dq, dk, dv
