"""Deterministic `auto` against every schedule on shapes off the bench grid (issue 15).

    python benchmarks/bench_auto.py [--set first|held_out|probe|probe2|grid|all] [--rounds 3] [--iters 10]
                                    [--json out.json] [--shapes 0,3,5] [--nd]
    python benchmarks/bench_auto.py --dry-run        # CPU: build and validate, print the picks

Per shape (four sets, SHAPES, HELD_OUT, PROBE and PROBE2: other lengths, batch and head counts,
GQA and MQA, ragged lengths, seqlen_q != seqlen_k; bf16; HELD_OUT was chosen
after the table was revised on SHAPES' first measurement), ours only: the non-deterministic backward
(`auto`: `lpt`, `groups`, or at few dQ adds per Q tile the deterministic mode) and the deterministic
backward with every schedule,
interleaved in rounds (rotated order), each timing the median of CUDA-event
samples of GPU time (`dash_fa3._timing.median_ms`, host time hidden); figures
are medians over rounds. Printed per shape: the best deterministic schedule,
the schedules `auto` resolves to under the `table` and `model` policies
(`resolve_schedule_name`) with their distance to the best, and the best
deterministic / non-deterministic. The issue's bar: `auto` within 2% of the
best schedule on at least 12 off-grid shapes.

`--nd` times the non-deterministic backward with every schedule too (its accumulation order is
free, so any schedule's task order runs without the dQ turns) and prints the fastest and where
the non-deterministic `auto` stands against it. `--set grid` is the paper's square grid
(dash_fa3/schedule/bench_grid.json); `all` is the four off-grid sets; sets may be comma-joined.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_peers import rotated  # noqa: E402

from dash_fa3.schedule import SCHEDULES, Geometry, build_schedule, resolve_schedule_name, schedules_for  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, heads_kv, headdim, causal): none is a grid point
# (the grid: 16k tokens, hidden 2048, MHA, seqlen_q == seqlen_k).
SHAPES = [
    (2, 3072, 3072, 24, 8, 128, True),     # GQA 3
    (1, 12288, 12288, 16, 16, 64, False),
    (4, 1536, 1536, 32, 4, 64, True),      # GQA 8
    (2, 2048, 6144, 16, 16, 128, False),   # seqlen_q < seqlen_k
    (1, 4096, 8192, 16, 16, 128, True),    # causal, bottom-right aligned
    (8, 640, 640, 16, 16, 128, True),      # ragged last tiles
    (3, 5000, 5000, 8, 8, 128, True),
    (16, 1024, 1024, 8, 2, 64, False),     # GQA 4
    (1, 32768, 32768, 8, 8, 128, True),    # longer than the grid
    (1, 24576, 24576, 12, 12, 64, True),
    (6, 2560, 2560, 20, 4, 128, False),    # GQA 5
    (2, 7168, 7168, 16, 16, 64, True),
    (32, 256, 256, 16, 16, 128, True),     # shorter than the grid
    (1, 16384, 16384, 4, 1, 128, True),    # MQA, few heads
]


# A second set, chosen after the table's rules were revised on SHAPES (H100, 2026-11-24:
# shift for full masks up to 128 KV tiles at head dim 64 too, and the shift orders only when
# seqlen_q == seqlen_k), to measure the revision on shapes it was not fitted to; its first
# measurement then moved the second rule to seqlen_k <= seqlen_q (policy.resolve_schedule_name).
HELD_OUT = [
    (4, 4096, 4096, 16, 4, 64, False),     # GQA 4, 32 KV tiles
    (2, 10240, 10240, 8, 8, 128, True),
    (1, 8192, 16384, 8, 8, 64, False),     # seqlen_q < seqlen_k
    (2, 3000, 3000, 16, 16, 64, True),     # ragged last tiles
    (8, 1536, 1536, 12, 12, 128, False),
    (1, 20000, 20000, 8, 2, 128, True),    # GQA 4, ragged
    (4, 768, 768, 32, 32, 128, True),
    (2, 4096, 2048, 16, 16, 128, True),    # seqlen_q > seqlen_k
    (1, 65536, 65536, 2, 2, 128, True),
    (16, 512, 512, 32, 8, 64, True),       # GQA 4, short
    (3, 6144, 6144, 12, 12, 64, False),
    (1, 12288, 4096, 16, 16, 128, False),  # seqlen_q > seqlen_k
    (6, 2048, 2048, 24, 24, 128, True),
    (2, 16384, 16384, 16, 16, 64, False),
]
# A third set, chosen after the rule's revision on the first two (docs/journal/rect-bwd.md run 14:
# grouped schedules for square GQA, symmetric_shift for causal tasks of a few waves), to measure
# the revision where it was not fitted: each shape sits inside one of the new regions or at its edge.
PROBE = [
    (8, 2048, 2048, 32, 8, 128, False),    # GQA 4, 32 Q tiles: grouped_split
    (2, 3072, 3072, 16, 2, 64, False),     # GQA 8, head dim 64
    (4, 1024, 1536, 16, 4, 128, False),    # 1.5 keys per query
    (1, 8192, 8192, 16, 4, 128, False),    # 128 Q tiles: past GROUPED_FULL_MAX_Q_TILES
    (32, 256, 256, 32, 8, 128, True),      # GQA 4, 4 Q tiles: grouped_sections
    (24, 384, 384, 16, 2, 64, True),       # GQA 8, 3 Q tiles
    (8, 640, 640, 16, 4, 128, True),       # 10 Q tiles: past GROUPED_CAUSAL_MAX_Q_TILES
    (1, 4096, 4096, 12, 12, 64, True),     # 2.9 waves: symmetric_shift
    (2, 2560, 2560, 8, 8, 128, True),      # 20 KV tiles, 2.4 waves
    (1, 8192, 4096, 16, 16, 64, True),     # seqlen_q > seqlen_k, 3.9 waves
    (4, 2048, 2048, 8, 8, 64, True),       # 16 KV tiles, 3.9 waves
    (2, 6144, 6144, 16, 16, 64, True),     # 11.6 waves: spt
]
# A fourth set, chosen after PROBE's first measurement (H200, docs/journal/rect-bwd.md run 15) moved
# the rule again (grouped tasks that fill a wave, causal grouped tasks of at most 48 steps, sections
# under 3 waves of causal tasks), at the edges of the moved regions.
PROBE2 = [
    (3, 2048, 2048, 16, 2, 64, False),     # 96 grouped tasks: under a wave, shift
    (6, 2048, 2048, 16, 2, 64, False),     # 192 grouped tasks: grouped_split
    (8, 768, 768, 32, 8, 128, True),       # 48 Q tiles per group: grouped_sections
    (4, 1024, 1024, 16, 4, 128, True),     # 64 Q tiles per group: spt
    (16, 768, 768, 16, 8, 64, True),       # GQA 2, 12 Q tiles per group
    (1, 8192, 8192, 4, 4, 128, True),      # 1.9 waves: sections
    (1, 6144, 6144, 8, 8, 64, True),       # 2.9 waves
    (1, 16384, 16384, 2, 2, 128, True),    # 1.9 waves, 128 KV tiles
    (2, 3072, 3072, 8, 8, 128, True),      # 2.9 waves, 24 KV tiles
    (2, 4096, 4096, 8, 8, 64, True),       # 3.9 waves: symmetric_shift
    (1, 4096, 4096, 24, 24, 128, True),    # 5.8 waves
]
SETS = {"first": SHAPES, "held_out": HELD_OUT, "probe": PROBE, "probe2": PROBE2}


def grid_shapes() -> list[tuple]:
    """The paper's square grid (bench_grid.json) as shapes: batch = tokens / seqlen, heads = hidden / d."""
    grid = json.loads((Path(__file__).resolve().parents[1] / "dash_fa3" / "schedule" / "bench_grid.json").read_text())
    return [(grid["total_tokens"] // s, s, s, grid["hidden"] // d, grid["hidden"] // d, d, mask == "causal")
            for d in grid["headdims"] for mask in grid["masks"] for s in grid["seqlens"]]


def sets_of(spec: str) -> list[str]:
    """The set names of a --set value: one name, a comma list, or `all` (the off-grid sets)."""
    names = list(SETS) if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETS and n != "grid"]
    if unknown or not names:
        raise ValueError(f"--set takes {', '.join([*SETS, 'grid', 'all'])} or a comma list, got {spec!r}")
    return names


