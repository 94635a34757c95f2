"""DistFlashAttn's run plan (``algorithm="runs"``, the non-deterministic mode's default on CPU and
wherever heads_kv < P): the plan as data, its validation, its cost model and its runtime.

The fold schedules (``folds/``) advance a query block's softmax state tile by tile across steps,
which needs kernels that take and return fp32 fold state. The kernels we have take whole problems,
so this algorithm cuts the work differently: each rank computes a few **runs** of consecutive query
blocks, each run in one kernel call against the key prefix that run needs (causal: keys [0, run
end), the kernel's bottom-right alignment putting the diagonal where it belongs; full: every key).
A query row is then computed by exactly one call, with the same key tiles in the same order as on
one GPU, so the forward's output and LSE are bitwise those of a single-GPU call whatever the number
of ranks. The backward call of a run gives that run's complete dQ and a partial dK/dV over the run's
key prefix; the partials of each key block are summed by its owner in fp32, in ascending (rank, run)
order (within rounding of one GPU, not bitwise).

Runs (:func:`plan`): causal attention on the contiguous layout splits the query blocks into P runs of
equal work (a block's work is its count of key tiles), run r on rank r; run r then starts inside or
after rank r's own chunk, and the rows it takes from rank r+1 are DistFlashAttn's helper-worker
balance at run granularity. The zigzag layout (and full attention on either) computes each rank's
own blocks, which is balanced already. Every run is split where its key prefix stops being local,
so a rank computes what it holds while the rest arrives.

Runtime (:func:`forward`, :func:`backward`): one p2p exchange of inputs and one of results per pass
(``transport.P2PExchange``: NCCL on its own stream, ordered by ``Work.wait()``, no host
synchronisation; gloo on CPU, each wait bounded by the group's timeout), the single-GPU ops per run
(on CPU their reference). Gathered keys and values are stored sequence-major, (tokens, batch,
heads, headdim), so that the rows of one block range are one contiguous piece that a message fills
in place; the kernels read them through a (batch, tokens, heads, headdim) view.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache, wraps

import numpy as np
import torch
import torch.distributed as dist

from .. import ops
from . import comm
from . import transport as tr
from .layout import G, block_owners, block_runs, check_seqlen, local_blocks
from .model import CPCostModel, Estimate

__all__ = ["RunPlan", "plan", "validate", "simulate", "forward", "backward"]


def _memo(method):
    """Cache a RunPlan method's result per arguments on the plan: plans are cached per shape
    (``plan``), so the runtime's per-call lookups cost one dict hit, not a walk over the blocks.
    The results are shared between callers: read them, do not modify them."""
    @wraps(method)
    def cached(self, *args):
        key = (method.__name__, *args)
        memo = self._memo_table
        if key not in memo:
            memo[key] = method(self, *args)
        return memo[key]
    return cached


@dataclass(frozen=True)
class RunPlan:
    num_ranks: int
    num_blocks: int
    causal: bool
    layout: str
    owner: tuple[int, ...]                          # block -> owning rank
    runs: tuple[tuple[tuple[int, int], ...], ...]   # per rank: query-block runs [lo, hi), in call order

    @cached_property
    def _memo_table(self) -> dict:
        return {}

    def kv_end(self, lo: int, hi: int) -> int:
        """Key blocks [0, kv_end) a run's call reads."""
        return hi if self.causal else self.num_blocks

    @_memo
    def kv_need(self, rank: int) -> int:
        """Key blocks [0, kv_need) this rank gathers (the longest prefix of its runs)."""
        return max((self.kv_end(lo, hi) for lo, hi in self.runs[rank]), default=0)

    @_memo
    def local(self, rank: int) -> tuple[int, ...]:
        return tuple(b for b in range(self.num_blocks) if self.owner[b] == rank)

    @_memo
    def run_is_local(self, rank: int, lo: int, hi: int) -> bool:
        """Whether the run's rows and key prefix are all this rank's own blocks."""
        return all(self.owner[b] == rank for b in range(0, max(hi, self.kv_end(lo, hi))))

    @_memo
    def rows_from(self, rank: int, peer: int) -> list[tuple[int, int]]:
        """Query-row block runs that ``rank`` computes and ``peer`` owns (peer sends their inputs,
        rank sends back their results)."""
        blocks = [b for lo, hi in self.runs[rank] for b in range(lo, hi) if self.owner[b] == peer]
        return block_runs(sorted(blocks))

    @_memo
    def kv_from(self, rank: int, peer: int) -> list[tuple[int, int]]:
        """Key blocks ``rank`` needs from ``peer`` (and, in the backward, returns partials of)."""
        return block_runs([b for b in range(self.kv_need(rank)) if self.owner[b] == peer])

    @_memo
    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Query blocks [lo, hi) cut by owner: (piece lo, piece hi, owner) in order."""
        out: list[list[int]] = []
        for b in range(lo, hi):
            if out and out[-1][2] == self.owner[b]:
                out[-1][1] = b + 1
            else:
                out.append([b, b + 1, self.owner[b]])
        return [(a, b_, o) for a, b_, o in out]

    @_memo
    def tiles(self, rank: int) -> int:
        """G x G tiles this rank's calls cover (a causal diagonal tile counts one)."""
        return sum(self.kv_end(b, b + 1) for lo, hi in self.runs[rank] for b in range(lo, hi))


