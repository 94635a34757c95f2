"""Summarise the Nsight Compute exports of `ncu_peers.sh`: ours against FA3 (and FA4) per
grid point, the main kernel of the direction only (the backward's pre- and
postprocess are left out).

    python benchmarks/peers/ncu_summary.py DIR [--direction bwd|fwd] [--top 15]

DIR holds NAME.raw.csv (and NAME.sass.csv for --top) as ncu_peers.sh writes them,
NAME = IMPL_hHDIM_MASK_SEQLEN. Prints one markdown table per point with the
metrics docs/journal/bwd-kernel.md compares (duration, tensor-pipe activity, issued
instructions, shared-memory bank conflicts, the stall reasons per issued
instruction), with --top N the N instructions of each kernel with the most
stall samples and their two main reasons, and with --conflicts N the N with the
most excess shared-memory wavefronts (bank conflicts).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

# The main kernel of each implementation, per direction (FA4's: its CuTe DSL classes' names, as
# its kernels appear in an ncu report). A name that matches no kernel is an error (read_raw),
# never another kernel's figures.
MAIN_KERNEL = {"bwd": {"ours": "bwd_kernel", "fa3": "FlashAttnBwdSm90", "fa4": "FlashAttentionBackwardSm90"},
               "fwd": {"ours": "fwd_kernel", "fa3": "FlashAttnFwdSm90", "fa4": "FlashAttentionForwardSm90"}}

METRICS = [  # (label, raw metric name, scale)
    ("duration (us)", "gpu__time_duration.sum", None),
    ("tensor pipe active (% of peak)",
     "TPC.TriageCompute.sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed", 1),
    ("instructions issued (M)", "smsp__inst_executed.sum", 1e-6),
    ("shared-store bank conflicts (M wavefronts)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", 1e-6),
    ("shared-load bank conflicts (M wavefronts)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", 1e-6),
] + [
    (f"stall {reason.replace('_', ' ')} (per issued instr.)",
     f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio", 1)
    for reason in ("barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "lg_throttle", "wait")
]
NAME = re.compile(r"^(?P<impl>[a-z0-9-]+)_h(?P<hdim>\d+)_(?P<mask>full|causal)_(?P<seqlen>\d+)$")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read_raw(path: Path, kernel: str) -> tuple[dict, dict]:
    """(metric -> value, metric -> unit) of the first kernel whose name contains `kernel`."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, units = rows[0], rows[1]
    name_col = header.index("Kernel Name")
    for row in rows[2:]:
        if kernel in row[name_col]:
            return dict(zip(header, row)), dict(zip(header, units))
    raise ValueError(f"{path}: no kernel matching {kernel!r}")


def metric(values: dict, units: dict, name: str, scale) -> float | None:
    if name not in values:
        return None
    v = _number(values[name])
    if v is None:
        return None
    if scale is None:  # durations: ncu picks the unit
        return v * {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}.get(
            units.get(name, "us"), 1.0)
    return v * scale


def read_sass(path: Path, kernel: str) -> list[dict]:
    """The per-instruction rows (address, source, samples, stall columns) of the
    first kernel whose name contains `kernel` (ncu may print a kernel twice)."""
    out, current, header = [], None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if out:
                    break
                current, header = row[1], None
                continue
            if row[0] == "Address":
                header = row
                continue
            if header is not None and current is not None and kernel in current:
                out.append(dict(zip(header, row)))
    return out


def top_stalls(rows: list[dict], n: int) -> list[str]:
    total = sum(_number(r.get("Warp Stall Sampling (All Samples)", "0")) or 0 for r in rows) or 1.0
    reasons = [k for k in (rows[0].keys() if rows else []) if k.startswith("stall_") and "Not Issued" not in k]
    ranked = sorted(rows, key=lambda r: -(_number(r.get("Warp Stall Sampling (All Samples)", "0")) or 0))
    lines = []
    for r in ranked[:n]:
        samples = _number(r.get("Warp Stall Sampling (All Samples)", "0")) or 0
        main = sorted(((_number(r[k]) or 0, k[6:]) for k in reasons), reverse=True)[:2]
        why = ", ".join(f"{k} {v / total * 100:.1f}%" for v, k in main if v)
        lines.append(f"| {r['Address'][-6:]} | {r['Source'].strip()[:64]} | {samples / total * 100:.1f}% | {why} |")
    return lines