def set_shapes(name: str) -> list[tuple]:
    return grid_shapes() if name == "grid" else SETS[name]


def label(shape) -> str:
    b, sq, sk, h, hkv, d, causal = shape
    return f"b{b} {sq}x{sk} h{h}/{hkv} d{d} {'causal' if causal else 'full'}"


def geometry_of(shape) -> Geometry:
    b, sq, sk, h, hkv, d, causal = shape
    return Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=d, causal=causal)


def picks(shape, num_sms: int) -> dict[str, str]:
    """The deterministic `auto` under each policy, and the non-deterministic one (`nd`)."""
    g, d = geometry_of(shape), shape[5]
    return {policy: resolve_schedule_name("auto", g, num_sms=num_sms, headdim=d, policy=policy)
            for policy in ("table", "model")} | {"nd": resolve_schedule_name("auto", g, False, num_sms=num_sms)}


def dry_run(shapes, num_sms: int) -> None:
    for shape in shapes:
        g = geometry_of(shape)
        for name in schedules_for(g):
            build_schedule(name, g, num_sms)  # raises ScheduleError if a check fails
        p = picks(shape, num_sms)
        print(f"{label(shape)}: {g.n_q} Q x {g.n_kv} KV tiles, {g.num_steps} steps; "
              f"auto: table {p['table']}, model {p['model']}, nd {p['nd']}")


