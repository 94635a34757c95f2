"""The deterministic backward when queries are few and keys many (seqlen_q <= seqlen_k / 4):
ours (non-deterministic, every deterministic schedule, ``auto``) beside FA3 (non-deterministic
and deterministic), interleaved in rounds in one process, GPU time per call.

    python benchmarks/bench_rect.py [--set issue|extra|edge|few|all] [--schedules split,spt,...]
                                    [--nd-schedules runs,...] [--rounds 3] [--json out.json]

Per shape: a check that our gradients agree with FA3's (when FA3 is built:
benchmarks/peers/build_fa3.py), then ``--rounds`` rounds, each timing every
implementation once in a rotated order (bench_peers.time_point). Printed per
shape, in ms: every implementation, and the speeds relative to the faster
non-deterministic backward of ours and FA3's ("nd best"): our best
deterministic schedule, ``auto``, FA3's deterministic mode; our nd / FA3 nd.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peers as bp  # noqa: E402
from peers import fa3 as fa3_peer  # noqa: E402

from dash_fa3 import ops  # noqa: E402
from dash_fa3._timing import commit_label  # noqa: E402
from dash_fa3.schedule import SCHEDULES  # noqa: E402

# batch, seqlen_q, seqlen_k, heads, heads_kv, head dim, mask
ISSUE_SHAPES = [
    (2, 1024, 8192, 16, 4, 128, "causal"),
    (1, 2048, 32768, 32, 8, 128, "causal"),
    (1, 4096, 65536, 32, 8, 128, "causal"),
    (4, 512, 4096, 16, 16, 64, "causal"),
    (2, 1024, 8192, 16, 4, 128, "full"),
    (1, 2048, 32768, 32, 8, 64, "full"),
    (8, 256, 8192, 16, 2, 128, "causal"),
]
EXTRA_SHAPES = [
    (4, 1024, 4096, 16, 16, 128, "causal"),
    (4, 1024, 4096, 16, 16, 128, "full"),
    (2, 2048, 16384, 16, 4, 64, "causal"),
    (2, 2048, 16384, 16, 4, 64, "full"),
    (4, 512, 8192, 16, 16, 128, "full"),
    (2, 1024, 16384, 32, 1, 128, "causal"),
]
# Two keys per query: where auto starts to pick split.
EDGE_SHAPES = [
    (4, 2048, 4096, 16, 16, 128, "causal"),
    (4, 2048, 4096, 16, 16, 128, "full"),
    (8, 1024, 2048, 16, 4, 64, "causal"),
    (8, 1024, 2048, 16, 4, 64, "full"),
]
# Two to eight Q tiles per head: where each CTA may own a run of KV tiles (the runs schedule).
FEW_SHAPES = [
    (16, 128, 8192, 32, 8, 128, "causal"),
    (8, 256, 8192, 16, 2, 128, "full"),
    (4, 256, 16384, 32, 32, 128, "causal"),
    (4, 512, 16384, 16, 2, 64, "causal"),
    (2, 384, 8192, 32, 4, 128, "full"),
    (8, 512, 8192, 16, 4, 128, "causal"),
    (4, 512, 4096, 16, 16, 64, "causal"),
    (8, 256, 8192, 16, 2, 128, "causal"),
]
# Square GQA: where a group's heads on one CTA (the groups schedule) may pay without few queries.
GQA_SHAPES = [
    (4, 4096, 4096, 32, 8, 128, "causal"),
    (4, 4096, 4096, 32, 8, 128, "full"),
    (8, 2048, 2048, 16, 4, 64, "causal"),
    (2, 8192, 8192, 32, 4, 128, "causal"),
    (16, 1024, 1024, 32, 8, 128, "causal"),
]
SETS = {"issue": ISSUE_SHAPES, "extra": EXTRA_SHAPES, "edge": EDGE_SHAPES, "few": FEW_SHAPES, "gqa": GQA_SHAPES,
        "all": ISSUE_SHAPES + EXTRA_SHAPES + EDGE_SHAPES}


def label(s) -> str:
    b, sq, sk, h, hkv, d, mask = s
    return f"{b}x{sq}x{sk} {h}/{hkv} d{d} {mask}"


def make_fns(s, schedules, fa3, nd_schedules=()):
    b, sq, sk, h, hkv, d, mask = s
    causal = mask == "causal"
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk + h + d)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    out, lse = ops.fwd(q, k, v, scale, causal, 0)

    def ours(det, sched):
        return lambda: ops.bwd(dout, q, k, v, out, lse, scale, causal, det, sched, 0)

    fns = {"ours nd": ours(False, "auto"), "ours auto": ours(True, "auto")}
    fns.update({f"ours {name}": ours(True, name) for name in schedules})
    fns.update({f"ours nd {name}": ours(False, name) for name in nd_schedules})
    errors = {}
    check = "n/a (no FA3)"
    if fa3 is not None:
        for name, det in (("FA3 nd", False), ("FA3 det", True)):
            try:
                fns[name] = fa3_peer.backward_fn(fa3, q, k, v, dout, causal, det, False)
            except Exception as exc:  # a peer may reject a shape: reported, the rest still timed
                errors[name] = str(exc).splitlines()[0]
        try:
            f_out, f_lse = fa3_peer.forward(fa3, q, k, v, causal)
            theirs = fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, causal, False)
            mine = ops.bwd(dout, q, k, v, out, lse, scale, causal, True, "auto", 0)
            worst = max(bp.rel_diff(a, t) for a, t in zip(mine, theirs))
            check = "ok" if worst < 2e-2 else f"WARN rel {worst:.1e}"
        except Exception as exc:
            check = "not checked: " + str(exc).splitlines()[0]
    return fns, errors, check


RESULT_COLUMNS = (("shape", None), ("ours nd", 3), ("FA3 nd", 3), ("best det", 3), ("best schedule", None),
                  ("auto", 3), ("FA3 det", 3), ("best det / nd best", 2), ("auto / best det", 2),
                  ("FA3 det / nd best", 2), ("ours nd / FA3 nd", 2))


def write_results(path: str, table: list, args, with_fa3: bool) -> None:
    """The table as a benchmarks/results data file (benchmarks/results/render.py reads it)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    data = {
        "id": stem,
        "title": "Deterministic backward with few queries and many keys, beside FA3",
        "device": torch.cuda.get_device_name(), "date": f"{now:%Y-%m-%d}", "commit": commit_label(),
        "command": f"python benchmarks/bench_rect.py --set {args.set} --rounds {args.rounds} --iters {args.iters}",
        "unit": "ms (ratios as named; nd best: the faster of ours nd and FA3 nd)",
        "software": f"torch {torch.__version__}" + (", FA3 0251105a" if with_fa3 else ", no FA3 build"),
        "journal": {"file": "docs/journal/rect-bwd.md", "section": "Measured", "holds_table": False},
        "summary_columns": ["best det / nd best", "auto / best det"],
        "columns": [{"name": n, **({"decimals": d} if d is not None else {})} for n, d in RESULT_COLUMNS],
        "rows": table,
    }
    if not with_fa3 or any(v is None for row in table for v in row):
        raise SystemExit("--results needs FA3 (every cell a number): build it with benchmarks/peers/build_fa3.py")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def kernel_us(fn, iters: int) -> dict:
    """GPU time per call of each kernel ``fn`` launches (us, mean over ``iters`` calls), by kernel name:
    what the pre- and postprocess cost beside the main kernel."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.self_device_time_total > 0:
            out[ev.key[:80]] = round(ev.self_device_time_total / iters, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=tuple(SETS), default="all")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--nd-schedules", default="",
                    help="also time the non-deterministic backward on these schedules (in --json, not the table)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write every shape's per-round medians here")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile our calls (torch.profiler) and write each kernel's GPU time per call "
                         "(preprocess, main, postprocess) into --json")
    ap.add_argument("--results", help="write the printed table as a benchmarks/results data file here (its id is "
                                      "the file's name)")
    args = ap.parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    nd_schedules = [s for s in args.nd_schedules.split(",") if s]
    if bad := [s for s in schedules + nd_schedules if s not in SCHEDULES]:
        ap.error(f"--schedules, --nd-schedules: unknown {', '.join(bad)}; choose from {', '.join(SCHEDULES)}")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--rounds and --iters must be >= 1, --warmup >= 0")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    try:
        fa3 = fa3_peer.load_fa3()
    except Exception as exc:
        print(f"FA3: n/a ({str(exc).splitlines()[0]})")
        fa3 = None
    print(f"# bench_rect: {torch.cuda.get_device_name()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"commit {commit_label()}, rounds {args.rounds} x iters {args.iters}")
    rows, table = [], []
    print("| shape | ours nd | FA3 nd | best det (schedule) | auto | FA3 det | best det / nd best | auto / best det "
          "| FA3 det / nd best | ours nd / FA3 nd | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in SETS[args.set]:
        fns, errors, check = make_fns(s, schedules, fa3, nd_schedules)
        round_ms, _ = bp.time_point(fns, errors, args.rounds, args.warmup, args.iters)
        ms = {n: statistics.median(t) for n, t in round_ms.items()}
        nd_best = min(ms[n] for n in ("ours nd", "FA3 nd") if n in ms)
        det = {n[5:]: t for n, t in ms.items() if n.startswith("ours ") and n[5:] in schedules}
        best = min(det, key=det.get)

        def cell(n):
            return f"{ms[n]:.3f}" if n in ms else "n/a"

        def speed(t):
            return f"{nd_best / t:.2f}" if t else "n/a"

        print(f"| {label(s)} | {cell('ours nd')} | {cell('FA3 nd')} | {det[best]:.3f} ({best}) | {cell('ours auto')} "
              f"| {cell('FA3 det')} | {speed(det[best])} | {det[best] / ms['ours auto']:.2f} "
              f"| {speed(ms.get('FA3 det'))} | {ms['FA3 nd'] / ms['ours nd'] if 'FA3 nd' in ms else float('nan'):.2f} "
              f"| {check} |", flush=True)
        rows.append({"shape": s, "ms": ms, "rounds": round_ms, "errors": errors, "check": check})
        if args.kernels:
            rows[-1]["kernels_us"] = {n: kernel_us(f, args.iters) for n, f in fns.items() if n.startswith("ours")}
        fa3_nd, fa3_det = ms.get("FA3 nd"), ms.get("FA3 det")
        table.append([label(s), round(ms["ours nd"], 3), round(fa3_nd, 3) if fa3_nd else None, round(det[best], 3),
                      best, round(ms["ours auto"], 3), round(fa3_det, 3) if fa3_det else None,
                      round(nd_best / det[best], 2), round(det[best] / ms["ours auto"], 2),
                      round(nd_best / fa3_det, 2) if fa3_det else None,
                      round(fa3_nd / ms["ours nd"], 2) if fa3_nd else None])
        if args.json:  # after every shape: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "commit": commit_label(),
                           "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}", "rows": rows},
                          f, indent=1)
    if args.results:
        write_results(args.results, table, args, fa3 is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
