"""One GPU: what the kernels of a context-parallel rank cost, against the whole problem's (issues 16,
21, 50).

``--algorithm superblocks`` (issue 50): a rank of the superblock algorithm
(dash_fa3/distributed/superblocks.py) runs, per superblock it computes, the forward and the
deterministic backward with fp32 dK/dV over the superblock's key prefix, adds them along its
subtrees, and sums the tree's top for its own keys (the other ranks' subtree values stand in as
buffers of their sizes). T1 is one GPU's deterministic ``flash_attn_func`` forward + backward on
the whole problem. Every call of a rank runs here, on the whole GPU, one rank at a time.

A rank of the head-parallel algorithm (dash_fa3/distributed/heads.py, one chunk) runs the
single-GPU kernels on its KV heads and their query heads over the whole sequence: the forward, and
the backward on the whole problem's schedule restricted to those heads (``ops.bwd_heads_part``).
The rest of its time moves data. This times on one GPU each rank's forward + backward and the
whole problem's (T1, the same ops on every head), interleaved in rounds, and prints

    bound = T1 / (P * max_r T_r),

the efficiency T1 / (P * T_P) would reach if every transfer were free and hidden: the part the
kernels decide. ``steps balance`` is the busiest CTA's steps over the mean (static schedules): the
wave quantization a rank's share of the units leaves.

    python benchmarks/bench_cp_compute.py --P 2,4,8 --tokens 128k --heads 32/8 --modes det,nd
    python benchmarks/bench_cp_compute.py --algorithm superblocks --P 2,4,8 --tokens 128k,256k --heads 32/8,32/1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_distributed import parse_heads, parse_size, size_label  # noqa: E402

from dash_fa3.distributed import heads as cp_heads  # noqa: E402
from dash_fa3.distributed import superblocks as cp_sb  # noqa: E402

HEADDIM = 128
MODES = ("det", "nd")
ALGORITHMS = ("heads", "superblocks")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bench_cp_compute.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--P", default="2,4,8", help="rank counts, comma list")
    ap.add_argument("--tokens", default="128k", help="whole sequence lengths, comma list (k = 1024, m = 1024**2)")
    ap.add_argument("--heads", default="32/8", help="heads/heads_kv, comma list")
    ap.add_argument("--modes", default="det,nd", help="det, nd or both (superblocks: det only)")
    ap.add_argument("--algorithm", default="heads", choices=ALGORITHMS)
    ap.add_argument("--layouts", default="contiguous,zigzag", help="superblocks: token layouts, comma list")
    ap.add_argument("--superblock", type=int, default=cp_sb.SUPERBLOCK, help="superblocks: S in tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2, help="timed calls per item and round (median)")
    ap.add_argument("--out", default=None, help="directory for results.json and results.md")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    args.P = [int(p) for p in args.P.split(",") if p.strip()]
    args.tokens = [parse_size(t) for t in args.tokens.split(",") if t.strip()]
    args.heads = [parse_heads(h) for h in args.heads.split(",") if h.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for m in args.modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if args.algorithm == "superblocks":
        args.modes = ["det"]
        try:
            cp_sb.check_superblock(args.superblock)
            for P in args.P:
                for n in args.tokens:
                    for layout in args.layouts:
                        cp_sb.plan(P, n, True, layout, args.superblock)
        except ValueError as e:
            ap.error(str(e))
        if args.rounds < 1 or args.iters < 1:
            ap.error("--rounds and --iters must be >= 1")
        return args
    for P in args.P:
        if P < 1:
            ap.error(f"P must be >= 1, got {P}")
        for n in args.tokens:
            for h, hk in args.heads:
                try:    # lengths the plan splits, heads_kv >= P
                    cp_heads.plan(P, n, h, hk, "contiguous", 1)
                except ValueError as e:
                    ap.error(f"P={P}, {n} tokens, heads {h}/{hk}: {e}")
    if args.rounds < 1 or args.iters < 1:
        ap.error("--rounds and --iters must be >= 1")
    return args


def items(Ps, heads_kv: int) -> list[tuple]:
    """("T1", 0, kv lo, kv hi) and a (P, rank, kv lo, kv hi) per rank of each P: what one round times."""
    out = [("T1", 0, 0, heads_kv)]
    for P in Ps:
        out += [(P, r, lo, hi) for r, (lo, hi) in enumerate(cp_heads.kv_ranges(heads_kv, P))]
    return out


def bounds(t1: float, per_item: dict, Ps) -> dict:
    """Per P: (max_r T_r, min_r T_r, T1 / (P max_r T_r))."""
    out = {}
    for P in Ps:
        ranks = [ms for (p, _), ms in per_item.items() if p == P]
        out[P] = (max(ranks), min(ranks), t1 / (P * max(ranks)))
    return out


def steps_balance(heads: int, heads_kv: int, n: int, det: bool, lo: int, hi: int, num_sms: int) -> float | None:
    """The busiest CTA's steps over the mean, for the (restricted) static schedule a call runs."""
    import numpy as np

    from dash_fa3.schedule import Geometry, bwd_block_sizes, resolve_schedule_name
    from dash_fa3.schedule.lowering import get_kernel_metadata
    from dash_fa3.schedule.metadata import C_N_STEPS, restrict_heads

    bm, bn = bwd_block_sizes(HEADDIM)
    g = Geometry(batch=1, heads=heads, heads_kv=heads_kv, seqlen_q=n, seqlen_k=n, block_m=bm, block_n=bn,
                 mask="causal", window_left=-1, window_right=0)
    meta = get_kernel_metadata(resolve_schedule_name("auto", g, det, num_sms=num_sms, headdim=HEADDIM), g, num_sms)
    meta = restrict_heads(meta, lo, hi)
    if meta.dynamic:
        return None
    steps = np.add.reduceat(meta.tasks[:, C_N_STEPS].astype(np.int64), meta.offsets[:-1].astype(np.int64))
    return float(steps.max() / steps.mean())