def bwd_flops(shape) -> float:
    from dash_fa3._timing import attention_flops
    b, sq, sk, h, _, d, causal = shape
    return attention_flops(b, h, sq, sk, d, causal, "bwd")


def measure(shape, rounds: int, iters: int, nd_all: bool = False) -> dict[str, float]:
    """Median over rounds of the TFLOP/s of `nd` (`auto`) and of `det <schedule>` for every
    schedule; with nd_all also of `nd <schedule>` for every schedule."""
    import torch

    from dash_fa3 import flash_attn_func, ops
    from dash_fa3._timing import median_ms

    b, sq, sk, h, hkv, d, causal = shape
    g = torch.Generator(device="cuda").manual_seed(sum(shape[:6]))
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    scale = d ** -0.5
    names = schedules_for(geometry_of(shape))
    calls = {"nd": (False, "auto")} | {f"det {n}": (True, n) for n in names}
    if nd_all:
        calls |= {f"nd {n}": (False, n) for n in names}
    flops = bwd_flops(shape)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in rotated(calls, r):
            det, sched = calls[name]
            ms = median_ms(lambda: ops.bwd(dout, q, k, v, out, lse, scale, causal, det, sched, 0), 3, iters,
                           hide_host=True)
            samples[name].append(flops / ms / 1e9)
    return {name: statistics.median(v) for name, v in samples.items()}