def _equal_work_cuts(num_blocks: int, parts: int) -> list[int]:
    """Block boundaries splitting causal query blocks into ``parts`` runs of near-equal tile count."""
    work = np.cumsum(np.arange(1, num_blocks + 1, dtype=np.float64))  # work[b] = tiles of blocks 0..b
    total = work[-1]
    cuts = [0]
    for r in range(1, parts):
        b = int(np.searchsorted(work, total * r / parts))   # first b with work[b] >= target
        # work of blocks [0, cut) is work[cut - 1]: take the cut nearer to the target
        lo_cut, hi_cut = b, b + 1
        target = total * r / parts
        below = work[lo_cut - 1] if lo_cut > 0 else 0.0
        cut = lo_cut if abs(below - target) <= abs(work[b] - target) else hi_cut
        cuts.append(min(max(cut, cuts[-1] + 1), num_blocks - (parts - r)))
    cuts.append(num_blocks)
    return cuts


def _split_local(runs, owner, rank, causal, num_blocks):
    """Split each run where its key prefix stops being this rank's own: the part before needs no
    remote data and goes first."""
    first_remote = next((b for b in range(num_blocks) if owner[b] != rank), num_blocks)
    local, remote = [], []
    for lo, hi in runs:
        if causal and lo < first_remote:   # blocks below first_remote are all this rank's
            cut = min(hi, first_remote)
            local.append((lo, cut))
            if cut < hi:
                remote.append((cut, hi))
        elif not causal and first_remote == num_blocks:
            local.append((lo, hi))
        else:
            remote.append((lo, hi))
    return tuple(local + remote)


@lru_cache(maxsize=256)
def plan(num_ranks: int, seqlen: int, causal: bool, layout: str) -> RunPlan:
    """The run plan for a global sequence of ``seqlen`` tokens over ``num_ranks`` ranks."""
    nb = check_seqlen(seqlen, num_ranks)
    owner = tuple(int(x) for x in block_owners(layout, num_ranks, nb))
    if causal and layout == "contiguous":
        cuts = _equal_work_cuts(nb, num_ranks)
        runs = [[(cuts[r], cuts[r + 1])] for r in range(num_ranks)]
    else:
        runs = [block_runs(local_blocks(layout, num_ranks, nb, r).tolist()) for r in range(num_ranks)]
    runs = tuple(_split_local(rs, owner, r, causal, nb) for r, rs in enumerate(runs))
    p = RunPlan(num_ranks, nb, bool(causal), layout, owner, runs)
    validate(p)
    return p


def validate(p: RunPlan) -> None:
    """Every query block in exactly one run; runs non-empty and inside the sequence. ValueError."""
    seen = np.zeros(p.num_blocks, dtype=np.int64)
    for r, runs in enumerate(p.runs):
        for lo, hi in runs:
            if not 0 <= lo < hi <= p.num_blocks:
                raise ValueError(f"rank {r}: run [{lo}, {hi}) is empty or outside blocks [0, {p.num_blocks})")
            seen[lo:hi] += 1
    bad = np.flatnonzero(seen != 1)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"query block {b} is computed {int(seen[b])} times (must be once)")
    if len(p.owner) != p.num_blocks or any(not 0 <= o < p.num_ranks for o in p.owner):
        raise ValueError("owner table does not match the plan's blocks and ranks")


