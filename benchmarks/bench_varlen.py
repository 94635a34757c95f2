"""Packed documents, ours against FlashAttention-3's varlen functions (issue 17's varlen bar), one process.

A packed batch of --tokens tokens (default 16k) cut into documents of a fixed-seed long-tailed
mix of lengths (log-uniform from --min to --max tokens, the last one trimmed to fit), heads =
2048 / hdim, bf16, causal. Per mix: our forward (``fwd_varlen``), our backward non-deterministic
and deterministic (``auto``: ``lpt`` / ``spt`` merged over the documents) and FA3's forward and
both backward modes, interleaved in rounds (median of per-round CUDA-event medians;
``bench_peers.time_point``). FA3 must be built with varlen:
``python benchmarks/peers/build_fa3.py --src PATH --hdims 128 --features varlen``.

    python benchmarks/bench_varlen.py --hdim 128 --seeds 0,1,2 --commit <sha>
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_peers  # noqa: E402
from peers import fa3 as fa3_peer  # noqa: E402

from dash_fa3 import _ext, ops  # noqa: E402


def document_mix(tokens: int, shortest: int, longest: int, seed: int) -> list[int]:
    """Document lengths summing to ``tokens``: log-uniform in [shortest, longest], the last trimmed."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        n = int(round(math.exp(rng.uniform(math.log(shortest), math.log(longest)))))
        lengths.append(min(n, tokens - sum(lengths)))
    return lengths


def cu_seqlens(lengths) -> torch.Tensor:
    """The documents' offsets (FA3's ``cu_seqlens``: 0, then the running sums) as int32 on the GPU."""
    return torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32, device="cuda")


def causal_entries(lengths) -> int:
    """Score entries a causal mask keeps, summed over the documents (the FLOP count's pair count)."""
    return sum(n * (n + 1) // 2 for n in lengths)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--min", type=int, default=64, dest="shortest")
    ap.add_argument("--max", type=int, default=8192, dest="longest")
    ap.add_argument("--seeds", default="0", help="comma-separated mix seeds")
    ap.add_argument("--hdim", type=int, default=128)
    bench_peers.add_pair_arguments(ap)
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not (1 <= args.shortest <= args.longest):
        ap.error("need 1 <= --min <= --max")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    heads = 2048 // args.hdim
    fa3 = bench_peers.pair_table_start(
        "bench_varlen", "packed documents",
        f"{args.tokens} tokens, lengths log-uniform {args.shortest}..{args.longest}, {heads} heads, hdim {args.hdim}, "
        f"bf16, causal; TFLOP/s over the documents' causal entries (fwd 4*h*d per entry, bwd 2.5x)",
        ["seed", "documents", "longest"], args)
    if fa3 is None:
        return 2
    for seed in args.seeds:
        lengths = document_mix(args.tokens, args.shortest, args.longest, seed)
        cu = cu_seqlens(lengths)
        longest = max(lengths)
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, dout = (torch.randn(args.tokens, heads, args.hdim, device="cuda", dtype=torch.bfloat16,
                                     generator=g) for _ in range(4))
        scale = args.hdim ** -0.5

        def ours_fwd():
            return _ext.ops().fwd_varlen(q, k, v, cu, cu, longest, longest, scale, -1, 0, 0.0, 0)

        def ours_bwd(det):
            return ops._bwd_general_cuda(dout, q, k, v, out, lse, cu, cu, longest, longest, scale, -1, 0, 0.0, det,
                                         "auto", 0)

        out, lse = ours_fwd()
        docs = (cu, cu, longest, longest)
        f_out, f_lse = fa3_peer.forward(fa3, q, k, v, True, scale, docs=docs)
        dq = ours_bwd(False)[0]
        f_dq = fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, True, False, scale, docs=docs)[0]
        diffs = [bench_peers.rel_diff(a, b) for a, b in ((out, f_out), (dq, f_dq))]
        fns = {
            "ours fwd": ours_fwd,
            "FA3 fwd": lambda: fa3_peer.forward(fa3, q, k, v, True, scale, docs=docs),
            "ours nd": lambda: ours_bwd(False),
            "FA3 nd": lambda: fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, True, False, scale, docs=docs),
            "ours det": lambda: ours_bwd(True),
            "FA3 det": lambda: fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, True, True, scale, docs=docs),
        }
        fwd_flops = 4.0 * heads * args.hdim * causal_entries(lengths)
        print(f"| {seed} | {len(lengths)} | {longest} | {bench_peers.pair_cells(fns, fwd_flops, diffs, args)} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
