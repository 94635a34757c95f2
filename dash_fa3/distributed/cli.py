"""``python -m dash_fa3.distributed plan``: the plan model of every algorithm in one CLI.

For each algorithm named (``--algorithm heads,runs,folds,superblocks``), each rank count and each global length,
it builds and validates the plan, then prints the model's forward + backward time, one GPU's time
for the same kernels and the efficiency T1 / (P * TP): a table, or one JSON object per line. Cost
parameters left unset take each algorithm's defaults (``heads.DEFAULT_COST``, ``runs.DEFAULT_COST``,
``folds.DEFAULT_COST``, ``superblocks.DEFAULT_COST``). Every argument is checked first: a bad one ends with exit status 2 and one
line.
"""

from __future__ import annotations

import argparse
import json
import sys

from .._cli import OneLineParser, bounded_float, bounded_int, headdim
from . import folds, heads, runs, superblocks
from .layout import LAYOUTS, G, check_seqlen
from .model import ALGORITHMS, COST_FIELDS

# Sizes the models take: beyond them the plans' tables grow past what a CLI should allocate.
MAX_RANKS = 64
MAX_SEQLEN = 1 << 22                  # tokens
MAX_FOLD_TOKENS_X_RANKS = 64 << 20    # the fold schedules' tables grow with P times the blocks
MAX_HEADS = 1024
MAX_BATCH = 1024
MAX_RATE = 1e6                        # TFLOP/s and GB/s
MAX_DELAY_US = 1e7
COST_HELP = {"fwd_tflops": "forward kernel TFLOP/s", "bwd_tflops": "backward kernel TFLOP/s (2.5x the forward's FLOPs)",
             "alpha_us": "per-message latency, us", "beta_gbs": "bandwidth per direction per rank, GB/s",
             "hbm_gbs": "memory bandwidth of the runtime's copies, GB/s",
             "launch_us": "overhead per kernel call (heads, runs) or step (folds), us",
             "diag": "a causal diagonal tile's cost relative to a full one (folds)"}
COST_TYPES = {"fwd_tflops": bounded_float(0, MAX_RATE, strict=True), "bwd_tflops": bounded_float(0, MAX_RATE, strict=True),
              "beta_gbs": bounded_float(0, MAX_RATE, strict=True), "hbm_gbs": bounded_float(0, MAX_RATE, strict=True),
              "alpha_us": bounded_float(0, MAX_DELAY_US), "launch_us": bounded_float(0, MAX_DELAY_US),
              "diag": bounded_float(0, 1)}


def heads_pair(text: str) -> tuple[int, int]:
    """'32/8' -> (32, 8); '16' -> (16, 16): the CLI's --heads."""
    h, _, hk = text.partition("/")
    hk = hk or h
    if not (h.strip().isdigit() and hk.strip().isdigit()) or int(h) < 1 or int(hk) < 1:
        raise argparse.ArgumentTypeError(f"expected heads as H or H/H_KV (positive ints), got {text!r}")
    h, hk = int(h), int(hk)
    if h > MAX_HEADS:
        raise argparse.ArgumentTypeError(f"at most {MAX_HEADS} heads, got {h}")
    if h % hk:
        raise argparse.ArgumentTypeError(f"heads ({h}) must be a multiple of heads_kv ({hk})")
    return h, hk


def int_list(text: str) -> list[int]:
    """'8' or '2,4,8' or '64k,1m' (k = 1024, m = 1048576)."""
    vals = []
    for x in (t.strip().lower() for t in text.split(",")):
        mult = {"k": 1024, "m": 1048576}.get(x[-1:], 1)
        digits = x[:-1] if mult > 1 else x
        if not digits.isdigit() or int(digits) < 1 or len(digits) > 12:
            raise argparse.ArgumentTypeError(f"expected a comma list of positive ints (64k, 1m allowed), got {text!r}")
        vals.append(int(digits) * mult)
    return vals


