"""One forward or backward call of ours, FA3's or FA4's at one grid point, between
cudaProfilerStart/Stop, for Nsight Compute (`benchmarks/peers/ncu_peers.sh` drives it):

    ncu --profile-from-start off ... python benchmarks/peers/profile_call.py IMPL HDIM MASK SEQLEN [--direction fwd|bwd]

IMPL is `ours` (the backward non-deterministic), `ours-det:SCHEDULE`, `fa3` /
`fa3-det` or `fa4` / `fa4-det` (the deterministic ones: backward only; FA4 is the
`flash-attn-4` package, peers/fa4.py).
The shape is the grid's (bench_grid.json: 16384 tokens, hidden 2048, bf16).
Two warm-up calls run before the profiled one, so ncu sees a steady state
(cached schedule, loaded module); only the profiled call lies inside the
profiler range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (dash_fa3 built in place)
import fa3 as fa3_peer  # noqa: E402
import fa4 as fa4_peer  # noqa: E402

GRID_TOKENS = 16384
GRID_HIDDEN = 2048


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("impl")
    ap.add_argument("hdim", type=int)
    ap.add_argument("mask", choices=("full", "causal"))
    ap.add_argument("seqlen", type=int)
    ap.add_argument("--direction", choices=("bwd", "fwd"), default="bwd")
    ap.add_argument("--fa3-build", default=str(fa3_peer.DEFAULT_BUILD_DIR))
    args = ap.parse_args(argv)
    if args.direction == "fwd" and args.impl not in ("ours", "fa3", "fa4"):
        ap.error(f"the forward has no deterministic mode: IMPL must be ours, fa3 or fa4, got {args.impl!r}")

    causal = args.mask == "causal"
    shape = (GRID_TOKENS // args.seqlen, args.seqlen, GRID_HIDDEN // args.hdim, args.hdim)
    g = torch.Generator(device="cuda").manual_seed(args.hdim * 7 + args.seqlen)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    scale = args.hdim ** -0.5

    if args.direction == "fwd":
        if args.impl == "fa3":
            fa3 = fa3_peer.load_fa3(args.fa3_build)

            def call():
                return fa3_peer.forward(fa3, q, k, v, causal, scale)
        elif args.impl == "fa4":
            fa4 = fa4_peer.load_fa4()

            def call():
                return fa4_peer.forward(fa4, q, k, v, causal, scale)
        else:
            from dash_fa3 import ops

            def call():
                return ops.fwd(q, k, v, scale, causal, 0)
    elif args.impl.startswith("fa3"):
        fa3 = fa3_peer.load_fa3(args.fa3_build)
        call = fa3_peer.backward_fn(fa3, q, k, v, dout, causal, args.impl == "fa3-det", preallocate=True)
    elif args.impl in ("fa4", "fa4-det"):
        call = fa4_peer.backward_fn(fa4_peer.load_fa4(), q, k, v, dout, causal, args.impl == "fa4-det")
    elif args.impl == "ours" or args.impl.startswith("ours-det:"):
        from dash_fa3 import ops

        det = args.impl != "ours"
        schedule = args.impl.split(":", 1)[1] if det else "auto"
        out, lse = ops.fwd(q, k, v, scale, causal, 0)

        def call():
            return ops.bwd(dout, q, k, v, out, lse, scale, causal, det, schedule, 0)
    else:
        ap.error(f"unknown impl {args.impl!r}")

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.impl} {args.direction} hdim {args.hdim} {args.mask} {args.seqlen}: shape {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