# the per-call overhead of the single-GPU kernels on the run plan
DEFAULT_COST = CPCostModel(launch_us=20.0)


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, layout: str = "contiguous", batch: int = 1,
             heads: int = 16, heads_kv: int = 16, headdim: int = 128, cost: CPCostModel | None = None,
             **rates) -> Estimate:
    """Estimate of one forward + backward on the run plan (the non-deterministic mode).

    ``cost`` defaults to :data:`DEFAULT_COST`; ``rates`` replace its fields (``fwd_tflops=...``).
    Per rank: kernel time from its tile count at the kernels' rates (``fwd_tflops``; the backward's
    2.5x the forward's FLOPs at ``bwd_tflops``); the wait for remote inputs before its first remote
    run, less the compute of its local runs (α + bytes/β, sends and receives concurrent); after its
    last call, the results and dK/dV partials exchange (the larger direction); and the
    runtime's own memory passes at ``hbm_gbs``: sequence-major copies of K and V, output and dQ
    placement, the fp32 dK/dV sums (zeroing, one read-add-write per partial, the final cast)."""
    cost = (cost or DEFAULT_COST).with_(**rates)
    p = plan(num_ranks, seqlen, causal, layout)
    tile_flops = 4.0 * G * G * headdim * heads * batch          # QK^T and PV of one tile
    row = batch * G * headdim * 2                               # bytes of one block of one head
    t_fwd = cost.gemm_seconds(tile_flops, "fwd")
    t_bwd = cost.gemm_seconds(2.5 * tile_flops, "bwd")
    n_local = p.num_blocks // num_ranks

    msg = cost.message_seconds

    comp, exposed = [], []
    for r in range(num_ranks):
        peers = [q for q in range(num_ranks) if q != r]
        calls = len(p.runs[r])
        c = p.tiles(r) * (t_fwd + t_bwd) + 2 * calls * cost.launch_us * 1e-6
        local = sum(p.kv_end(b, b + 1) for lo, hi in p.runs[r] for b in range(lo, hi) if p.run_is_local(r, lo, hi))
        kv_in = sum(hi - lo for q in peers for lo, hi in p.kv_from(r, q))
        kv_out = sum(hi - lo for q in peers for lo, hi in p.kv_from(q, r))
        rows_in = sum(hi - lo for q in peers for lo, hi in p.rows_from(r, q))     # rows I compute for others
        rows_out = sum(hi - lo for q in peers for lo, hi in p.rows_from(q, r))    # my rows others compute
        kv_bytes, q_bytes = 2 * heads_kv * row, heads * row
        fwd_in = msg(max(kv_in * kv_bytes + rows_in * q_bytes, kv_out * kv_bytes + rows_out * q_bytes))
        bwd_in = msg(max(kv_in * kv_bytes + rows_in * 3 * q_bytes, kv_out * kv_bytes + rows_out * 3 * q_bytes))
        exposed_in = max(0.0, fwd_in - local * t_fwd) + max(0.0, bwd_in - local * t_bwd)
        fwd_out = msg(max(rows_in, rows_out) * q_bytes)
        parts = calls * kv_in       # upper bound: every run's prefix covers the peers' key blocks
        bwd_out = msg(max(rows_in * q_bytes + parts * kv_bytes, rows_out * q_bytes + kv_out * kv_bytes))
        # memory passes, in bytes: K/V sequence-major copies (both passes), out/LSE and dQ placement,
        # dK/dV: zeroed fp32, per partial read bf16 + read/write fp32, final fp32 read + bf16 write
        own_kv = n_local * kv_bytes
        partials = 1 + (num_ranks - 1)
        passes = (2 * 2 * own_kv + 2 * 2 * n_local * q_bytes
                  + own_kv * (2 + partials * 5 + 3))
        mem = passes / (cost.hbm_gbs * 1e9)
        comp.append(c * 1e3)
        exposed.append((exposed_in + fwd_out + bwd_out + mem) * 1e3)
    nb = p.num_blocks
    all_tiles = nb * (nb + 1) // 2 if causal else nb * nb
    single = all_tiles * (t_fwd + t_bwd) * 1e3
    time = max(c + m for c, m in zip(comp, exposed))
    return Estimate("runs", layout, num_ranks, seqlen, bool(causal), tuple(comp), tuple(exposed), time, single)


