"""Context parallelism on CUDA tensors with the Hopper kernels and NCCL point-to-point messages.

Executes the run plan of ``dash_fa3/schedule/cp_runs.py``: each rank calls the single-GPU forward
and backward kernels on its runs of query blocks against the key prefix they need. Messages go
through ``batch_isend_irecv``, which NCCL runs on its own stream: sends start once the compute
stream has produced their data, and ``Work.wait()`` makes the compute stream (not the host) wait
for receives, so nothing here synchronises the host with the device. A rank first computes the
runs whose data it holds, then waits for the gathered keys and values.

Gathered keys and values are stored sequence-major, (tokens, batch, heads, headdim), so that the
rows of one block range are one contiguous piece that a message fills in place; the kernels read
them through a (batch, tokens, heads, headdim) view (TMA takes any 16-byte strides).

Forward: a query row is computed by one kernel call with the same key tiles as on one GPU, so the
output and LSE are bitwise a single-GPU call's for every number of ranks (both modes). Backward,
non-deterministic mode: a run's call gives its complete dQ and partial dK/dV over its key prefix;
each key block's owner sums the partials in fp32 in ascending rank order. (The deterministic mode
runs whole heads per rank instead: ``heads.py``.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..schedule import cp_runs
from ..schedule.distributed import G
from . import runtime

def _wait(works) -> None:
    for w in works:
        w.wait()


def _seq_major(x: torch.Tensor) -> torch.Tensor:
    """(batch, n, ...) -> contiguous (n, batch, ...): a view when batch is 1, else a copy."""
    return x.transpose(0, 1).contiguous()


def _bshd(x_sm: torch.Tensor) -> torch.Tensor:
    """A sequence-major (n, batch, ...) tensor as a (batch, n, ...) view."""
    return x_sm.transpose(0, 1)


class _Blocks:
    """Global-position block ranges of one rank's local (batch, n, ...) tensors."""

    def __init__(self, p: cp_runs.RunPlan, rank: int):
        self.index = {b: i for i, b in enumerate(p.local(rank))}

    def rows(self, lo: int, hi: int) -> slice:
        """Local token slice of global blocks [lo, hi) (consecutive locally too: runs of own blocks)."""
        i = self.index[lo]
        assert self.index[hi - 1] == i + hi - lo - 1
        return slice(i * G, (i + hi - lo) * G)


def _gather_kv(p, rank, mine, k, v):
    """Sequence-major key/value prefixes [0, kv_need) with own blocks copied in: (kg, vg, sends,
    receives), the messages that fill in the other ranks' blocks (to post with ``_exchange``)."""
    P = p.num_ranks
    need = p.kv_need(rank)
    b, _, hk, d = k.shape
    kg = k.new_empty((need * G, b, hk, d))
    vg = v.new_empty((need * G, b, hk, d))
    for lo, hi in p.kv_from(rank, rank):
        sl = mine.rows(lo, hi)
        kg[lo * G:hi * G].copy_(k[:, sl].transpose(0, 1))
        vg[lo * G:hi * G].copy_(v[:, sl].transpose(0, 1))
    sends, recvs = [], []
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.kv_from(peer, rank):        # what peer needs of mine
            sl = mine.rows(lo, hi)
            sends += [(peer, _seq_major(k[:, sl])), (peer, _seq_major(v[:, sl]))]
        for lo, hi in p.kv_from(rank, peer):
            recvs += [(peer, kg[lo * G:hi * G]), (peer, vg[lo * G:hi * G])]
    return kg, vg, sends, recvs


def _gather_rows(p, rank, mine, tensors, group_sends, group_recvs):
    """Row inputs of the runs this rank computes for others: per peer, per block run, each tensor
    of ``tensors`` (name -> (local tensor, seq_dim)). Adds to the send/receive lists; returns
    {(lo, hi): {name: received tensor}}."""
    P = p.num_ranks
    received = {}
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(peer, rank):      # rows peer computes that I own: send inputs
            sl = mine.rows(lo, hi)
            for name, (t, dim) in tensors.items():
                group_sends.append((peer, t.narrow(dim, sl.start, sl.stop - sl.start).contiguous()))
        for lo, hi in p.rows_from(rank, peer):      # rows I compute that peer owns: receive inputs
            got = {}
            for name, (t, dim) in tensors.items():
                shape = list(t.shape)
                shape[dim] = (hi - lo) * G
                got[name] = t.new_empty(shape)
                group_recvs.append((peer, got[name]))
            received[(lo, hi)] = got
    return received


