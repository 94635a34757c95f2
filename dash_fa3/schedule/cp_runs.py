"""The GPU path of context parallelism as data: which query rows each rank computes with the Hopper
kernels, and what moves between ranks (issue 16).

The fold schedules of ``distributed.py`` advance a query block's softmax state (or a block's dQ /
dK-dV accumulator) tile by tile across steps, which needs kernels that take and return fp32 fold
state. The kernels we have take whole problems, so this path cuts the work differently: each rank
computes a few **runs** of consecutive query blocks, each run in one kernel call against the key
prefix that run needs (causal: keys [0, run end), the kernel's bottom-right alignment putting the
diagonal where it belongs; full: every key). A query row is then computed by exactly one call, with
the same key tiles in the same order as on one GPU, so the forward's output and LSE are bitwise
those of a single-GPU call whatever the number of ranks. The backward call of a run gives that run's
complete dQ and a partial dK/dV over the run's key prefix; the partials of each key block are summed
by its owner in fp32, in ascending rank order.

Runs (``plan``): causal attention on the contiguous layout splits the query blocks into P runs of
equal work (a block's work is its count of key tiles), run r on rank r; run r then starts inside or
after rank r's own chunk, and the rows it takes from rank r+1 are DistFlashAttn's helper-worker
balance at run granularity. The zigzag layout (and full attention on either) computes each rank's
own blocks, which is balanced already. Every run is split where its key prefix stops being local,
so a rank can compute what it holds while the rest arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache, wraps

import numpy as np

from .distributed import G, block_owners, block_runs, check_seqlen, local_blocks

__all__ = ["RunPlan", "plan", "validate", "simulate"]


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


@dataclass(frozen=True)
class RunSim:
    compute_ms: tuple[float, ...]    # per rank, forward + backward kernel time
    comm_ms: tuple[float, ...]       # per rank, exposed communication and the runtime's memory passes
    time_ms: float                   # the slowest rank
    single_ms: float                 # one GPU, whole sequence
    efficiency: float                # single / (P * time)


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, layout: str = "contiguous", batch: int = 1,
             heads: int = 16, heads_kv: int = 16, headdim: int = 128, fwd_tflops: float = 650.0,
             bwd_tflops: float = 500.0, beta_gbs: float = 350.0, alpha_us: float = 15.0,
             hbm_gbs: float = 3000.0, launch_us: float = 20.0) -> RunSim:
    """Estimate of one forward + backward on the run plan (the non-deterministic mode).

    Per rank: kernel time from its tile count at the kernels' rates (``fwd_tflops``; the backward's
    2.5x the forward's FLOPs at ``bwd_tflops``); the wait for remote inputs before its first remote
    run, less the compute of its local runs (α + bytes/β, sends and receives concurrent); after its
    last call, the results and dK/dV partials exchange (the larger direction); and the
    runtime's own memory passes at ``hbm_gbs``: sequence-major copies of K and V, output and dQ
    placement, the fp32 dK/dV sums (zeroing, one read-add-write per partial, the final cast)."""
    p = plan(num_ranks, seqlen, causal, layout)
    tile_flops = 4.0 * G * G * headdim * heads * batch          # QK^T and PV of one tile
    row = batch * G * headdim * 2                               # bytes of one block of one head
    t_fwd = tile_flops / (fwd_tflops * 1e12)
    t_bwd = 2.5 * tile_flops / (bwd_tflops * 1e12)
    n_local = p.num_blocks // num_ranks

    def msg(nbytes: float) -> float:
        return alpha_us * 1e-6 + nbytes / (beta_gbs * 1e9) if nbytes else 0.0

    comp, comm = [], []
    for r in range(num_ranks):
        peers = [q for q in range(num_ranks) if q != r]
        calls = len(p.runs[r])
        c = p.tiles(r) * (t_fwd + t_bwd) + 2 * calls * launch_us * 1e-6
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
        mem = passes / (hbm_gbs * 1e9)
        comp.append(c * 1e3)
        comm.append((exposed_in + fwd_out + bwd_out + mem) * 1e3)
    nb = p.num_blocks
    all_tiles = nb * (nb + 1) // 2 if causal else nb * nb
    single = all_tiles * (t_fwd + t_bwd) * 1e3
    time = max(c + m for c, m in zip(comp, comm))
    return RunSim(tuple(comp), tuple(comm), time, single, single / (num_ranks * time))


def main(argv=None) -> int:
    """``python -m dash_fa3.schedule.cp_runs``: the run plan's predicted efficiency per P and length."""
    import argparse

    from .distributed import _heads_pair, _int_list

    ap = argparse.ArgumentParser(prog="python -m dash_fa3.schedule.cp_runs", description=main.__doc__)
    ap.add_argument("--P", type=_int_list, default=[2, 3, 4, 8])
    ap.add_argument("--seqlen", type=_int_list, default=[128 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024])
    ap.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    ap.add_argument("--full", action="store_true", help="full attention instead of causal")
    ap.add_argument("--heads", type=_heads_pair, default="32/8", help="heads/heads_kv")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--fwd-tflops", type=float, default=650.0)
    ap.add_argument("--bwd-tflops", type=float, default=500.0)
    ap.add_argument("--beta-gbs", type=float, default=350.0)
    ap.add_argument("--hbm-gbs", type=float, default=3000.0)
    args = ap.parse_args(argv)
    heads, heads_kv = args.heads
    print(f"run plan, {args.layout}, {'full' if args.full else 'causal'}, heads {heads}/{heads_kv}, hdim "
          f"{args.headdim}: predicted forward+backward efficiency T1 / (P * T_P) (model, not a measurement)")
    print("| P | " + " | ".join(f"{n // 1024}k" for n in args.seqlen) + " |")
    print("|---|" + "---|" * len(args.seqlen))
    for P in args.P:
        cells = []
        for n in args.seqlen:
            try:
                r = simulate(P, n, causal=not args.full, layout=args.layout, heads=heads, heads_kv=heads_kv,
                             headdim=args.headdim, fwd_tflops=args.fwd_tflops, bwd_tflops=args.bwd_tflops,
                             beta_gbs=args.beta_gbs, hbm_gbs=args.hbm_gbs)
                cells.append(f"{r.efficiency:.3f}")
            except ValueError:
                cells.append("n/a")
        print(f"| {P} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