def report_row(shape, tf: dict[str, float], num_sms: int) -> dict:
    det = {n: tf[f"det {n}"] for n in SCHEDULES if f"det {n}" in tf}  # those the shape has (schedules_for)
    best = max(det, key=det.get)
    p = picks(shape, num_sms)
    row = {"shape": label(shape), "nd": tf["nd"], "det": det, "best": best,
           "table": p["table"], "table_vs_best": det[p["table"]] / det[best],
           "model": p["model"], "model_vs_best": det[p["model"]] / det[best],
           "best_det_vs_nd": det[best] / tf["nd"], "nd_pick": p["nd"]}
    nd = {n: tf[f"nd {n}"] for n in SCHEDULES if f"nd {n}" in tf}
    if nd:
        # The fastest non-deterministic call of the shape, `auto`'s own timing included: where it
        # runs the deterministic mode (policy.nd_runs_ordered) no named call runs what it runs.
        named = max(nd, key=nd.get)
        nd_best, nd_best_tf = ("auto", tf["nd"]) if tf["nd"] >= nd[named] else (named, nd[named])
        row |= {"nd_sched": nd, "nd_best": nd_best, "nd_best_tf": nd_best_tf, "nd_vs_best": tf["nd"] / nd_best_tf,
                "best_det_vs_nd_best": det[best] / nd_best_tf}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--set", default="all",
                    help="first, held_out, probe, probe2, grid, all (the four off-grid sets; default) or a comma list")
    ap.add_argument("--shapes", default="", help="comma list of indices into the set (default: all)")
    ap.add_argument("--num-sms", type=int, default=132, help="SM count the picks are resolved for (dry run)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: validate every schedule, print the picks")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--nd", action="store_true", help="also time the non-deterministic backward with every schedule")
    args = ap.parse_args(argv)
    try:
        sets = sets_of(args.set)
    except ValueError as e:
        ap.error(str(e))
    pool = [(name, shape) for name in sets for shape in set_shapes(name)]
    try:
        chosen = [pool[int(i)] for i in args.shapes.split(",")] if args.shapes else pool
    except (ValueError, IndexError):
        ap.error(f"--shapes takes indices 0..{len(pool) - 1}, got {args.shapes!r}")
    shapes = [shape for _, shape in chosen]
    if args.dry_run:
        dry_run(shapes, args.num_sms)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_auto.py needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    from dash_fa3 import _ext

    num_sms = _ext.num_sms(torch.cuda.current_device())
    rows = []
    print(f"# det auto against every schedule, off the grid: {torch.cuda.get_device_name()}, TFLOP/s, median of "
          f"{args.rounds} rounds")
    nd_cols = " | nd best (schedule) | nd auto (vs nd best) | best det / nd best" if args.nd else ""
    print("| set | shape | nd | " + " | ".join(f"det {n}" for n in SCHEDULES)
          + " | best | table pick (vs best) | model pick (vs best) | best det / nd" + nd_cols + " |")
    print("|" + "---|" * (len(SCHEDULES) + 7 + (3 if args.nd else 0)))
    for set_name, shape in chosen:
        row = report_row(shape, measure(shape, args.rounds, args.iters, args.nd), num_sms) | {"set": set_name}
        rows.append(row)
        nd_cells = (f" | {row['nd_best_tf']:.0f} ({row['nd_best']}) | {row['nd_pick']} ({row['nd_vs_best']:.3f}) | "
                    f"{row['best_det_vs_nd_best']:.3f}" if args.nd else "")
        print(f"| {set_name} | {row['shape']} | {row['nd']:.0f} | "
              + " | ".join(f"{row['det'][n]:.0f}" if n in row["det"] else "-" for n in SCHEDULES)
              + f" | {row['best']} | {row['table']} ({row['table_vs_best']:.3f}) | {row['model']} "
              f"({row['model_vs_best']:.3f}) | {row['best_det_vs_nd']:.3f}{nd_cells} |", flush=True)
    for set_name in sets:
        in_set = [r for r in rows if r["set"] == set_name]
        for policy in ("table", "model"):
            within = sum(r[f"{policy}_vs_best"] >= 0.98 for r in in_set)
            print(f"{set_name}, {policy}: within 2% of the best schedule at {within} of {len(in_set)} shapes")
        if args.nd:
            within = sum(r["nd_vs_best"] >= 0.98 for r in in_set)
            print(f"{set_name}, nd auto: within 2% of the fastest non-deterministic call at {within} of "
                  f"{len(in_set)} shapes")
    if args.json:
        Path(args.json).write_text(json.dumps({"num_sms": num_sms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