def _runs_in_order(p, rank, works):
    """This rank's runs as (lo, hi, key prefix in tokens), waiting for the posted receives before
    the first run that needs remote data (and after the last run, so the receives are done)."""
    waited = False
    for lo, hi in p.runs[rank]:
        if not waited and not p.run_is_local(rank, lo, hi):
            _wait(works)
            waited = True
        yield lo, hi, p.kv_end(lo, hi) * G
    if not waited:
        _wait(works)


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
    runtime.ensure_communicator(group, q.device)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    p = cp_runs.plan(P, n * P, bool(causal), layout)
    mine = _Blocks(p, rank)
    kg, vg, sends, recvs = _gather_kv(p, rank, mine, k, v)
    received = _gather_rows(p, rank, mine, {"q": (q, 1)}, sends, recvs)
    works = runtime.post_p2p(sends, recvs, group)
    out = q.new_empty((b, n, h, d))
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    results = _foreign_buffers(p, rank, lambda lo, hi: (
        q.new_empty((b, (hi - lo) * G, h, d)),
        torch.empty((b, h, (hi - lo) * G), dtype=torch.float32, device=q.device)))
    for lo, hi, e in _runs_in_order(p, rank, works):
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
    sends, recvs, landing = [], [], []
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(rank, peer):
            sends += [(peer, t) for t in results[(peer, lo, hi)]]
        for lo, hi in p.rows_from(peer, rank):
            o_buf = q.new_empty((b, (hi - lo) * G, h, d))
            l_buf = torch.empty((b, h, (hi - lo) * G), dtype=torch.float32, device=q.device)
            recvs += [(peer, o_buf), (peer, l_buf)]
            landing.append((lo, hi, o_buf, l_buf))
    _wait(runtime.post_p2p(sends, recvs, group))
    for lo, hi, o_buf, l_buf in landing:
        sl = mine.rows(lo, hi)
        out[:, sl] = o_buf
        lse[:, :, sl] = l_buf
    return out, lse


def backward(dout, q, k, v, out, lse, *, group, causal: bool, layout: str, softmax_scale: float):
    """This rank's (dq, dk, dv) for local shards (non-deterministic mode)."""
    runtime.ensure_communicator(group, q.device)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    hk = k.shape[2]
    p = cp_runs.plan(P, n * P, bool(causal), layout)
    mine = _Blocks(p, rank)
    kg, vg, sends, recvs = _gather_kv(p, rank, mine, k, v)
    rows = {"q": (q, 1), "dout": (dout, 1), "out": (out, 1), "lse": (lse, 2)}
    received = _gather_rows(p, rank, mine, rows, sends, recvs)
    works = runtime.post_p2p(sends, recvs, group)
    partials = []                        # per run, in call order: (dk, dv) over its key prefix
    dq = torch.empty_like(q)
    dq_out = _foreign_buffers(p, rank, lambda lo, hi: (q.new_empty((b, (hi - lo) * G, h, d)),))
    for lo, hi, e in _runs_in_order(p, rank, works):
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
    sends, recvs, dq_landing, contributions = [], [], [], []
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(rank, peer):
            sends.append((peer, dq_out[(peer, lo, hi)][0]))
        for lo, hi in p.rows_from(peer, rank):
            buf = q.new_empty((b, (hi - lo) * G, h, d))
            recvs.append((peer, buf))
            dq_landing.append((lo, hi, buf))
        for i, lo, hi in partial_pieces(rank, peer):
            dk_run, dv_run = partials[i]
            sends += [(peer, t[:, lo * G:hi * G].contiguous()) for t in (dk_run, dv_run)]
        for i, lo, hi in partial_pieces(peer, rank):
            bufs = (k.new_empty((b, (hi - lo) * G, hk, d)), v.new_empty((b, (hi - lo) * G, hk, d)))
            recvs += [(peer, t) for t in bufs]
            contributions.append((peer, i, lo, hi, *bufs))
    for i, lo, hi in partial_pieces(rank, rank):
        dk_run, dv_run = partials[i]
        contributions.append((rank, i, lo, hi, dk_run[:, lo * G:hi * G], dv_run[:, lo * G:hi * G]))
    _wait(runtime.post_p2p(sends, recvs, group))
    for lo, hi, buf in dq_landing:
        dq[:, mine.rows(lo, hi)] = buf
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _sum_partials(contributions, mine, dk, dv)
    return dq, dk, dv
