"""Forward / backward TFLOP/s on the paper's grid (dash_fa3/schedule/bench_grid.json, a
copy of the project's shared grid), for dash_fa3 and torch SDPA's flash and
cuDNN backends in the same process.

    python benchmarks/bench_grid.py --direction fwd [--hdims 64 128] [--seqlens ...] [--json out.json]

Method: bf16 random normal inputs, CUDA-event medians after warm-up. With
--timer gpu (the default) a device-side wait is queued before each sample, so
a sample is the GPU time of one call (its kernels and the gaps between them);
--timer eager leaves it out, so a sample also counts the host time spent
before the first kernel starts. --host adds each call's host time (us). Each grid
point holds 16384 tokens x hidden 2048, so q, k, v are 64 MiB each, larger than
L2: no input rotation is needed. FLOPs: fwd = 4*b*h*s^2*d (halved when causal),
bwd = 2.5x fwd. The backward timing covers preprocess + main + postprocess.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dash_fa3 import ops  # noqa: E402
from dash_fa3._timing import attention_flops, commit_label, host_us, median_ms  # noqa: E402

GRID = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dash_fa3", "schedule",
                    "bench_grid.json")
PEERS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def dash_fn(q, k, v, causal, direction, deterministic=False, schedule="auto"):
    scale = q.shape[-1] ** -0.5
    if direction == "fwd":
        return lambda: ops.fwd(q, k, v, scale, causal, 0)
    out, lse = ops.fwd(q, k, v, scale, causal, 0)
    dout = torch.randn_like(out)
    return lambda: ops.bwd(dout, q, k, v, out, lse, scale, causal, deterministic, schedule, 0)


def peer_fn(backend, q, k, v, causal, direction):
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(direction == "bwd") for t in (q, k, v))

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    if direction == "fwd":
        return fwd
    out = fwd()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)


def main(argv=None) -> int:
    grid = json.load(open(GRID))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direction", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--hdims", type=int, nargs="+", default=grid["headdims"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=grid["seqlens"])
    ap.add_argument("--masks", nargs="+", default=grid["masks"])
    ap.add_argument("--peers", default="sdpa-flash,cudnn", help="comma list of " + ",".join(PEERS) + " or ''")
    ap.add_argument("--schedules", default="fa3,spt,descending,shift,symmetric_shift",
                    help="bwd: deterministic schedules to time besides the non-deterministic kernel")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--inner", type=int, default=1,
                    help="calls per timed sample (back to back; 1 = each sample also counts the call's host time)")
    ap.add_argument("--timer", choices=["gpu", "eager"], default="gpu",
                    help="gpu: a queued device wait hides the call's host time; eager: samples count it")
    ap.add_argument("--host", action="store_true", help="also print each call's host time in us")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    peers = [p for p in args.peers.split(",") if p]
    device = torch.cuda.get_device_name()
    commit = commit_label()
    date = datetime.date.today().isoformat()
    det = [f"det-{x}" for x in args.schedules.split(",") if x] if args.direction == "bwd" else []
    cols = ["dash_fa3"] + det + peers
    shown = cols + ([c + " host us" for c in cols] if args.host else [])
    print(f"# {args.direction} TFLOP/s, {device}, {date}, commit {commit or 'unknown'}, bf16, "
          f"{args.inner} call(s) per timed sample, timer {args.timer}"
          + ("; dash_fa3 = non-deterministic (task order auto = lpt), det-X = deterministic with schedule X" if det else ""))
    print("| hdim | mask | seqlen | " + " | ".join(shown) + " |")
    print("|---|---|---|" + "---|" * len(shown))
    rows = []
    for d in args.hdims:
        for mask in args.masks:
            causal = mask == "causal"
            for s in args.seqlens:
                b, h = grid["total_tokens"] // s, grid["hidden"] // d
                g = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                flops = attention_flops(b, h, s, s, d, causal, args.direction)
                row = {"hdim": d, "mask": mask, "seqlen": s, "batch": b, "heads": h}
                fns = {"dash_fa3": lambda: dash_fn(q, k, v, causal, args.direction)}
                fns.update({c: (lambda c=c: dash_fn(q, k, v, causal, "bwd", True, c[4:])) for c in det})
                fns.update({p: (lambda p=p: peer_fn(PEERS[p], q, k, v, causal, args.direction)) for p in peers})
                for name, make in fns.items():
                    try:
                        fn = make()
                        ms = median_ms(fn, warmup=5, iters=args.iters, inner=args.inner,
                                       hide_host=args.timer == "gpu")
                        row[name] = flops / ms / 1e9
                        if args.host:
                            row[name + " host us"] = host_us(fn)
                    except Exception as exc:  # a peer backend may not support a shape
                        row[name] = row[name + " host us"] = None
                        row[name + "_error"] = str(exc).splitlines()[0][:200]
                rows.append(row)
                cells = [f"{row[c]:.0f}" if row.get(c) is not None else "n/a" for c in shown]
                print(f"| {d} | {mask} | {s} | " + " | ".join(cells) + " |", flush=True)
                del q, k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "date": date, "commit": commit, "direction": args.direction,
                       "timer": args.timer, "inner": args.inner, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
