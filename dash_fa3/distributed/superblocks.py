"""The superblock algorithm (``algorithm="superblocks"``, the deterministic default): bitwise the
same output and gradients for every number of ranks, any heads_kv (MQA included), on the
single-GPU kernels.

The sequence is cut into **superblocks** of S tokens (``superblock=``, default
:data:`SUPERBLOCK`; the last one shorter when S does not divide the length), fixed by the global
length and S alone, never by P. Every kernel call covers exactly one superblock of query rows
against the key prefix it sees (causal: keys [0, superblock end), the kernels' bottom-right
alignment putting the diagonal in place; full: every key). A call's shapes and inputs are then the
same whichever rank makes it, so are its bits:

* **forward**: one call per superblock gives its rows' output and LSE. On the GPU a row is computed
  over the same key tiles in the same order as in one call on the whole sequence, so these are
  bitwise ``flash_attn_func``'s output and LSE.
* **backward**: one deterministic call per superblock (``ops.bwd_dkv_fp32``) gives its rows'
  complete dQ and an fp32 **partial** dK/dV over its key prefix, not rounded. A key's dK is the sum
  of the partials of every superblock that sees it, and floating-point addition is not
  associative, so the sum follows one fixed binary tree over the superblocks (:func:`split`:
  the left child of [lo, hi) is the largest power of two below hi - lo), whatever P. A rank
  evaluates the maximal subtrees among the superblocks it computes (:func:`cover`), sends their
  values to the keys' owners, and each owner evaluates the rest of the tree and rounds once. A
  subtree that cannot see a key (causal, all its superblocks end before it) is left out rather than
  added as zeros; which ones those are depends on positions alone, so every P leaves out the same.

Which superblocks a rank computes (:func:`plan`) is free, since the bits do not depend on it: with
the causal mask and 2P·m superblocks, rank x takes the superblock chunks 2x and 2P-1-2x of 2P
(contiguous layout: one own chunk and one of its partner P-1-x, DistFlashAttn's helper-worker
balance) or its own chunks r and 2P-1-r (zigzag); each rank then has the same work. Otherwise the
superblocks are cut into P runs of near-equal work.

The dQ of a superblock is therefore not ``flash_attn_func``'s (its calls see a shorter problem and
take other add orders), nor are dK/dV: the result equals this algorithm at P = 1, which is what the
tests compare every P with. Memory: a rank holds fp32 dK/dV partials over the key prefix of the
subtrees it evaluates (at most about log2 of its superblock count at once, plus its covers).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch
import torch.distributed as dist

from .. import ops, reference, validation
from . import comm, runs
from . import shared as tr
from .layout import G, block_owners, block_runs, check_seqlen
from .model import CPCostModel, Estimate

__all__ = ["SUPERBLOCK", "check_superblock", "split", "cover", "SuperblockPlan", "plan", "simulate", "forward",
           "backward"]

SUPERBLOCK = 8192   # tokens: large enough that a call keeps the GPU's SMs busy, small enough for 2P at 128k, P = 8


def check_superblock(superblock) -> int:
    """``superblock`` (None: :data:`SUPERBLOCK`) as a positive multiple of G, else ValueError."""
    if superblock is None:
        return SUPERBLOCK
    s = validation.as_int(superblock)
    if s is None or s < G or s % G:
        raise ValueError(f"superblock={superblock!r} must be a positive multiple of {G} tokens "
                         f"(default {SUPERBLOCK}); the bits depend on it, so keep it fixed across P")
    return s


def split(lo: int, hi: int) -> int:
    """Where the fixed tree cuts the superblocks [lo, hi) (hi - lo >= 2): after the largest power of
    two below hi - lo. Every aligned power-of-two range is then one node."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


def cover(a: int, b: int, n: int) -> list[tuple[int, int]]:
    """The maximal nodes of the tree over superblocks [0, n) inside [a, b), in ascending order."""
    out: list[tuple[int, int]] = []

    def walk(lo, hi):
        if hi <= a or b <= lo:
            return
        if a <= lo and hi <= b:
            out.append((lo, hi))
            return
        mid = split(lo, hi)
        walk(lo, mid)
        walk(mid, hi)

    walk(0, n)
    return out


