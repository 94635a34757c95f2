"""Head-parallel context parallelism (``algorithm="heads"``): each rank computes whole heads over the
whole sequence. The plan as data, its validation, its cost model and its runtime.

The sequence arrives sharded by tokens (``layout.shard``). This algorithm turns that into a
sharding by heads: rank r takes KV heads [r*Hk//P, (r+1)*Hk//P) and their query heads (so Hk >= P),
receives every other rank's tokens of those heads, runs the single-GPU kernels (on CPU, the
reference, one KV group at a time) on the whole sequence, and sends each peer its tokens of the
result. A head's attention is then one single-GPU computation whatever P and the layout: output,
LSE and gradients are bitwise ``flash_attn_func``'s on one GPU, in both modes (the deterministic one
with its default schedule), provided a head's result does not depend on how many heads share the
call. The forward computes each (head, query tile) in one CTA; the deterministic backward runs the
whole problem's schedule restricted to the rank's heads (``ops.bwd_heads_part``), because the shift
orders place a head's units by its index among all heads (tests/test_schedule_cp_heads.py); GQA's
dK/dV sum a group's heads in head order, and a group is never split.

The forward's gathered q, k, v, out and lse are what autograd keeps, so the backward moves only dO
in and dQ, dK, dV out. A rank's heads can be cut into chunks (:func:`default_chunks`) that form a
pipeline: chunk c+1's inputs travel while chunk c computes, and chunk c's results travel back while
chunk c+1 computes. Messages go through the group's transport (``transport.py``): ``p2p`` posts
every rank's batches in the same sequence (inputs 0, inputs 1, results 0, inputs 2, results 1,
...), each pairing with its peers' batch of the same position; ``shared`` packs all inputs, pulls
them per chunk and pushes results (``shared.py``). The bits are the same either way. Gathered
tensors are stored sequence-major ((tokens, ...), the remaining dimensions in order), so that a
peer's piece of tokens is one contiguous region its message fills in place; the kernels read them
through strided views.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist

from .. import ops, reference
from . import comm, shared
from . import transport as tr
from .layout import G, block_runs, check_layout, check_seqlen, local_blocks
from .model import CPCostModel, Estimate


# The CPU compute's block edge: fixed, so a head's arithmetic does not depend on the call's shape.
CPU_BLOCK = 128


# Chunks of each rank's heads in the transfer/compute pipeline (at most the smallest rank's KV-head
# count). One by default: through NCCL more chunks were no faster (docs/journal/results.md), the
# transfers not overlapping the persistent kernels. ``DASH_FA3_CP_CHUNKS`` sets the count, the same
# on every rank.
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


# Token-sharded tensors per pass that travel to the head owners, and results that travel back:
# (name, per query head (True) or per KV head (False)); the LSE is fp32 per token and head.
FWD_IN = (("q", True), ("k", False), ("v", False))
FWD_OUT = (("out", True), ("lse", True))
BWD_IN = (("dout", True),)        # the rest (q, k, v, out, lse of the rank's heads) is the forward's
BWD_OUT = (("dq", True), ("dk", False), ("dv", False))


def kv_ranges(heads_kv: int, num_ranks: int) -> tuple[tuple[int, int], ...]:
    """KV heads [lo, hi) of each rank."""
    if heads_kv < num_ranks:
        raise ValueError(
            f"head-parallel context parallelism gives each rank whole KV heads (a GQA group is never "
            f"split, so that its dK/dV sum keeps one order): {heads_kv} KV heads cannot be shared by "
            f"{num_ranks} ranks; use a group of at most {heads_kv} ranks, or deterministic=False")
    return tuple((r * heads_kv // num_ranks, (r + 1) * heads_kv // num_ranks) for r in range(num_ranks))


def _split(lo: int, hi: int, parts: int) -> tuple[tuple[int, int], ...]:
    n = hi - lo
    return tuple((lo + c * n // parts, lo + (c + 1) * n // parts) for c in range(parts))


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The head-parallel plan of one shape: per rank its token pieces (global block runs in local
    order) and per chunk its KV heads."""

    num_ranks: int
    num_blocks: int
    heads: int
    heads_kv: int
    layout: str
    pieces: tuple[tuple[tuple[int, int], ...], ...]        # rank -> ((lo, hi) global blocks, ...)
    chunks: tuple[tuple[tuple[int, int], ...], ...]        # chunk -> rank -> (kv lo, kv hi)

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv

    def kv_heads(self, chunk: int, rank: int) -> tuple[int, int]:
        return self.chunks[chunk][rank]

    def q_heads(self, chunk: int, rank: int) -> tuple[int, int]:
        lo, hi = self.chunks[chunk][rank]
        return lo * self.group, hi * self.group

    def items(self) -> list[tuple[int, int, int, int]]:
        """(kv lo, kv hi, rank, step): at step c, rank r computes chunk c's KV heads (and their query
        heads) over the whole sequence."""
        return [(lo, hi, r, c) for c, per in enumerate(self.chunks) for r, (lo, hi) in enumerate(per)]

    def local_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """rank's token pieces as (lo, hi, offset in its local tokens), all in blocks."""
        out, off = [], 0
        for lo, hi in self.pieces[rank]:
            out.append((lo, hi, off))
            off += hi - lo
        return out

    def messages(self, src: int, dst: int) -> list[tuple[int, int, int]]:
        """Token pieces (lo, hi, local offset in src's tokens) that src sends dst per chunk's inputs:
        src's own pieces, in src's local order (dst sends results back over the same pieces)."""
        return self.local_pieces(src) if src != dst else []


