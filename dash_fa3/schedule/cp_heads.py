"""Head-parallel context parallelism as data: which rank computes which heads, which tokens travel
where, and a model of its time (``python -m dash_fa3.schedule.cp_heads``).

The sequence arrives sharded by tokens (``dash_fa3.distributed.shard``). The head-parallel
algorithm (``dash_fa3/distributed/heads.py``) turns that into a sharding by heads: rank r receives
every rank's tokens of its own KV heads (and of their query heads), computes attention over the
whole sequence for those heads with the single-GPU kernels, and returns each rank its tokens of
the result. A head's attention is then one single-GPU call on the whole sequence, whatever P:
the output, LSE and gradients are bitwise those of ``flash_attn_func`` on one GPU, provided the
kernels' result for one head does not depend on how many heads share the call (the forward computes
each (head, query tile) in one CTA; the deterministic backward's dQ add order is a function of the
tile geometry, tests/test_schedule_cp_heads.py checks it for every schedule; GQA's dK/dV sum a
group's heads in head order, and groups are never split). That is the deterministic mode's default.

Work is assigned by KV heads (a query head travels with its KV head): rank r takes KV heads
[r*Hk//P, (r+1)*Hk//P), so Hk >= P is required. Each rank's heads are cut into ``chunks`` (at most
as many as the smallest rank has KV heads) that form a pipeline: chunk c+1's inputs travel while
chunk c computes, and chunk c's results travel back while chunk c+1 computes.

The schedule is the list :meth:`HeadPlan.items` of (kv-head chunk, rank, step) and the messages
:meth:`HeadPlan.messages` of each step; :func:`validate` checks it covers every head once.
"""

from __future__ import annotations

import dataclasses
import functools

from . import distributed as S
from .distributed import G

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
    nb = S.check_seqlen(seqlen, num_ranks)
    if layout not in S.LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(S.LAYOUTS)}")
    if heads <= 0 or heads_kv <= 0 or heads % heads_kv:
        raise ValueError(f"heads ({heads}) must be a positive multiple of heads_kv ({heads_kv})")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    ranges = kv_ranges(heads_kv, num_ranks)
    n_chunks = min(chunks, min(hi - lo for lo, hi in ranges))
    per_rank = [_split(lo, hi, n_chunks) for lo, hi in ranges]
    pieces = tuple(tuple(S.block_runs(S.local_blocks(layout, num_ranks, nb, r).tolist()))
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


@dataclasses.dataclass(frozen=True)
class HeadSim:
    compute_ms: tuple[float, ...]   # per rank: kernel time of its heads
    exposed_ms: tuple[float, ...]   # per rank: communication and memory passes not hidden by compute
    time_ms: float                  # the slowest rank's forward + backward
    single_ms: float                # one GPU, the whole problem, the same kernels
    efficiency: float


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, layout: str = "contiguous", batch: int = 1,
             heads: int = 16, heads_kv: int = 16, headdim: int = 128, chunks: int = 1,
             fwd_tflops: float = 650.0, bwd_tflops: float = 500.0, beta_gbs: float = 160.0,
             alpha_us: float = 15.0, hbm_gbs: float = 3000.0, elem_bytes: int = 2) -> HeadSim:
    """Estimate of one forward + backward (α-β messages, concurrent in both directions; kernels at
    the given rates; memory passes at ``hbm_gbs``).

    ``beta_gbs`` = 160: what the head-parallel transfers reached on two H200s (NVLink, NCCL 2.28,
    2026-11-24): the runtime's overhead over the compute of its heads, 5.8 ms for 0.81 GB each way
    at 64k tokens (16 heads) and 15.8 ms for 2.0 GB at 128k (32/8 heads), less the copies at
    ``hbm_gbs``, gives 172 and 154 GB/s (before the backward reused the forward's gathered inputs).

    Per pass and rank: the first chunk's inputs arrive (exposed), then chunk c computes while chunk
    c+1's inputs and chunk c-1's results travel, and the last chunk's results return (exposed).
    A chunk's transfer time is its larger direction (P-1 peers' pieces, one message per piece and
    tensor). Memory passes: packing what is sent, placing what arrives (read + write each)."""
    p = plan(num_ranks, seqlen, heads, heads_kv, layout, chunks)
    n_tok = p.num_blocks * G
    pairs = (p.num_blocks * (p.num_blocks + 1) // 2 if causal else p.num_blocks ** 2) * G * G
    fwd_head = 4.0 * pairs * headdim * batch / (fwd_tflops * 1e12)       # per query head, seconds
    bwd_head = 2.5 * 4.0 * pairs * headdim * batch / (bwd_tflops * 1e12)
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
        wire = (msgs * alpha_us * 1e-6 + max(recv, send) / (beta_gbs * 1e9)) if num_ranks > 1 else 0.0
        return wire + 2 * (recv + send) / (hbm_gbs * 1e9)

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
    return HeadSim(tuple(comp), tuple(exposed), time, single, single / (num_ranks * time))


def main(argv=None) -> int:
    """``python -m dash_fa3.schedule.cp_heads``: predicted efficiency per P and length."""
    import argparse

    from .distributed import _heads_pair, _int_list

    ap = argparse.ArgumentParser(prog="python -m dash_fa3.schedule.cp_heads", description=main.__doc__)
    ap.add_argument("--P", type=_int_list, default="2,4,8", help="rank counts, comma list")
    ap.add_argument("--seqlen", type=_int_list, default="64k,128k,1m", help="global lengths (k = 1024, m = 1024**2)")
    ap.add_argument("--heads", type=_heads_pair, default="16/16", help="heads/heads_kv")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="no causal mask")
    ap.add_argument("--layout", default="contiguous", choices=S.LAYOUTS)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--beta-gbs", type=float, default=160.0)
    ap.add_argument("--alpha-us", type=float, default=15.0)
    args = ap.parse_args(argv)
    h, hk = args.heads
    lengths = args.seqlen
    print(f"head-parallel, {'full' if args.full else 'causal'}, heads {h}/{hk}, hdim {args.hdim}, "
          f"{args.layout}, chunks {args.chunks}: predicted efficiency T1 / (P * T_P), fwd + bwd")
    print("| P | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for P in args.P:
        row = []
        for n in lengths:
            try:
                r = simulate(P, n, causal=not args.full, layout=args.layout, heads=h, heads_kv=hk,
                             headdim=args.hdim, chunks=args.chunks, beta_gbs=args.beta_gbs,
                             alpha_us=args.alpha_us)
                row.append(f"{r.efficiency:.3f}")
            except ValueError as e:
                row.append(f"n/a ({str(e).split(':')[0]})")
        print(f"| {P} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