def superblock_rank(sp, rank, t, scale, stand_ins):
    """One rank's calls of the superblock algorithm on the global tensors ``t`` = (q, k, v, dout):
    per superblock the forward and the backward with fp32 dK/dV, its subtrees' adds, then the top
    of the tree for its own keys (``stand_ins``: the other ranks' node values, buffers of their
    sizes). Returns its dk, dv."""
    import torch

    from dash_fa3 import ops
    from dash_fa3.distributed import runs
    from dash_fa3.distributed.layout import G

    q, k, v, dout = t

    def leaf(s):
        lo, hi = sp.blocks(s, s + 1)
        a, b, e = lo * G, hi * G, sp.runs.kv_end(lo, hi) * G
        out, lse = ops.fwd(q[:, a:b], k[:, :e], v[:, :e], scale, True, 0)
        _, dk, dv = ops.bwd_dkv_fp32(dout[:, a:b], q[:, a:b], k[:, :e], v[:, :e], out, lse.contiguous(), scale, True)
        return dk, dv

    def evaluate(lo, hi):
        if hi - lo == 1:
            return leaf(lo)
        mid = cp_sb.split(lo, hi)
        return cp_sb._combine(evaluate(lo, mid), evaluate(mid, hi))

    parts = dict(stand_ins)
    for node in sp.nodes(rank):
        val = evaluate(*node)
        parts[node] = [(lo, hi, tuple(x[:, lo * G:hi * G] for x in val)) for lo, hi in sp.kv_pieces(node, rank)]
    n_local = len(sp.runs.local(rank)) * G
    dk = torch.empty((1, n_local) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    cp_sb._reduce(sp, rank, runs._Blocks(sp.runs, rank), parts, dk, dv)
    return dk, dv


def stand_in_parts(sp, rank, hk, device):
    """Buffers of the sizes the other ranks' node values have over this rank's keys."""
    import torch

    from dash_fa3.distributed.layout import G

    out = {}
    for peer in range(sp.runs.num_ranks):
        if peer == rank:
            continue
        for node in sp.nodes(peer):
            out[node] = [(lo, hi, tuple(torch.ones((1, (hi - lo) * G, hk, HEADDIM), dtype=torch.float32,
                                                   device=device) for _ in range(2)))
                         for lo, hi in sp.kv_pieces(node, rank)]
    return out


def report_memory(key) -> None:
    """What the device holds when ``key``'s calls ran out of memory: the allocator's totals and the
    largest live CUDA tensors (to stderr)."""
    import gc

    import torch

    print(f"out of memory at {key}: allocated {torch.cuda.memory_allocated() / 1e9:.1f} GB, reserved "
          f"{torch.cuda.memory_reserved() / 1e9:.1f} GB, peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB",
          file=sys.stderr)
    live = sorted((o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda),
                  key=lambda t: t.untyped_storage().nbytes(), reverse=True)
    for t in live[:20]:
        print(f"  {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 1e9:.2f} GB", file=sys.stderr)


def main_superblocks(args, meta) -> int:
    import torch

    from dash_fa3 import ops

    dev = torch.device("cuda")
    records = []
    for n in args.tokens:
        for h, hk in args.heads:
            g = torch.Generator(device=dev).manual_seed(n + h)
            q, dout = (torch.randn((1, n, h, HEADDIM), device=dev, generator=g, dtype=torch.bfloat16)
                       for _ in range(2))
            k, v = (torch.randn((1, n, hk, HEADDIM), device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
            scale = 1.0 / math.sqrt(HEADDIM)
            t = (q, k, v, dout)

            def whole():
                out, lse = ops.fwd(q, k, v, scale, True, 0)
                return ops.bwd(dout, q, k, v, out, lse, scale, True, True, "auto", 0)

            work = [("T1", "", 0)] + [(P, layout, r) for P in args.P for layout in args.layouts for r in range(P)]
            # (set-up, timed call): the stand-ins are made outside the timed region
            calls = {("T1", "", 0): (lambda: None, lambda _: whole())}
            for P, layout, r in work[1:]:
                sp = cp_sb.plan(P, n, True, layout, args.superblock)
                calls[(P, layout, r)] = (lambda sp=sp, r=r: stand_in_parts(sp, r, hk, dev),
                                         lambda stand, sp=sp, r=r: superblock_rank(sp, r, t, scale, stand))
            first, times, peak = {}, {key: [] for key in work}, {}
            for rnd in range(args.rounds):
                order = work[rnd % len(work):] + work[:rnd % len(work)]
                for key in order:
                    prep, run = calls[key]
                    torch.cuda.reset_peak_memory_stats()
                    try:
                        stand = prep()
                        if key[0] == "T1" and key in first:
                            run(stand)   # its schedule was dropped below: rebuilt outside the timed calls
                        if key not in first:
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            run(stand)
                            torch.cuda.synchronize()
                            first[key] = time.perf_counter() - t0
                        for _ in range(args.iters):
                            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            a.record()
                            run(stand)
                            b.record()
                            torch.cuda.synchronize()
                            times[key].append(a.elapsed_time(b))
                    except torch.OutOfMemoryError:
                        report_memory(key)
                        raise
                    del stand
                    peak[key] = max(peak.get(key, 0), torch.cuda.max_memory_allocated())
                    if key[0] == "T1":
                        # the whole problem's schedule would stay cached beside the superblocks'
                        # (hundreds of MB each at 256k tokens); the ranks' calls share theirs
                        ops._bwd_plan.cache_clear()
                    torch.cuda.empty_cache()
            med = {key: statistics.median(ts) for key, ts in times.items()}
            t1 = med[("T1", "", 0)]
            rec_peak = max(v for key, v in peak.items() if key[0] != "T1") / 1e9
            print(f"\n## superblocks (S = {args.superblock}), {size_label(n)} tokens, heads {h}/{hk}, det: "
                  f"T1 {t1:.1f} ms", flush=True)
            print(f"(peak memory: T1 {peak[('T1', '', 0)] / 1e9:.1f} GB, a rank's calls up to {rec_peak:.1f} GB)")
            print("| P | layout | max_r T_r (ms) | min_r T_r (ms) | T1 / (P max_r T_r) | predicted (model) |")
            print("|---|---|---|---|---|---|")
            rec = {"algorithm": "superblocks", "superblock": args.superblock, "tokens": n, "heads": h,
                   "heads_kv": hk, "mode": "det", "t1_ms": t1, "t1_peak_gb": peak[("T1", "", 0)] / 1e9,
                   "rank_peak_gb": rec_peak, "ranks": [], "bound": {}}
            for P in args.P:
                for layout in args.layouts:
                    ms = [med[(P, layout, r)] for r in range(P)]
                    bound = t1 / (P * max(ms))
                    est = cp_sb.simulate(P, n, causal=True, layout=layout, heads=h, heads_kv=hk, headdim=HEADDIM,
                                         superblock=args.superblock)
                    rec["ranks"] += [{"P": P, "layout": layout, "rank": r, "ms": m, "peak_gb": peak[(P, layout, r)] / 1e9}
                                     for r, m in enumerate(ms)]
                    rec["bound"][f"{P} {layout}"] = {"max_ms": max(ms), "min_ms": min(ms), "bound": bound,
                                                     "predicted_efficiency": est.efficiency}
                    print(f"| {P} | {layout} | {max(ms):.1f} | {min(ms):.1f} | {bound:.3f} | {est.efficiency:.3f} |",
                          flush=True)
            records.append(rec)
            del q, k, v, dout, t
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from dash_fa3 import ops

    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "commit": args.commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sms": num_sms}
    print(f"# bench_cp_compute: {meta['device']}, {meta['date']}, commit {args.commit}, torch {meta['torch']}; "
          f"causal, hdim {HEADDIM}, bf16, batch 1; fwd + bwd per call; CUDA-event medians, "
          f"{args.rounds} interleaved rounds x {args.iters} calls", flush=True)
    if args.algorithm == "superblocks":
        return main_superblocks(args, meta)
    records = []
    for n in args.tokens:
        for h, hk in args.heads:
            g = torch.Generator(device=dev).manual_seed(n + h)
            q, dout = (torch.randn((1, n, h, HEADDIM), device=dev, generator=g, dtype=torch.bfloat16)
                       for _ in range(2))
            k, v = (torch.randn((1, n, hk, HEADDIM), device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
            scale = 1.0 / math.sqrt(HEADDIM)
            grp = h // hk
            work = items(args.P, hk)
            views = {}
            for P, r, lo, hi in work:
                views[(P, r)] = tuple(x[:, :, a * m:b * m].contiguous() for x, a, b, m in
                                      ((q, lo, hi, grp), (k, lo, hi, 1), (v, lo, hi, 1), (dout, lo, hi, grp)))
            for mode in args.modes:
                det = mode == "det"

                def call(key, lo):
                    qq, kk, vv, dd = views[key]
                    out, lse = ops.fwd(qq, kk, vv, scale, True, 0)
                    return ops.bwd_heads_part(dd, qq, kk, vv, out, lse.contiguous(), scale, True, det, h, hk, lo)

                first, times = {}, {(P, r): [] for P, r, _, _ in work}
                for rnd in range(args.rounds):
                    order = work[rnd % len(work):] + work[:rnd % len(work)]
                    for P, r, lo, hi in order:
                        if (P, r) not in first:          # the plan is built here: host time of a first call
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            call((P, r), lo)
                            torch.cuda.synchronize()
                            first[(P, r)] = time.perf_counter() - t0
                        for _ in range(args.iters):
                            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            a.record()
                            call((P, r), lo)
                            b.record()
                            torch.cuda.synchronize()
                            times[(P, r)].append(a.elapsed_time(b))
                med = {key: statistics.median(ts) for key, ts in times.items()}
                t1 = med[("T1", 0)]
                per = {key: ms for key, ms in med.items() if key[0] != "T1"}
                bnd = bounds(t1, per, args.P)
                bal = {(P, r): steps_balance(h, hk, n, det, lo, hi, num_sms) for P, r, lo, hi in work}
                rec = {"tokens": n, "heads": h, "heads_kv": hk, "mode": mode, "t1_ms": t1,
                       "t1_first_call_s": first[("T1", 0)], "t1_steps_balance": bal[("T1", 0)],
                       "ranks": [{"P": P, "rank": r, "kv": [lo, hi], "ms": med[(P, r)],
                                  "first_call_s": first[(P, r)], "steps_balance": bal[(P, r)]}
                                 for P, r, lo, hi in work if P != "T1"],
                       "bound": {str(P): {"max_ms": b[0], "min_ms": b[1], "bound": b[2]} for P, b in bnd.items()}}
                records.append(rec)
                print(f"\n## {size_label(n)} tokens, heads {h}/{hk}, {mode}: T1 {t1:.1f} ms (first call "
                      f"{first[('T1', 0)]:.1f} s, steps balance {fmt(bal[('T1', 0)])})", flush=True)
                print("| P | max_r T_r (ms) | min_r T_r (ms) | T1 / (P max_r T_r) | ranks' steps balance |")
                print("|---|---|---|---|---|")
                for P, (mx, mn, b) in bnd.items():
                    sb = ", ".join(fmt(bal[(P, r)]) for r in range(P))
                    print(f"| {P} | {mx:.1f} | {mn:.1f} | {b:.3f} | {sb} |", flush=True)
            del q, k, v, dout, views
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
