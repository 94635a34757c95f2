"""Bitwise repeatability of the deterministic backward over many runs (issue 15's third bar).

    python benchmarks/repeat_det.py [--runs 1000] [--hdim 128] [--shape 2,2048,2048,16,4] [--json out.json]
    python benchmarks/repeat_det.py --dry-run      # CPU: print what would run

Fresh random bf16 inputs (causal, GQA by default: 16 query heads on 4 KV
heads), then `--runs` rounds; each round runs `flash_attn_func` and its backward
(the path a training step takes) once per schedule (every deterministic
schedule, `auto`, and the non-deterministic mode last), in that order, so each
schedule's runs see the GPU busy with the others'. Every deterministic result is compared bit for bit with that
schedule's first result (dQ, dK, dV); the caching allocator is filled with NaN
every `--poison-every` rounds, so a gradient element left unwritten would show.
Printed per schedule: runs, runs whose bits differ from the first, and a
SHA-256 of the first result's bits. The non-deterministic mode is not expected
to repeat: its count of differing runs says whether this shape exercises the
order of the dQ adds at all (if it repeats too, the shape proves little).
Exit status 1 if any deterministic schedule differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dash_fa3.schedule import SCHEDULES  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--shape", default="2,2048,2048,16,4", help="batch,seqlen_q,seqlen_k,heads,heads_kv")
    ap.add_argument("--full", action="store_true", help="no causal mask")
    ap.add_argument("--schedules", default=",".join(SCHEDULES + ("auto",)))
    ap.add_argument("--poison-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    args.shape = tuple(int(x) for x in args.shape.split(","))
    if len(args.shape) != 5 or args.shape[3] % args.shape[4]:
        ap.error("--shape is batch,seqlen_q,seqlen_k,heads,heads_kv with heads a multiple of heads_kv")
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in args.schedules if s not in SCHEDULES + ("auto",)]
    if unknown:
        ap.error(f"unknown schedules {unknown}; known: {', '.join(SCHEDULES)}, auto")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    return args


def bits_digest(tensors) -> str:
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    args = parse_args(argv)
    b, sq, sk, h, hkv = args.shape
    modes = [(s, True) for s in args.schedules] + [("nd", False)]
    causal = not args.full
    print(f"shape b{b} {sq}x{sk} h{h}/{hkv} d{args.hdim} {'causal' if causal else 'full'} bf16, "
          f"{args.runs} rounds of: {', '.join(m for m, _ in modes)}")
    if args.dry_run:
        return 0

    import torch

    import dash_fa3
    from dash_fa3._timing import commit_label

    g = torch.Generator(device="cuda").manual_seed(args.seed)

    def randn(*shape):
        return torch.randn(*shape, args.hdim, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, dout = randn(b, sq, h), randn(b, sk, hkv), randn(b, sk, hkv), randn(b, sq, h)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def backward(schedule, deterministic):
        out = dash_fa3.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic,
                                       **({"schedule": schedule} if deterministic else {}))
        out = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(out, (q, k, v), dout)

    def poison():
        # Freed blocks go back to the caching allocator full of NaN.
        free, _ = torch.cuda.mem_get_info()
        n = min(free // 4, 1 << 30) // 4
        torch.empty(n, device="cuda", dtype=torch.float32).fill_(float("nan"))

    first = {}
    differ = {m: 0 for m, _ in modes}
    for r in range(args.runs):
        if r % args.poison_every == 0:
            poison()
        for m, det in modes:
            gs = backward(m, det)
            if m not in first:
                first[m] = gs
                if not all(torch.isfinite(t).all() for t in gs):
                    print(f"{m}: non-finite gradients in the first run")
                    differ[m] += 1
            elif not all(torch.equal(a, c) for a, c in zip(gs, first[m])):
                differ[m] += 1
    torch.cuda.synchronize()

    rows = []
    print(f"\ndevice {torch.cuda.get_device_name()}, torch {torch.__version__}, commit {commit_label()}\n")
    print("| mode | runs | differing from the first | SHA-256 of the first (16 hex) |")
    print("|---|---|---|---|")
    for m, det in modes:
        digest = bits_digest(first[m])
        print(f"| {'det ' + m if det else 'nd'} | {args.runs} | {differ[m]} | {digest} |")
        rows.append({"mode": m, "deterministic": det, "runs": args.runs, "differing": differ[m],
                     "first_sha256_16": digest})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "hdim": args.hdim, "causal": causal, "commit": commit_label(),
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    bad = [m for m, det in modes if det and differ[m]]
    if bad:
        print(f"NOT bitwise repeatable: {', '.join(bad)}")
        return 1
    print("every deterministic schedule repeated bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
