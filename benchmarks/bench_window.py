"""Sliding-window and softcap attention, ours against FlashAttention-3 (issue 17's window and
softcap bars), one process.

Per configuration (batch 1, hidden 2048 so heads = 2048 / hdim, bf16): our forward (the local
kernel, ``fwd_window``), our backward non-deterministic and deterministic (``auto`` schedule) and
FA3's forward and both backward modes with the same window, interleaved in rounds (median of
per-round CUDA-event medians; ``bench_peers.time_point``). FA3 must be built with windows:
``python benchmarks/peers/build_fa3.py --src PATH --hdims 128 --features local``. ``--softcap``
caps the scores of every configuration (ours: a build with ``DASH_FA3_SOFTCAP=1``; FA3: ``--features
softcap``); the window -1,0 is causal attention (FA3 then runs its causal kernel).

    python benchmarks/bench_window.py --seqlen 16384 --hdim 128 --window 4096,0 --commit <sha>
    python benchmarks/bench_window.py --seqlen 8192 --hdim 128 --window=-1,0 --softcap 30 --commit <sha>
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_peers  # noqa: E402
from peers import fa3 as fa3_peer  # noqa: E402

from dash_fa3 import _ext, ops  # noqa: E402


def parse_window(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (-1 = unbounded), got {text!r}")
    left, right = (int(p) for p in parts)
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"window sides are >= -1, got {text!r}")
    return left, right


def window_entries(seqlen: int, left: int, right: int) -> int:
    """Score entries inside the window (seqlen_q == seqlen_k): the FLOP count's pair count."""
    total = 0
    for i in range(seqlen):
        lo = 0 if left < 0 else max(0, i - left)
        hi = seqlen - 1 if right < 0 else min(seqlen - 1, i + right)
        total += max(0, hi - lo + 1)
    return total


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--window", type=parse_window, action="append")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap of every configuration (0: none)")
    bench_peers.add_pair_arguments(ap)
    args = ap.parse_args(argv)
    args.window = args.window or [(4096, 0)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    heads = 2048 // args.hdim
    fa3 = bench_peers.pair_table_start(
        "bench_window", "sliding windows" + (f", softcap {args.softcap:g}" if args.softcap > 0 else ""),
        f"batch 1, {args.seqlen} tokens, {heads} heads, hdim {args.hdim}, bf16; TFLOP/s over the window's entries "
        f"(fwd 4*h*d per entry, bwd 2.5x)", ["window"], args)
    if fa3 is None:
        return 2
    cap = args.softcap
    for left, right in args.window:
        g = torch.Generator(device="cuda").manual_seed(left * 7 + right)
        q, k, v, dout = (torch.randn(1, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16,
                                     generator=g) for _ in range(4))
        scale = args.hdim ** -0.5
        # FA3 runs (-1, 0) on its causal kernel only when asked for causal.
        causal = (left, right) == (-1, 0)
        fa3_kw = {"window": (-1, -1) if causal else (left, right), "softcap": cap}
        out, lse = _ext.ops().fwd_window(q, k, v, scale, left, right, cap, 0)
        f_out, f_lse = fa3_peer.forward(fa3, q, k, v, causal, scale, **fa3_kw)

        def ours_bwd(deterministic):
            return ops._bwd_cuda_window(dout, q, k, v, out, lse, scale, left, right, cap, deterministic, "auto", 0)

        dq = ours_bwd(False)[0]
        f_dq = fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, causal, False, scale, **fa3_kw)[0]
        diffs = [bench_peers.rel_diff(a, b) for a, b in ((out, f_out), (dq, f_dq))]
        fns = {
            "ours fwd": lambda: _ext.ops().fwd_window(q, k, v, scale, left, right, cap, 0),
            "FA3 fwd": lambda: fa3_peer.forward(fa3, q, k, v, causal, scale, **fa3_kw),
            "ours nd": lambda: ours_bwd(False),
            "FA3 nd": lambda: fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, causal, False, scale, **fa3_kw),
            "ours det": lambda: ours_bwd(True),
            "FA3 det": lambda: fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, causal, True, scale, **fa3_kw),
        }
        fwd_flops = 4.0 * heads * args.hdim * window_entries(args.seqlen, left, right)
        label = f"({left}, {right})" + (f" softcap {cap:g}" if cap > 0 else "")
        print(f"| {label} | {bench_peers.pair_cells(fns, fwd_flops, diffs, args)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