def _parser() -> OneLineParser:
    p = OneLineParser(prog="python -m dash_fa3.distributed",
                      description="Context parallelism's plan models. Subcommand: plan.")
    sub = p.add_subparsers(dest="command", required=True, metavar="plan", parser_class=OneLineParser)
    a = sub.add_parser("plan", help="build, validate and model the plans of the algorithms",
                       description="Predicted forward + backward time and efficiency T1/(P*TP) of each "
                                   "algorithm's plan (a model, not a measurement).")
    a.add_argument("--algorithm", default=",".join(ALGORITHMS),
                   help=f"comma list of {', '.join(ALGORITHMS)} (default: all)")
    a.add_argument("--P", type=int_list, default=[2, 4, 8], help=f"rank counts, comma list, at most {MAX_RANKS}")
    a.add_argument("--seqlen", type=int_list, default=[65536, 131072, 1048576],
                   help=f"global lengths, comma list; 64k = 65536, 1m = 1048576; at most {MAX_SEQLEN}")
    mask = a.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True, help="causal mask (default)")
    mask.add_argument("--full", dest="causal", action="store_false", help="no mask")
    a.add_argument("--layout", default=None, choices=LAYOUTS,
                   help="heads and runs: the token layout (default: both); folds name theirs by --schedule")
    a.add_argument("--schedule", default="helper_worker,zigzag",
                   help=f"folds: comma list of {', '.join(folds.PRESETS)}, or all")
    a.add_argument("--heads", type=heads_pair, default=(16, 16), help="H or H/H_KV (default 16)")
    a.add_argument("--headdim", type=headdim, default=128, help="a head dim the kernels have (default 128)")
    a.add_argument("--batch", type=bounded_int(1, MAX_BATCH), default=1)
    a.add_argument("--dtype-bytes", type=bounded_int(1, 8), default=2)
    a.add_argument("--chunks", type=bounded_int(1, 1024), default=1, help="heads: chunks of each rank's heads")
    a.add_argument("--superblock", type=bounded_int(G, MAX_SEQLEN), default=superblocks.SUPERBLOCK,
                   help=f"superblocks: S in tokens, a multiple of {G} (default {superblocks.SUPERBLOCK})")
    a.add_argument("--fanout", type=bounded_int(0, MAX_RANKS), default=folds.DEFAULT_FANOUT,
                   help="folds: copies one holder sends per step before relays take over; 0: the owner sends all")
    for f in COST_FIELDS:
        a.add_argument("--" + f.replace("_", "-"), type=COST_TYPES[f], default=None,
                       help=f"{COST_HELP[f]} (default: the algorithm's)")
    a.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def _check(p: OneLineParser, args) -> list[str]:
    names = [x.strip() for x in args.algorithm.split(",") if x.strip()]
    for n in names or [""]:
        if n not in ALGORITHMS:
            p.error(f"unknown algorithm {n!r}; choose from {', '.join(ALGORITHMS)}")
    args.schedules = (list(folds.PRESETS) if args.schedule == "all"
                      else [x.strip() for x in args.schedule.split(",") if x.strip()])
    for s in args.schedules or [""]:
        if s not in folds.PRESETS:
            p.error(f"unknown schedule {s!r}; choose from {', '.join(folds.PRESETS)} or all")
    for P in args.P:
        if P > MAX_RANKS:
            p.error(f"--P {P}: the models are meant for P <= {MAX_RANKS}")
        for n in args.seqlen:
            if n > MAX_SEQLEN:
                p.error(f"--seqlen {n}: the models take at most {MAX_SEQLEN} tokens")
            if "folds" in names and n * P > MAX_FOLD_TOKENS_X_RANKS:
                p.error(f"--seqlen {n} at --P {P}: the fold schedules' tables take P x tokens <= "
                        f"{MAX_FOLD_TOKENS_X_RANKS} (e.g. 1m tokens at P = 64)")
            try:
                check_seqlen(n, P)
            except ValueError as e:
                p.error(str(e))
    if args.superblock % G:
        p.error(f"--superblock {args.superblock}: a multiple of {G} tokens")
    if "heads" in names and args.heads[1] < max(args.P):
        p.error(f"--heads {args.heads[0]}/{args.heads[1]}: the head-parallel algorithm needs heads_kv >= P "
                f"(P up to {max(args.P)})")
    return names


def _rows(name: str, args, P: int, n: int, costs: dict):
    h, hk = args.heads
    shape = dict(causal=args.causal, heads=h, heads_kv=hk, headdim=args.headdim, batch=args.batch)
    if name == "folds":
        fshape = folds.Shape(args.batch, h, hk, args.headdim, args.dtype_bytes)
        for s in args.schedules:
            yield folds.simulate(P, n, causal=args.causal, schedule=s, shape=fshape, fanout=args.fanout or None,
                                 **costs)
        return
    for layout in [args.layout] if args.layout else LAYOUTS:
        if name == "heads":
            yield heads.simulate(P, n, layout=layout, chunks=args.chunks, elem_bytes=args.dtype_bytes, **shape,
                                 **costs)
        elif name == "superblocks":
            yield superblocks.simulate(P, n, layout=layout, superblock=args.superblock, **shape, **costs)
        else:
            yield runs.simulate(P, n, layout=layout, **shape, **costs)


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    names = _check(p, args)
    costs = {f: getattr(args, f) for f in COST_FIELDS if getattr(args, f) is not None}
    if not args.json:
        h, hk = args.heads
        print(f"{'causal' if args.causal else 'full'}, heads {h}/{hk}, hdim {args.headdim}, batch {args.batch}: "
              f"predicted forward + backward (a model, not a measurement)")
        print("| algorithm | plan | P | tokens | ms | 1-GPU ms | efficiency |")
        print("|---|---|---|---|---|---|---|")
    for name in names:
        for n in args.seqlen:
            for P in args.P:
                for r in _rows(name, args, P, n, costs):
                    if args.json:
                        print(json.dumps(r.as_dict()))
                    else:
                        print(f"| {name} | {r.variant} | {P} | {n} | {r.time_ms:.3f} | {r.single_ms:.3f} | "
                              f"{r.efficiency:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