@functools.lru_cache(maxsize=256)
def plan(num_ranks: int, seqlen: int, heads: int, heads_kv: int, layout: str, chunks: int = 1) -> HeadPlan:
    """The head-parallel plan (validated; cached per shape, as each call asks for it); refuses
    lengths the layouts cannot split and Hk < P."""
    nb = check_seqlen(seqlen, num_ranks)
    check_layout(layout)
    if heads <= 0 or heads_kv <= 0 or heads % heads_kv:
        raise ValueError(f"heads ({heads}) must be a positive multiple of heads_kv ({heads_kv})")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    ranges = kv_ranges(heads_kv, num_ranks)
    n_chunks = min(chunks, min(hi - lo for lo, hi in ranges))
    per_rank = [_split(lo, hi, n_chunks) for lo, hi in ranges]
    pieces = tuple(tuple(block_runs(local_blocks(layout, num_ranks, nb, r).tolist()))
                   for r in range(num_ranks))
    p = HeadPlan(num_ranks, nb, heads, heads_kv, layout, pieces,
                 tuple(tuple(per_rank[r][c] for r in range(num_ranks)) for c in range(n_chunks)))
    validate(p)
    return p


def validate(p: HeadPlan) -> None:
    """Every KV head computed by exactly one rank at one step; every token block held by exactly
    one rank. Raises ValueError naming what is wrong."""
    seen = {}
    for lo, hi, r, c in p.items():
        if not 0 <= lo < hi <= p.heads_kv:
            raise ValueError(f"chunk {c} of rank {r}: KV heads [{lo}, {hi}) out of range [0, {p.heads_kv})")
        for h in range(lo, hi):
            if h in seen:
                raise ValueError(f"KV head {h} is computed twice (rank {seen[h][0]} step {seen[h][1]} "
                                 f"and rank {r} step {c})")
            seen[h] = (r, c)
    if len(seen) != p.heads_kv:
        raise ValueError(f"KV heads {sorted(set(range(p.heads_kv)) - set(seen))} are computed by no rank")
    owner = {}
    for r, pcs in enumerate(p.pieces):
        for lo, hi in pcs:
            for b in range(lo, hi):
                if b in owner:
                    raise ValueError(f"token block {b} is held by ranks {owner[b]} and {r}")
                owner[b] = r
    if len(owner) != p.num_blocks:
        raise ValueError(f"{p.num_blocks - len(owner)} token blocks are held by no rank")