# ------------------------------------------------------------------------------------------ runtime

def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """(batch, n, ...) -> contiguous (n, batch, ...): a view when batch is 1, else a copy."""
    return x.transpose(0, 1).contiguous()


def _bshd(x_sm: torch.Tensor) -> torch.Tensor:
    """A sequence-major (n, batch, ...) tensor as a (batch, n, ...) view."""
    return x_sm.transpose(0, 1)


class _Blocks:
    """Global-position block ranges of one rank's local (batch, n, ...) tensors."""

    def __init__(self, p: RunPlan, rank: int):
        self.index = {b: i for i, b in enumerate(p.local(rank))}

    def rows(self, lo: int, hi: int) -> slice:
        """Local token slice of global blocks [lo, hi) (consecutive locally too: runs of own blocks)."""
        i = self.index[lo]
        assert self.index[hi - 1] == i + hi - lo - 1
        return slice(i * G, (i + hi - lo) * G)


def _gather_kv(p, rank, mine, k, v, ex: tr.Exchange):
    """Sequence-major key/value prefixes [0, kv_need) with own blocks copied in: (kg, vg); the
    messages that fill in the other ranks' blocks go to ``ex``."""
    P = p.num_ranks
    need = p.kv_need(rank)
    b, _, hk, d = k.shape
    kg = k.new_empty((need * G, b, hk, d))
    vg = v.new_empty((need * G, b, hk, d))
    for lo, hi in p.kv_from(rank, rank):
        sl = mine.rows(lo, hi)
        kg[lo * G:hi * G].copy_(k[:, sl].transpose(0, 1))
        vg[lo * G:hi * G].copy_(v[:, sl].transpose(0, 1))
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.kv_from(peer, rank):        # what peer needs of mine
            sl = mine.rows(lo, hi)
            ex.send(peer, _seq_major(k[:, sl]))
            ex.send(peer, _seq_major(v[:, sl]))
        for lo, hi in p.kv_from(rank, peer):
            ex.recv_into(peer, kg[lo * G:hi * G])
            ex.recv_into(peer, vg[lo * G:hi * G])
    return kg, vg


def _gather_rows(p, rank, mine, tensors, ex: tr.Exchange):
    """Row inputs of the runs this rank computes for others: per peer, per block run, each tensor
    of ``tensors`` (name -> (local tensor, seq_dim)), through ``ex``; returns {(lo, hi): {name:
    received tensor}}."""
    P = p.num_ranks
    received = {}
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(peer, rank):      # rows peer computes that I own: send inputs
            sl = mine.rows(lo, hi)
            for name, (t, dim) in tensors.items():
                ex.send(peer, t.narrow(dim, sl.start, sl.stop - sl.start))
        for lo, hi in p.rows_from(rank, peer):      # rows I compute that peer owns: receive inputs
            got = {}
            for name, (t, dim) in tensors.items():
                shape = list(t.shape)
                shape[dim] = (hi - lo) * G
                got[name] = ex.recv_buffer(peer, shape, t.dtype)
            received[(lo, hi)] = got
    return received


def _runs_in_order(p, rank, ex: tr.P2PExchange):
    """This rank's runs as (lo, hi, key prefix in tokens), waiting for the posted receives before
    the first run that needs remote data (and after the last run, so the receives are done)."""
    waited = False
    for lo, hi in p.runs[rank]:
        if not waited and not p.run_is_local(rank, lo, hi):
            ex.wait()
            waited = True
        yield lo, hi, p.kv_end(lo, hi) * G
    if not waited:
        ex.wait()


def _foreign_buffers(p, rank, make):
    """Result buffers for the rows this rank computes for each peer, one per ``rows_from`` range
    (the same ranges the peer posts its receives for): {(peer, lo, hi): make(lo, hi)}."""
    return {(peer, lo, hi): make(lo, hi)
            for peer in range(p.num_ranks) if peer != rank for lo, hi in p.rows_from(rank, peer)}