@dataclass(frozen=True)
class SuperblockPlan:
    """Superblocks (in G-blocks: superblock i is blocks [bounds[i], bounds[i + 1])), the run plan
    of the blocks each rank computes (runs of whole superblocks), and each rank's tree nodes."""
    runs: runs.RunPlan
    bounds: tuple[int, ...]
    leaves: tuple[tuple[int, ...], ...]   # per rank: the superblocks it computes, ascending

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @cached_property
    def _nodes(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        return tuple(tuple(node for lo, hi in block_runs(ls) for node in cover(lo, hi, self.count))
                     for ls in self.leaves)

    def nodes(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The maximal tree nodes among the superblocks ``rank`` computes: the values it sends."""
        return self._nodes[rank]

    def blocks(self, lo: int, hi: int) -> tuple[int, int]:
        """G-blocks of superblocks [lo, hi)."""
        return self.bounds[lo], self.bounds[hi]

    def key_end(self, node: tuple[int, int]) -> int:
        """Key blocks [0, key_end) that a node's superblocks see (its partials' extent)."""
        return self.bounds[node[1]] if self.runs.causal else self.runs.num_blocks

    def sees(self, node: tuple[int, int], block: int) -> bool:
        return block < self.key_end(node)

    def kv_pieces(self, node: tuple[int, int], owner: int) -> list[tuple[int, int]]:
        """Runs of ``owner``'s key blocks that ``node``'s partials cover: what its value sends there."""
        end = self.key_end(node)
        return [(lo, min(hi, end)) for lo, hi in self._own_runs(owner) if lo < end]

    def _own_runs(self, owner: int) -> list[tuple[int, int]]:
        return block_runs(self.runs.local(owner))

    def key_superblocks(self, rank: int) -> list[tuple[int, int, int]]:
        """(superblock, block lo, block hi) of this rank's own key blocks, cut at superblock bounds."""
        out = []
        for lo, hi in self._own_runs(rank):
            i = int(np.searchsorted(self.bounds, lo, side="right")) - 1
            while lo < hi:
                end = min(hi, self.bounds[i + 1])
                out.append((i, lo, end))
                lo, i = end, i + 1
        return out


def _assign(count: int, bounds, num_ranks: int, causal: bool, layout: str, owner) -> list[list[int]]:
    """The superblocks each rank computes (see the module's docstring)."""
    P = num_ranks
    if causal and count % (2 * P) == 0:
        m = count // (2 * P)
        chunks = ([r, 2 * P - 1 - r] if layout == "zigzag" else [2 * r, 2 * P - 1 - 2 * r] for r in range(P))
        return [sorted(i for c in cs for i in range(c * m, (c + 1) * m)) for cs in chunks]
    if not causal and count % P == 0 and all(owner[bounds[i]] == owner[bounds[i + 1] - 1] for i in range(count)):
        return [[i for i in range(count) if owner[bounds[i]] == r] for r in range(P)]
    # near-equal work in P contiguous runs: a superblock's work is its rows times the keys they see
    rows = np.diff(np.asarray(bounds, dtype=np.float64))
    ends = np.asarray(bounds[1:], dtype=np.float64)
    work = rows * (ends - rows / 2 if causal else float(bounds[-1]))
    acc = np.concatenate([[0.0], np.cumsum(work)])
    cuts = [0]
    for r in range(1, P):
        target = acc[-1] * r / P
        c = int(np.argmin(np.abs(acc - target)))
        cuts.append(min(max(c, cuts[-1]), count))
    cuts.append(count)
    return [list(range(cuts[r], cuts[r + 1])) for r in range(P)]


@lru_cache(maxsize=256)
def plan(num_ranks: int, seqlen: int, causal: bool, layout: str, superblock: int = SUPERBLOCK) -> SuperblockPlan:
    """The superblock plan of a global sequence of ``seqlen`` tokens over ``num_ranks`` ranks."""
    nb = check_seqlen(seqlen, num_ranks)
    unit = check_superblock(superblock) // G
    bounds = tuple(list(range(0, nb, unit)) + [nb])
    count = len(bounds) - 1
    owner = tuple(int(x) for x in block_owners(layout, num_ranks, nb))
    leaves = _assign(count, bounds, num_ranks, bool(causal), layout, owner)
    run_lists = tuple(tuple((bounds[lo], bounds[hi]) for lo, hi in block_runs(ls)) for ls in leaves)
    p = runs.RunPlan(num_ranks, nb, bool(causal), layout, owner, run_lists)
    runs.validate(p)
    return SuperblockPlan(p, bounds, tuple(tuple(ls) for ls in leaves))


# ------------------------------------------------------------------------------------------ model

DEFAULT_COST = CPCostModel(launch_us=20.0)


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, layout: str = "contiguous", batch: int = 1,
             heads: int = 16, heads_kv: int = 16, headdim: int = 128, superblock: int = SUPERBLOCK,
             cost: CPCostModel | None = None, **rates) -> Estimate:
    """Estimate of one forward + backward (``cost`` defaults to :data:`DEFAULT_COST`; ``rates``
    replace its fields). Per rank: its superblocks' tiles at the kernels' rates plus two launches
    each; the wait for remote inputs less the compute of its local superblocks; the result exchange
    after its last call (rows back, fp32 node values to the keys' owners; the larger direction);
    and the memory passes of the tree (a read-add-write per add, the final read and cast)."""
    cost = (cost or DEFAULT_COST).with_(**rates)
    sp = plan(num_ranks, seqlen, causal, layout, superblock)
    p = sp.runs
    tile_flops = 4.0 * G * G * headdim * heads * batch
    t_tile = cost.gemm_seconds(tile_flops, "fwd") + cost.gemm_seconds(2.5 * tile_flops, "bwd")
    row = batch * G * headdim * 2
    kv_bytes, q_bytes, part_bytes = 2 * heads_kv * row, heads * row, 2 * heads_kv * batch * G * headdim * 4
    msg = cost.message_seconds
    comp, exposed = [], []
    for r in range(num_ranks):
        peers = [x for x in range(num_ranks) if x != r]
        leaves = [sp.blocks(s, s + 1) for s in sp.leaves[r]]
        tiles = [sum(p.kv_end(b, b + 1) for b in range(lo, hi)) for lo, hi in leaves]
        c = sum(tiles) * t_tile + 2 * len(leaves) * cost.launch_us * 1e-6
        local = sum(t for (lo, hi), t in zip(leaves, tiles) if p.run_is_local(r, lo, hi)) * t_tile
        kv_in = sum(hi - lo for x in peers for lo, hi in p.kv_from(r, x))
        kv_out = sum(hi - lo for x in peers for lo, hi in p.kv_from(x, r))
        rows_in = sum(hi - lo for x in peers for lo, hi in p.rows_from(r, x))
        rows_out = sum(hi - lo for x in peers for lo, hi in p.rows_from(x, r))
        inputs = msg(max(kv_in * kv_bytes + rows_in * 4 * q_bytes, kv_out * kv_bytes + rows_out * 4 * q_bytes))
        parts_out = sum(hi - lo for node in sp.nodes(r) for x in peers for lo, hi in sp.kv_pieces(node, x))
        parts_in = sum(hi - lo for x in peers for node in sp.nodes(x) for lo, hi in sp.kv_pieces(node, r))
        results = msg(max(rows_in * 2 * q_bytes + parts_out * part_bytes, rows_out * 2 * q_bytes
                          + parts_in * part_bytes))
        adds = sum(sp.key_end((lo, mid)) for a, b in sp.nodes(r) for lo, mid, _ in _inner(a, b, sp))
        mem = (3 * adds * part_bytes + 3 * parts_in * part_bytes) / (cost.hbm_gbs * 1e9)
        comp.append(c * 1e3)
        exposed.append((max(0.0, 2 * inputs - local) + results + mem) * 1e3)
    nb = p.num_blocks
    single = (nb * (nb + 1) // 2 if causal else nb * nb) * t_tile * 1e3
    time = max(c + e for c, e in zip(comp, exposed))
    return Estimate("superblocks", layout, num_ranks, seqlen, bool(causal), tuple(comp), tuple(exposed), time,
                    single)


def _inner(a: int, b: int, sp: SuperblockPlan):
    """(lo, mid, hi) of every inner node of the subtree [a, b)."""
    if b - a < 2:
        return []
    mid = split(a, b)
    return [(a, mid, b)] + _inner(a, mid, sp) + _inner(mid, b, sp)


# ------------------------------------------------------------------------------------------ runtime

def _key(what, q, k, causal, layout, superblock, P):
    return (what, P, tuple(q.shape), k.shape[2], str(q.dtype), bool(causal), layout, superblock)


def _inputs(tensors, mine, received, p, rank, lo, hi):
    """One superblock's row inputs (name -> tensor); on CPU contiguous copies, so the reference sees
    the same layouts whichever rank and piece they come from."""
    out = {name: runs._run_input(t, dim, mine, received, p, rank, lo, hi, name)
           for name, (t, dim) in tensors.items()}
    return {n: t.contiguous() for n, t in out.items()} if next(iter(out.values())).device.type == "cpu" else out


def _prefix(x_sm: torch.Tensor, end: int) -> torch.Tensor:
    x = runs._bshd(x_sm[:end])
    return x.contiguous() if x.device.type == "cpu" else x


def _place(p, rank, mine, lo, hi, local_dsts, foreign, values, dims):
    """Rows of the call on blocks [lo, hi) to this rank's outputs or to the result buffers of
    their owners."""
    for a, b_, o in p.pieces(lo, hi):
        cut = [v.narrow(dim, (a - lo) * G, (b_ - a) * G) for v, dim in zip(values, dims)]
        if o == rank:
            sl = mine.rows(a, b_)
            for dst, src, dim in zip(local_dsts, cut, dims):
                dst.narrow(dim, sl.start, sl.stop - sl.start).copy_(src)
        else:
            runs._store_foreign(foreign, a, b_, o, cut, dims)


def forward(q, k, v, *, group, causal: bool, layout: str, softmax_scale: float, superblock: int, transport: str):
    """This rank's (out (b, n, h, d), lse (b, h, n) fp32) for local shards q, k, v."""
    comm.ensure_communicator(group, q.device)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    sp = plan(P, n * P, bool(causal), layout, superblock)
    p = sp.runs
    mine = runs._Blocks(p, rank)
    key = _key("forward", q, k, causal, layout, superblock, P)
    ex = tr.exchange(transport, group, rank, "forward inputs", q.device, key)
    kg, vg = runs._gather_kv(p, rank, mine, k, v, ex)
    received = runs._gather_rows(p, rank, mine, {"q": (q, 1)}, ex)
    ex.post()
    out = q.new_empty((b, n, h, d))
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    results = runs._foreign_buffers(p, rank, lambda lo, hi: (
        q.new_empty((b, (hi - lo) * G, h, d)),
        torch.empty((b, h, (hi - lo) * G), dtype=torch.float32, device=q.device)))
    waited = False
    for s in sp.leaves[rank]:
        lo, hi = sp.blocks(s, s + 1)
        if not waited and not p.run_is_local(rank, lo, hi):
            ex.wait()
            waited = True
        q_s = _inputs({"q": (q, 1)}, mine, received, p, rank, lo, hi)["q"]
        e = p.kv_end(lo, hi) * G
        if q.device.type == "cpu":
            with reference.one_thread():
                o_s, l_s = ops.fwd(q_s, _prefix(kg, e), _prefix(vg, e), softmax_scale, causal, 0)
        else:
            o_s, l_s = ops.fwd(q_s, _prefix(kg, e), _prefix(vg, e), softmax_scale, causal, 0)
        _place(p, rank, mine, lo, hi, (out, lse), results, (o_s, l_s), (1, 2))
    if not waited:
        ex.wait()
    ex = tr.exchange(transport, group, rank, "forward results", q.device, key)
    landing = []
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(rank, peer):
            for t in results[(peer, lo, hi)]:
                ex.send(peer, t)
        for lo, hi in p.rows_from(peer, rank):
            landing.append((lo, hi, ex.recv_buffer(peer, (b, (hi - lo) * G, h, d), q.dtype),
                            ex.recv_buffer(peer, (b, h, (hi - lo) * G), torch.float32)))
    ex.post().wait()
    for lo, hi, o_buf, l_buf in landing:
        sl = mine.rows(lo, hi)
        out[:, sl] = o_buf
        lse[:, :, sl] = l_buf
    return out, lse


def _combine(left, right):
    """A node's value from its children's (dk, dv) over their key prefixes: the right child sees
    at least the left one's keys, so the sum is taken in place over the left's extent and the
    right's values stand alone beyond it (fp32 addition commutes, so this is left + right)."""
    end = left[0].shape[1]
    for l_, r_ in zip(left, right):
        r_[:, :end] += l_
    return right


def backward(dout, q, k, v, out, lse, *, group, causal: bool, layout: str, softmax_scale: float, superblock: int,
             transport: str):
    """This rank's (dq, dk, dv) for local shards (deterministic; the same bits for every P)."""
    comm.ensure_communicator(group, q.device)
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    b, n, h, d = q.shape
    hk = k.shape[2]
    sp = plan(P, n * P, bool(causal), layout, superblock)
    p = sp.runs
    mine = runs._Blocks(p, rank)
    key = _key("backward", q, k, causal, layout, superblock, P)
    ex = tr.exchange(transport, group, rank, "backward inputs", q.device, key)
    kg, vg = runs._gather_kv(p, rank, mine, k, v, ex)
    rows = {"q": (q, 1), "dout": (dout, 1), "out": (out, 1), "lse": (lse, 2)}
    received = runs._gather_rows(p, rank, mine, rows, ex)
    ex.post()
    dq = torch.empty_like(q)
    dq_out = runs._foreign_buffers(p, rank, lambda lo, hi: (q.new_empty((b, (hi - lo) * G, h, d)),))
    waited = False

    def leaf(s):
        nonlocal waited
        lo, hi = sp.blocks(s, s + 1)
        if not waited and not p.run_is_local(rank, lo, hi):
            ex.wait()
            waited = True
        x = _inputs(rows, mine, received, p, rank, lo, hi)
        e = p.kv_end(lo, hi) * G
        dq_s, dk_s, dv_s = ops.bwd_dkv_fp32(x["dout"], x["q"], _prefix(kg, e), _prefix(vg, e), x["out"],
                                            x["lse"].contiguous(), softmax_scale, causal)
        _place(p, rank, mine, lo, hi, (dq,), dq_out, (dq_s,), (1,))
        return dk_s, dv_s

    def evaluate(lo, hi):
        if hi - lo == 1:
            return leaf(lo)
        mid = split(lo, hi)
        return _combine(evaluate(lo, mid), evaluate(mid, hi))

    values = {node: evaluate(*node) for node in sp.nodes(rank)}
    if not waited:
        ex.wait()

    # dQ rows back to their owners; each node's value over a peer's keys to that peer
    ex = tr.exchange(transport, group, rank, "backward results", q.device, key)
    dq_landing = []
    parts: dict[tuple[int, int], list] = {}
    for peer in range(P):
        if peer == rank:
            continue
        for lo, hi in p.rows_from(rank, peer):
            ex.send(peer, dq_out[(peer, lo, hi)][0])
        for lo, hi in p.rows_from(peer, rank):
            dq_landing.append((lo, hi, ex.recv_buffer(peer, (b, (hi - lo) * G, h, d), q.dtype)))
        for node in sp.nodes(rank):
            for lo, hi in sp.kv_pieces(node, peer):
                for t in values[node]:
                    ex.send(peer, t[:, lo * G:hi * G])
        for node in sp.nodes(peer):
            for lo, hi in sp.kv_pieces(node, rank):
                bufs = tuple(ex.recv_buffer(peer, (b, (hi - lo) * G, hk, d), torch.float32) for _ in range(2))
                parts.setdefault(node, []).append((lo, hi, bufs))
    for node in sp.nodes(rank):
        for lo, hi in sp.kv_pieces(node, rank):
            parts.setdefault(node, []).append((lo, hi, tuple(t[:, lo * G:hi * G] for t in values[node])))
    ex.post().wait()
    for lo, hi, buf in dq_landing:
        dq[:, mine.rows(lo, hi)] = buf
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _reduce(sp, rank, mine, parts, dk, dv)
    return dq, dk, dv


def _reduce(sp: SuperblockPlan, rank: int, mine, parts, dk, dv) -> None:
    """dK, dV of this rank's keys: the top of the fixed tree over the nodes' values, per piece of a
    key superblock (the nodes that see a key depend on its superblock alone), rounded once."""

    def value(node, lo, hi):
        if not sp.sees(node, lo):
            return None
        for plo, phi, bufs in parts.get(node, ()):
            if plo <= lo and hi <= phi:
                return tuple(t[:, (lo - plo) * G:(hi - plo) * G] for t in bufs)
        a, c = node
        if c - a == 1:
            raise AssertionError(f"superblock {a}'s partial of key blocks [{lo}, {hi}) never arrived")
        mid = split(a, c)
        left, right = value((a, mid), lo, hi), value((mid, c), lo, hi)
        if left is None or right is None:
            return right if left is None else left
        return tuple(x + y for x, y in zip(left, right))

    for _, lo, hi in sp.key_superblocks(rank):
        got = value((0, sp.count), lo, hi)
        sl = mine.rows(lo, hi)
        dk[:, sl] = got[0]
        dv[:, sl] = got[1]