# The source page's column of wavefronts beyond the conflict-free count.
EXCESS_COLUMN = "L1 Wavefronts Shared Excessive"


def top_conflicts(rows: list[dict], n: int) -> list[str]:
    """The n instructions with the most excess shared-memory wavefronts, and
    each one's share of the kernel's excess and its ideal wavefront count."""
    if not rows or EXCESS_COLUMN not in rows[0]:
        return [f"| (no column {EXCESS_COLUMN!r} in the export) | | | |"]

    def excess(r):
        return _number(r.get(EXCESS_COLUMN, "0")) or 0

    total = sum(excess(r) for r in rows) or 1.0
    ranked = sorted((r for r in rows if excess(r) > 0), key=lambda r: -excess(r))
    return [f"| {r['Address'][-6:]} | {r['Source'].strip()[:64]} | {excess(r) / total * 100:.1f}% | "
            f"{r.get('L1 Wavefronts Shared Ideal', 'n/a')} |" for r in ranked[:n]]


def points(directory: Path) -> dict:
    """(hdim, mask, seqlen) -> {impl: stem} for every NAME.raw.csv in directory."""
    found = {}
    for path in sorted(directory.glob("*.raw.csv")):
        m = NAME.match(path.name[: -len(".raw.csv")])
        if m:
            key = (int(m["hdim"]), m["mask"], int(m["seqlen"]))
            found.setdefault(key, {})[m["impl"]] = path.name[: -len(".raw.csv")]
    return found


def summarize(directory: Path, top: int = 0, direction: str = "bwd", conflicts: int = 0) -> str:
    main_kernel = MAIN_KERNEL[direction]
    out = []
    for (hdim, mask, seqlen), impls in sorted(points(directory).items()):
        names = [i for i in ("ours", "fa3") if i in impls] + sorted(i for i in impls if i not in ("ours", "fa3"))
        data = {}
        for impl in names:
            kernel = main_kernel.get(impl.split("-")[0], "")
            data[impl] = read_raw(directory / f"{impls[impl]}.raw.csv", kernel)
        out.append(f"### hdim {hdim} {mask} {seqlen}\n")
        out.append("| metric | " + " | ".join(names) + " |")
        out.append("|---|" + "---|" * len(names))
        for label, name, scale in METRICS:
            cells = []
            for impl in names:
                v = metric(*data[impl], name, scale)
                cells.append("n/a" if v is None else f"{v:.3g}")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
        for impl in names if top or conflicts else ():
            sass = directory / f"{impls[impl]}.sass.csv"
            if not sass.is_file():
                continue
            rows = read_sass(sass, main_kernel.get(impl.split("-")[0], ""))
            if top:
                out.append(f"{impl}: the {top} instructions with the most stall samples (share of the kernel's samples)\n")
                out.append("| address | instruction | samples | main reasons |")
                out.append("|---|---|---|---|")
                out.extend(top_stalls(rows, top))
                out.append("")
            if conflicts:
                out.append(f"{impl}: the {conflicts} instructions with the most excess shared wavefronts "
                           "(share of the kernel's excess)\n")
                out.append("| address | instruction | excess | ideal wavefronts |")
                out.append("|---|---|---|---|")
                out.extend(top_conflicts(rows, conflicts))
                out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--top", type=int, default=0, help="also list the N most-stalled instructions per kernel")
    ap.add_argument("--conflicts", type=int, default=0,
                    help="also list the N instructions with the most shared-memory bank conflicts per kernel")
    ap.add_argument("--direction", choices=tuple(MAIN_KERNEL), default="bwd", help="whose main kernel to read")
    args = ap.parse_args(argv)
    if not points(args.directory):
        print(f"error: no IMPL_hHDIM_MASK_SEQLEN.raw.csv files in {args.directory}", file=sys.stderr)
        return 2
    print(summarize(args.directory, args.top, args.direction, args.conflicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