def _store_foreign(bufs, a, b_, owner, values, dims):
    """Copy the rows of blocks [a, b_) (owner's) into the buffer whose range holds them."""
    for (peer, lo, hi), dst in bufs.items():
        if peer == owner and lo <= a and b_ <= hi:
            for t_dst, t_src, dim in zip(dst, values, dims):
                t_dst.narrow(dim, (a - lo) * G, (b_ - a) * G).copy_(t_src)
            return
    raise AssertionError(f"no result buffer for rows [{a}, {b_}) of rank {owner}")


def _run_input(t_local, dim, mine, received, p, rank, lo, hi, name):
    """A run's rows of one input, assembled from own rows and received ones (a view when the run
    is one own piece)."""
    parts = []
    for a, b_, o in p.pieces(lo, hi):
        if o == rank:
            sl = mine.rows(a, b_)
            parts.append(t_local.narrow(dim, sl.start, sl.stop - sl.start))
        else:
            for (rlo, rhi), got in received.items():
                if rlo <= a and b_ <= rhi:
                    parts.append(got[name].narrow(dim, (a - rlo) * G, (b_ - a) * G))
                    break
            else:
                raise AssertionError(f"rows [{a}, {b_}) of run [{lo}, {hi}) were not received")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _sum_partials(contributions, mine, dk, dv) -> None:
    """dk, dv of this rank's key blocks: each block's partials summed in fp32 in (rank, run)
    order, then cast once. Cut into segments covered by the same partials, so a block with one
    partial is a plain copy and the others take one fp32 pass per partial (no zeroed buffer)."""
    contributions = sorted(contributions, key=lambda c: c[:3])
    cuts = sorted({x for c in contributions for x in c[2:4]})
    covered = 0
    for lo, hi in zip(cuts, cuts[1:]):
        parts = [(c[4].narrow(1, (lo - c[2]) * G, (hi - lo) * G), c[5].narrow(1, (lo - c[2]) * G, (hi - lo) * G))
                 for c in contributions if c[2] <= lo and hi <= c[3]]
        if not parts:
            continue
        sl = mine.rows(lo, hi)
        covered += hi - lo
        for j, dst in enumerate((dk, dv)):
            if len(parts) == 1:
                dst[:, sl] = parts[0][j]
                continue
            acc = parts[0][j].float()
            for part in parts[1:]:
                acc += part[j]
            dst[:, sl] = acc
    # every key block is in its own rank's prefix, so each gets at least one partial
    assert covered == len(mine.index), f"dK/dV of {len(mine.index) - covered} key blocks got no partial"


def forward(q, k, v, *, group, causal: bool, layout: str, softmax_scale: float):
    """This rank's (out (b, n, h, d), lse (b, h, n) fp32) for local shards q, k, v."""
    comm.ensure_communicator(group, q.device)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    p = plan(P, n * P, bool(causal), layout)
    mine = _Blocks(p, rank)
    ex = tr.P2PExchange(group, rank, "forward inputs", q.device)
    kg, vg = _gather_kv(p, rank, mine, k, v, ex)
    received = _gather_rows(p, rank, mine, {"q": (q, 1)}, ex)
    ex.post()
    out = q.new_empty((b, n, h, d))
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    results = _foreign_buffers(p, rank, lambda lo, hi: (
        q.new_empty((b, (hi - lo) * G, h, d)),
        torch.empty((b, h, (hi - lo) * G), dtype=torch.float32, device=q.device)))
    for lo, hi, e in _runs_in_order(p, rank, ex):
        q_run = _run_input(q, 1, mine, received, p, rank, lo, hi, "q")
        o_run, l_run = ops.fwd(q_run, _bshd(kg[:e]), _bshd(vg[:e]), softmax_scale, causal, 0)
        for a, b_, o in p.pieces(lo, hi):
            rows = slice((a - lo) * G, (b_ - lo) * G)
            if o == rank:
                sl = mine.rows(a, b_)
                out[:, sl] = o_run[:, rows]
                lse[:, :, sl] = l_run[:, :, rows]
            else:
                _store_foreign(results, a, b_, o, (o_run[:, rows], l_run[:, :, rows]), (1, 2))
    # results back to their owners
    ex = tr.P2PExchange(group, rank, "forward results", q.device)
    landing = []
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(rank, peer):
            for t in results[(peer, lo, hi)]:
                ex.send(peer, t)
        for lo, hi in p.rows_from(peer, rank):
            o_buf = ex.recv_buffer(peer, (b, (hi - lo) * G, h, d), q.dtype)
            l_buf = ex.recv_buffer(peer, (b, h, (hi - lo) * G), torch.float32)
            landing.append((lo, hi, o_buf, l_buf))
    ex.post().wait()
    for lo, hi, o_buf, l_buf in landing:
        sl = mine.rows(lo, hi)
        out[:, sl] = o_buf
        lse[:, :, sl] = l_buf
    return out, lse


