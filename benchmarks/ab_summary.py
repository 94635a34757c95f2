"""Compare builds from `bench_peers.py --json` runs made in alternating processes (an A/B).

    python benchmarks/ab_summary.py base=out/ab_base_*.json new=out/ab_new_*.json \
        [--impls "ours nd,ours det spt"] [--markdown]

Each argument is LABEL=GLOB; the first label is the base. For every grid point
and implementation, a build's figure is the median, over every round of every
run of that build, of the TFLOP/s (the point's FLOPs over each round's time);
the other builds get their ratio to the base. A second table gives, per point
and build, the best deterministic schedule's median over the non-deterministic
one's (the backward bar's "best deterministic / our non-deterministic"), with
the schedule, where the runs timed both. Rounds of several processes are
pooled because one process's rounds share its GPU clocks: alternating
processes is what spreads the machine's drift over both builds.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import impl_direction  # noqa: E402


def load_runs(pattern: str) -> list[dict]:
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise SystemExit(f"no file matches {pattern!r}")
    return [json.load(open(p)) for p in paths]


def point_key(pt: dict) -> tuple:
    return (pt["hdim"], pt["mask"], pt["seqlen"])


def tflops_by_point(runs: list[dict], direction: str) -> dict[tuple, dict[str, list[float]]]:
    """(hdim, mask, seqlen) -> implementation -> TFLOP/s of every round of every run."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for run in runs:
        for pt in run["points"]:
            per_impl = out.setdefault(point_key(pt), {})
            flops = pt["flops"][direction]
            for impl, times in pt["round_ms"].items():
                per_impl.setdefault(impl, []).extend(flops / ms / 1e9 for ms in times)
    return out


def summarize(builds: list[tuple[str, list[dict]]], impls: list[str] | None) -> list[list[str]]:
    """Rows: point, implementation, then per build its median TFLOP/s (and ratio to the base)."""
    tables = {label: {d: tflops_by_point(runs, d) for d in ("fwd", "bwd")} for label, runs in builds}
    base_label = builds[0][0]
    points = sorted(tables[base_label]["bwd"])
    rows = []
    for key in points:
        names = impls or sorted(tables[base_label]["bwd"].get(key, {}))
        for impl in names:
            d = impl_direction(impl)
            base_samples = tables[base_label][d].get(key, {}).get(impl)
            if not base_samples:
                continue
            base = statistics.median(base_samples)
            row = [f"hdim {key[0]} {key[1]} {key[2]}", impl, f"{base:.0f}"]
            for label, _ in builds[1:]:
                samples = tables[label][d].get(key, {}).get(impl)
                if samples:
                    med = statistics.median(samples)
                    row.append(f"{med:.0f} ({med / base:.3f}x)")
                else:
                    row.append("n/a")
            rows.append(row)
    return rows


def det_over_nd(builds: list[tuple[str, list[dict]]]) -> list[list[str]]:
    """Rows: point, then per build the best ``ours det *`` median over the ``ours nd`` median (and
    the schedule); points where the base lacks either are left out."""
    tables = {label: tflops_by_point(runs, "bwd") for label, runs in builds}
    rows = []
    for key in sorted(tables[builds[0][0]]):
        row = [f"hdim {key[0]} {key[1]} {key[2]}"]
        for label, _ in builds:
            impls = tables[label].get(key, {})
            dets = {k[len("ours det "):]: statistics.median(v) for k, v in impls.items() if k.startswith("ours det ")}
            if not dets or "ours nd" not in impls:
                row.append("n/a")
                continue
            best = max(dets, key=dets.get)
            row.append(f"{dets[best] / statistics.median(impls['ours nd']):.3f} ({best})")
        if row[1] != "n/a":
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", help="LABEL=GLOB of bench_peers.py --json files; the first is the base")
    ap.add_argument("--impls", default="", help="comma list of implementations (default: every one of the base)")
    args = ap.parse_args(argv)
    builds = []
    for spec in args.builds:
        label, sep, pattern = spec.partition("=")
        if not sep or not label or not pattern:
            ap.error(f"expected LABEL=GLOB, got {spec!r}")
        builds.append((label, load_runs(pattern)))
    impls = [s.strip() for s in args.impls.split(",") if s.strip()] or None
    rows = summarize(builds, impls)
    header = ["point", "implementation", builds[0][0]] + [label for label, _ in builds[1:]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    bar = det_over_nd(builds)
    if bar:
        print("\nbest deterministic / non-deterministic (median TFLOP/s), per build\n")
        print("| point | " + " | ".join(label for label, _ in builds) + " |")
        print("|" + "---|" * (len(builds) + 1))
        for row in bar:
            print("| " + " | ".join(row) + " |")
    commits = {label: sorted({r.get("commit", "?") for r in runs}) for label, runs in builds}
    print(f"\nTFLOP/s: median over every round of every run; runs per build: "
          + ", ".join(f"{label} {len(runs)} ({'/'.join(commits[label])})" for label, runs in builds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