# beta: what the head-parallel transfers reached on two H200s over NVLink (docs/journal/results.md)
DEFAULT_COST = CPCostModel(beta_gbs=160.0)


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, layout: str = "contiguous", batch: int = 1,
             heads: int = 16, heads_kv: int = 16, headdim: int = 128, chunks: int = 1, elem_bytes: int = 2,
             cost: CPCostModel | None = None, **rates) -> Estimate:
    """Estimate of one forward + backward (α-β messages, concurrent in both directions; kernels at
    the cost model's rates; memory passes at its ``hbm_gbs``). ``cost`` defaults to
    :data:`DEFAULT_COST`; ``rates`` replace its fields (``fwd_tflops=...``).

    Per pass and rank: the first chunk's inputs arrive (exposed), then chunk c computes while chunk
    c+1's inputs and chunk c-1's results travel, and the last chunk's results return (exposed).
    A chunk's transfer time is its larger direction (P-1 peers' pieces, one message per piece and
    tensor). Memory passes: packing what is sent, placing what arrives (read + write each)."""
    cost = (cost or DEFAULT_COST).with_(**rates)
    p = plan(num_ranks, seqlen, heads, heads_kv, layout, chunks)
    n_tok = p.num_blocks * G
    pairs = (p.num_blocks * (p.num_blocks + 1) // 2 if causal else p.num_blocks ** 2) * G * G
    fwd_head = cost.gemm_seconds(4.0 * pairs * headdim * batch, "fwd")       # per query head, seconds
    bwd_head = cost.gemm_seconds(2.5 * 4.0 * pairs * headdim * batch, "bwd")
    local_tok = n_tok // num_ranks

    def nbytes(names, tokens, kvh):
        return sum(tokens * batch * (kvh * p.group if per_q else kvh) * (4 if n == "lse" else headdim * elem_bytes)
                   for n, per_q in names)

    def transfer(names, r, c, back):
        """One chunk's messages of rank r: what it receives and what it sends concurrently (the larger
        direction counts), plus packing and placing them (a read and a write each)."""
        mine = p.kv_heads(c, r)[1] - p.kv_heads(c, r)[0]
        others = sum(p.kv_heads(c, q)[1] - p.kv_heads(c, q)[0] for q in range(num_ranks) if q != r)
        remote = nbytes(names, n_tok - local_tok, mine)       # my heads of the peers' tokens
        own = nbytes(names, local_tok, others)                # the peers' heads of my tokens
        recv, send = (own, remote) if back else (remote, own)
        msgs = len(names) * sum(len(p.pieces[q]) for q in range(num_ranks) if q != r)
        wire = (msgs * cost.alpha_us * 1e-6 + max(recv, send) / (cost.beta_gbs * 1e9)) if num_ranks > 1 else 0.0
        return wire + 2 * (recv + send) / (cost.hbm_gbs * 1e9)

    comp, exposed = [], []
    for r in range(num_ranks):
        total_c, total_e = 0.0, 0.0
        for names_in, names_out, per_head in ((FWD_IN, FWD_OUT, fwd_head), (BWD_IN, BWD_OUT, bwd_head)):
            n_c = len(p.chunks)
            c_times = [(p.kv_heads(c, r)[1] - p.kv_heads(c, r)[0]) * p.group * per_head for c in range(n_c)]
            in_times = [transfer(names_in, r, c, False) for c in range(n_c)]
            out_times = [transfer(names_out, r, c, True) for c in range(n_c)]
            # pipeline: in(0), then per chunk max(compute c, in(c+1) + out(c-1)), then out(last)
            t = in_times[0]
            for c in range(n_c):
                nxt = in_times[c + 1] if c + 1 < n_c else 0.0
                prv = out_times[c - 1] if c > 0 else 0.0
                t += max(c_times[c], nxt + prv)
            t += out_times[-1]
            total_c += sum(c_times)
            total_e += t - sum(c_times)
        comp.append(total_c * 1e3)
        exposed.append(total_e * 1e3)
    single = heads * (fwd_head + bwd_head) * 1e3
    time = max(c + e for c, e in zip(comp, exposed))
    return Estimate("heads", layout, num_ranks, seqlen, bool(causal), tuple(comp), tuple(exposed), time, single)


def _gather(x, s, hd, p: HeadPlan, rank, heads_of, ex: tr.Exchange):
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


def _scatter(y, s, hd, p: HeadPlan, rank, heads_of, out, ex: tr.Exchange):
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
    # One KV group per call (the same shapes for every P), on one thread (the same order of every
    # sum whatever the thread count): the bits depend on the head alone.
    with reference.one_thread():
        for h in range(k.shape[2]):
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
    with reference.one_thread():   # as in _fwd_compute
        for h in range(k.shape[2]):
            sl = slice(h * g, (h + 1) * g)
            dq, dk, dv = reference.attention_bwd_ref(dout[:, :, sl], q[:, :, sl], k[:, :, h:h + 1],
                                                     v[:, :, h:h + 1], out[:, :, sl], softmax_scale, causal,
                                                     block_size=CPU_BLOCK)
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
    if tr.choose(group, device) == "shared" and p.num_ranks > 1:   # the name is checked at every P
        return _run_shared(p, rank, group, inputs, compute, outputs, what)

    def post_inputs(c):
        ex = tr.P2PExchange(group, rank, f"{what} inputs, chunk {c}", device)
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
        ex_out = tr.P2PExchange(group, rank, f"{what} results, chunk {c}", device)
        landing = []
        for y, (out, s, hd, pq) in zip(ys, outputs):
            landing += _scatter(y, s, hd, p, rank, _heads_fn(p, c, pq), out, ex_out)
        results.append((ex_out.post(), landing))
    for ex_out, landing in results:
        ex_out.wait()
        for dst, src in landing:
            dst.copy_(src)


class _Sizes(tr.Exchange):
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


def slot_bytes(p: HeadPlan, inputs, outputs) -> int:
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
    side_in, side_out = ps.inputs(), ps.results()
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


def saved_shapes(q_shape, heads_kv: int, p: HeadPlan, rank: int) -> list[tuple[int, ...]]:
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


def plan_of(q_shape, heads_kv: int, group, layout: str, chunks: int | None = None) -> HeadPlan:
    P = dist.get_world_size(group)
    b, n, h, _ = q_shape
    return plan(P, n * P, h, heads_kv, layout, chunks or default_chunks())


def forward(q, k, v, *, group, causal: bool, layout: str, softmax_scale: float, chunks: int | None = None):
    """This rank's (out (b, n, h, d), lse (b, h, n) fp32) for local shards q, k, v, and what the
    backward needs: per chunk, its heads' q, k, v, out and lse over the whole sequence (so the
    backward moves only dO in and the gradients out)."""
    comm.ensure_communicator(group, q.device)
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
    comm.ensure_communicator(group, dout.device)
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