def backward(dout, q, k, v, out, lse, *, group, causal: bool, layout: str, softmax_scale: float):
    """This rank's (dq, dk, dv) for local shards (non-deterministic mode)."""
    comm.ensure_communicator(group, q.device)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    hk = k.shape[2]
    p = plan(P, n * P, bool(causal), layout)
    mine = _Blocks(p, rank)
    ex = tr.P2PExchange(group, rank, "backward inputs", q.device)
    kg, vg = _gather_kv(p, rank, mine, k, v, ex)
    rows = {"q": (q, 1), "dout": (dout, 1), "out": (out, 1), "lse": (lse, 2)}
    received = _gather_rows(p, rank, mine, rows, ex)
    ex.post()
    partials = []                        # per run, in call order: (dk, dv) over its key prefix
    dq = torch.empty_like(q)
    dq_out = _foreign_buffers(p, rank, lambda lo, hi: (q.new_empty((b, (hi - lo) * G, h, d)),))
    for lo, hi, e in _runs_in_order(p, rank, ex):
        args = [_run_input(t, dim, mine, received, p, rank, lo, hi, name) for name, (t, dim) in rows.items()]
        q_run, do_run, o_run, l_run = args
        l_run = l_run.contiguous()    # the backward op takes a contiguous (b, h, rows) LSE
        dq_run, dk_run, dv_run = ops.bwd(do_run, q_run, _bshd(kg[:e]), _bshd(vg[:e]), o_run, l_run,
                                         softmax_scale, causal, False, "auto", 0)
        partials.append((dk_run, dv_run))
        for a, b_, o in p.pieces(lo, hi):
            r_ = slice((a - lo) * G, (b_ - lo) * G)
            if o == rank:
                dq[:, mine.rows(a, b_)] = dq_run[:, r_]
            else:
                _store_foreign(dq_out, a, b_, o, (dq_run[:, r_],), (1,))

    def partial_pieces(src, dst):
        """(run index, lo, hi) of the dK/dV partials that rank src's runs hold of rank dst's keys,
        in the order src sends them."""
        out_ = []
        for i, (rlo, rhi) in enumerate(p.runs[src]):
            end = p.kv_end(rlo, rhi)
            out_ += [(i, lo, min(hi, end)) for lo, hi in p.kv_from(src, dst) if lo < end]
        return out_

    # dQ rows back to their owners; each run's dK/dV partial of a peer's keys to that peer, in the
    # input dtype, summed there in fp32 in ascending (rank, run) order
    ex = tr.P2PExchange(group, rank, "backward results", q.device)
    dq_landing, contributions = [], []
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(rank, peer):
            ex.send(peer, dq_out[(peer, lo, hi)][0])
        for lo, hi in p.rows_from(peer, rank):
            dq_landing.append((lo, hi, ex.recv_buffer(peer, (b, (hi - lo) * G, h, d), q.dtype)))
        for i, lo, hi in partial_pieces(rank, peer):
            dk_run, dv_run = partials[i]
            for t in (dk_run, dv_run):
                ex.send(peer, t[:, lo * G:hi * G])
        for i, lo, hi in partial_pieces(peer, rank):
            bufs = (ex.recv_buffer(peer, (b, (hi - lo) * G, hk, d), k.dtype),
                    ex.recv_buffer(peer, (b, (hi - lo) * G, hk, d), v.dtype))
            contributions.append((peer, i, lo, hi, *bufs))
    for i, lo, hi in partial_pieces(rank, rank):
        dk_run, dv_run = partials[i]
        contributions.append((rank, i, lo, hi, dk_run[:, lo * G:hi * G], dv_run[:, lo * G:hi * G]))
    ex.post().wait()
    for lo, hi, buf in dq_landing:
        dq[:, mine.rows(lo, hi)] = buf
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _sum_partials(contributions, mine, dk, dv)
    return dq, dk, dv
