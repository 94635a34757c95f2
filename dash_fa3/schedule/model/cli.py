"""Command line: ``python -m dash_fa3.schedule ...``

Real-shape mode (default)::

    python -m dash_fa3.schedule --seqlen 8192 --headdim 128 --heads 16 --batch 2 --causal --schedule all

prints makespan, critical path, lower bound, ratio and idle % per schedule and
writes one Gantt chart per schedule into ``--gantt-dir`` (default ./gantt).

Model mode (the paper's abstraction: n KV tiles = n Q tiles = n SMs, m heads)::

    python -m dash_fa3.schedule model --kv-tiles 8 --heads 4 --compute 1 --reduce 0.5 \
        --mask causal --schedule symmetric_shift --json

Bench grid (validate every schedule on the paper's grid, optionally simulate)::

    python -m dash_fa3.schedule bench-grid [--grid bench_grid.json] [--sms 132,114] [--simulate]

Gallery (the Gantt charts of docs/design/schedule.md)::

    python -m dash_fa3.schedule gallery --out docs/gantt

Calibration (the simulator against the measured H100 grid; ``--fit`` refits it)::

    python -m dash_fa3.schedule calibrate [--fit] [--train 512,2048,8192] [--json]
    python -m dash_fa3.schedule calibrate --calls [--fit] [--json]

Export (the kernel's validated static metadata, for the C++ harness)::

    python -m dash_fa3.schedule export --out sched.i32 --sms 132 --schedule fa3,spt \
        (--shapes FILE|- | --seqlen N --headdim D [--causal] ...)

Every argument is checked before any work: a bad value, an unwritable output
path or a shape past the model's size limit (:data:`MAX_STEPS`: the model
enumerates every (KV tile, Q tile) step of every head, so its time and memory
grow with the square of the length) exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ... import variants
from ..._cli import OneLineParser, bounded_float, bounded_int, folder_problem, headdim
from .. import export
from ..export import DEFAULT_GRID, grid_geometries
from ..geometry import Geometry, bwd_block_sizes
from ..contract import SCHEDULES
from ..policy import build_schedule, get_kernel_metadata
from ..schedules import schedules_for
from ..validate import ScheduleError
from .paper import paper_makespan
from .simulate import CostModel, simulate


# ------------------------------------------------------------ limits
#: Steps (one (KV tile, Q tile) pair of one head) a real-shape, model or bench-grid run may enumerate:
#: the full schedule, its simulation and the critical path hold a few arrays per step, about 2 KB
#: in all, so this bounds a run to a few GB. 32k tokens of 16 heads at head dim 128 (full mask)
#: fit; longer sequences fit with fewer heads (a causal mask halves the steps).
MAX_STEPS = 1 << 21
#: (KV tile, Q tile) cells of one head that export's kernel-path check walks (a few bytes each,
#: per checking thread): about 1M tokens at head dim 128.
MAX_HEAD_CELLS = 1 << 28
#: Task rows (heads x KV tiles) of one exported schedule, each a row of int64 while it is built.
MAX_TASKS = 1 << 22
#: Bounds of the sizes the shapes take, checked before any array is made.
MAX_SEQLEN = 1 << 24
MAX_HEADS = 1 << 12
MAX_BATCH = 1 << 16
MAX_SMS = 1024
MAX_BLOCK = 1024
#: Costs are in any unit, but one step's cost times MAX_STEPS steps must stay a finite sum.
MAX_COST = 1e9

SUBCOMMANDS = {
    "shape": "the default: simulate the schedules on a real shape (this help)",
    "model": "the paper's model: n KV tiles = n SMs, m heads, square tiles",
    "bench-grid": "validate (and optionally simulate) every schedule on the bench grid",
    "gallery": "write the Gantt charts of docs/design/schedule.md",
    "calibrate": "the simulator against the measured H100 grid (--fit refits it)",
    "export": "write the kernel's validated static metadata for programs without Python",
}


# ------------------------------------------------------------ argument types
positive_int = bounded_int(1, 2 ** 31 - 1)
nonnegative_float = bounded_float(0.0, MAX_COST)
positive_float = bounded_float(0.0, MAX_COST, strict=True)
sms_int = bounded_int(1, MAX_SMS)
seqlen_int = bounded_int(1, MAX_SEQLEN)
heads_int = bounded_int(1, MAX_HEADS)
batch_int = bounded_int(1, MAX_BATCH)
block_int = bounded_int(1, MAX_BLOCK)


def sm_list(text: str) -> list[int]:
    return [sms_int(x) for x in text.split(",")]


def int_list(text: str) -> list[int]:
    return [positive_int(x) for x in text.split(",")]


def check_size(p, g: Geometry) -> None:
    """Refuse, before building anything, a shape whose schedules the model cannot hold."""
    if g.num_steps > MAX_STEPS:
        p.error(f"{g.describe()} has {g.num_steps:,} tile steps; the schedule model enumerates every step and "
                f"takes at most {MAX_STEPS:,} (a few GB): use fewer heads or batch, a shorter sequence or larger "
                f"tiles")


def writable_dir(p, path: str, what: str) -> None:
    """Create ``path`` (a directory) or refuse in one line."""
    problem = folder_problem(path, what)
    if problem:
        p.error(problem)


def _schedule_list(p, arg: str) -> list[str] | None:
    """The schedules ``--schedule`` names, checked; None for ``all``, which :func:`_for_shape` expands."""
    if arg == "all":
        return None
    names = [a.strip() for a in arg.split(",") if a.strip()]
    for n in names or [arg]:
        if n not in SCHEDULES + ("auto",):
            p.error(f"unknown schedule {n!r}; choose from {', '.join(SCHEDULES + ('auto',))} or all")
    return names


def _for_shape(names: list[str] | None, g: Geometry) -> list[str]:
    """``names``, or for ``all`` the schedules defined for ``g`` (:func:`.schedules_for`: no ``grouped_*``
    without a power-of-two group, no ``runs`` or ``groups`` at head dim 192)."""
    return list(schedules_for(g)) if names is None else names


def evaluate(name: str, geometry: Geometry, num_sms: int, costs: CostModel, *, want_cp: bool = True,
             gantt_path: str | None = None) -> dict:
    """Build, validate, simulate one schedule; return a result dict (valid=False on refusal)."""
    from .dag import critical_path

    out = {"schedule": name, "num_sms": num_sms}
    try:
        sched = build_schedule(name, geometry, num_sms)
    except ScheduleError as e:
        out.update(valid=False, error=str(e))
        return out
    out["schedule"] = sched.name
    rep = sched.validate()
    sim = simulate(sched, costs)
    out.update(valid=True, tasks=sched.num_tasks, steps=sched.num_steps, ctas=sched.num_ctas,
               dispatch=sched.dispatch, makespan=sim.makespan, lower_bound=sim.lower_bound,
               ratio=sim.ratio, sm_idle_fraction=sim.sm_idle_fraction, collisions=sim.waits,
               wait_time=sim.wait_time, metadata_bytes=rep.metadata_bytes)
    if want_cp:
        # the DAG with zero-weight dependency edges (no semaphore latency), as in the paper
        out["critical_path"] = critical_path(sched, costs.replace(latency=0.0)).length
    if costs.pipeline == "writer":
        out.update(pipeline="writer", buffer_stalls=sim.buffer_stalls, buffer_stall_time=sim.buffer_stall_time)
    if gantt_path:
        from .plot import plot_gantt
        plot_gantt(sched, sim, gantt_path)
        out["gantt"] = gantt_path
    return out


def _fmt_table(rows: list[dict]) -> str:
    hdr = f"{'schedule':<16} {'valid':>5} {'tasks':>6} {'steps':>8} {'makespan':>11} {'crit.path':>11} " \
          f"{'lower bnd':>11} {'ratio':>6} {'idle %':>7} {'waits':>7}"
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        if not r.get("valid"):
            lines.append(f"{r['schedule']:<16} {'no':>5}  refused: {r.get('error', '')}")
            continue
        cp = r.get("critical_path")
        cps = f"{cp:>11.2f}" if cp is not None else f"{'-':>11}"
        lines.append(f"{r['schedule']:<16} {'yes':>5} {r['tasks']:>6} {r['steps']:>8} {r['makespan']:>11.2f} "
                     f"{cps} {r['lower_bound']:>11.2f} {r['ratio']:>6.3f} {100 * r['sm_idle_fraction']:>7.2f} "
                     f"{r['collisions']:>7}")
    return "\n".join(lines)


def _costs_from(p, args) -> CostModel:
    reduce = args.reduce if args.reduce is not None else args.compute * args.rc_ratio
    if reduce > MAX_COST:
        p.error(f"--compute x --rc-ratio = {reduce:g} is more than {MAX_COST:g}")
    if args.read is not None and args.read > reduce:
        p.error(f"--read ({args.read:g}) must be <= the reduce cost ({reduce:g})")
    return CostModel(compute=args.compute, reduce=reduce, latency=args.latency, epilogue=args.epilogue,
                     scale=args.cost_scale, masked_compute=args.masked_compute, read=args.read,
                     pipeline=args.pipeline)


def _add_cost_args(p, *, rc_default: float, pipeline: str = "writer"):
    p.add_argument("--pipeline", choices=("writer", "serial"), default=pipeline,
                   help="writer: the kernel (dQ adds on a writer warp per sdQ buffer, overlapping the MMA "
                        "work); serial: the paper's DAG (compute -> reduce on the SM)"
                        f" (default {pipeline})")
    p.add_argument("--read", type=nonnegative_float, default=None,
                   help="writer: time until an add has read its sdQ buffer (default: the reduce cost)")
    p.add_argument("--masked-compute", type=nonnegative_float, default=None,
                   help="compute cost of a step whose tile needs the mask (default: --compute)")
    p.add_argument("--compute", type=positive_float, default=1.0,
                   help="c: compute cost of one tile step (default 1)")
    p.add_argument("--rc-ratio", type=nonnegative_float, default=rc_default,
                   help=f"r/c when --reduce is not given (default {rc_default})")
    p.add_argument("--reduce", type=nonnegative_float, default=None, help="r: cost of one dQ tile add")
    p.add_argument("--latency", type=nonnegative_float, default=0.0,
                   help="semaphore hand-off delay, in the same units (writer: every hand-off; serial: "
                        "between SMs) (default 0)")
    p.add_argument("--epilogue", type=nonnegative_float, default=0.0,
                   help="cost of a task's dK/dV epilogue (default 0)")
    p.add_argument("--cost-scale", choices=("constant", "elements"), default="constant",
                   help="constant per-step costs, or scaled by valid elements/rows of each tile")


def _add_shape_args(p, *, seqlen_required: bool):
    p.add_argument("--seqlen", type=seqlen_int, required=seqlen_required, help="seqlen_q")
    p.add_argument("--seqlen-k", type=seqlen_int, default=None, help="seqlen_k (default: seqlen)")
    p.add_argument("--headdim", type=headdim, default=128,
                   help=f"one of {', '.join(map(str, variants.HEADDIMS))} (default 128)")
    p.add_argument("--heads", type=heads_int, default=16)
    p.add_argument("--heads-kv", type=heads_int, default=None, help="kv heads (GQA); default: heads")
    p.add_argument("--batch", type=batch_int, default=1)
    p.add_argument("--causal", action="store_true")


def _shape_geometry(p, args, block_m=None, block_n=None) -> Geometry:
    """The Geometry of the shape arguments; argparse-style exit on a bad combination."""
    try:
        bm, bn = bwd_block_sizes(args.headdim)
        return Geometry(batch=args.batch, heads=args.heads, heads_kv=args.heads_kv, seqlen_q=args.seqlen,
                        seqlen_k=args.seqlen_k or args.seqlen, block_m=block_m or bm, block_n=block_n or bn,
                        mask="causal" if args.causal else "full")
    except ValueError as e:
        p.error(str(e))


def _real_main(argv) -> int:
    p = OneLineParser(prog="python -m dash_fa3.schedule",
                description="Simulate the DASH backward schedules on a real shape (the default subcommand, "
                            "'shape').",
                epilog="subcommands (python -m dash_fa3.schedule SUBCOMMAND --help):\n"
                       + "\n".join(f"  {k:<11} {v}" for k, v in SUBCOMMANDS.items()),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_shape_args(p, seqlen_required=True)
    p.add_argument("--schedule", default="all", help="a name, a comma list, or all")
    p.add_argument("--sms", type=sms_int, default=132,
                   help="SM count = persistent CTAs (132 H100/H200 SXM, 114 PCIe)")
    p.add_argument("--block-m", type=block_int, default=None, help="Q tile rows (default from head dim)")
    p.add_argument("--block-n", type=block_int, default=None, help="KV tile rows (default from head dim)")
    _add_cost_args(p, rc_default=0.25)
    p.add_argument("--gantt-dir", default="gantt", help="where to write Gantt PNGs (default ./gantt)")
    p.add_argument("--no-gantt", action="store_true")
    p.add_argument("--no-critical-path", action="store_true")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.add_argument("--calibrated", action="store_true",
                   help="the fitted H100 costs (model/calibration.py, microseconds) instead of the cost "
                        "arguments; adds each schedule's predicted ms of the whole backward call")
    args = p.parse_args(argv)
    g = _shape_geometry(p, args, args.block_m, args.block_n)
    check_size(p, g)
    names = _for_shape(_schedule_list(p, args.schedule), g)
    costs = _costs_from(p, args)
    cal = None
    if args.calibrated:
        from .calibration import H100 as cal
        costs = cal.cost_model(args.headdim, g)
    if not args.no_gantt:
        writable_dir(p, args.gantt_dir, "--gantt-dir")
    rows = []
    for name in names:
        gp = None
        if not args.no_gantt:
            gp = os.path.join(args.gantt_dir, f"{name}_{g.mask}_b{g.batch}h{g.heads}_sq{g.seqlen_q}_sk{g.seqlen_k}"
                                              f"_bm{g.block_m}bn{g.block_n}_sms{args.sms}.png")
        rows.append(evaluate(name, g, args.sms, costs, want_cp=not args.no_critical_path, gantt_path=gp))
        if cal is not None and rows[-1].get("valid"):
            header = build_schedule(name, g, args.sms, validate=False).meta.header
            rows[-1]["predicted_ms"] = (cal.call_overhead_us(g, args.headdim, header=header)
                                        + rows[-1]["makespan"]) / 1000.0
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{g.describe()}; headdim {args.headdim}; {args.sms} SMs; c={costs.compute:g} r={costs.reduce:g} "
              f"latency={costs.latency:g} ({costs.scale} costs, {costs.pipeline} pipeline)")
        print(_fmt_table(rows))
        if cal is not None:
            print(f"predicted ms of the backward call ({cal.device}, costs of {cal.data.split(':')[0]}): "
                  + ", ".join(f"{r['schedule']} {r['predicted_ms']:.3f}" for r in rows if r.get("valid")))
        if not args.no_gantt:
            print(f"Gantt charts in {args.gantt_dir}/")
    return 0 if all(r.get("valid") for r in rows) else 1


def _model_main(argv) -> int:
    p = OneLineParser(prog="python -m dash_fa3.schedule model",
                description="The paper's model: n KV tiles = n SMs, m heads, square tiles.")
    tiles = bounded_int(1, MAX_SEQLEN // 64)
    p.add_argument("--kv-tiles", "-n", type=tiles, required=True)
    p.add_argument("--heads", "-m", type=heads_int, required=True)
    p.add_argument("--q-tiles", type=tiles, default=None, help="Q tiles (default: kv tiles)")
    p.add_argument("--sms", type=sms_int, default=None, help="SMs (default: kv tiles)")
    p.add_argument("--mask", choices=("full", "causal"), default="full")
    p.add_argument("--schedule", default="all")
    _add_cost_args(p, rc_default=1.0, pipeline="serial")
    p.add_argument("--json", action="store_true")
    p.add_argument("--gantt", default=None, help="PNG path (single schedule) or directory (all)")
    args = p.parse_args(argv)
    n, m = args.kv_tiles, args.heads
    g = Geometry.model(n, m, args.mask, n_q=args.q_tiles)   # O(tiles): its steps are counted, not made
    check_size(p, g)
    sms = args.sms or n
    costs = _costs_from(p, args)
    names = _for_shape(_schedule_list(p, args.schedule), g)
    gantt_dir = None
    if args.gantt:
        if len(names) > 1 or os.path.isdir(args.gantt):
            gantt_dir = args.gantt
        writable_dir(p, gantt_dir or os.path.dirname(os.path.abspath(args.gantt)), "--gantt")
    rows = []
    for name in names:
        gp = None
        if args.gantt:
            gp = os.path.join(gantt_dir, f"model_{args.mask}_{name}_n{n}_m{m}.png") if gantt_dir else args.gantt
        r = evaluate(name, g, sms, costs, gantt_path=gp)
        r.update(mask=args.mask, n=n, m=m, compute=costs.compute, reduce=costs.reduce, latency=costs.latency,
                 paper_makespan=paper_makespan(args.mask, r["schedule"], n, m, costs.compute, costs.reduce))
        rows.append(r)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows))
    else:
        print(f"model: {args.mask} mask, n={n} KV tiles, m={m} heads, {sms} SMs, c={costs.compute:g} "
              f"r={costs.reduce:g} latency={costs.latency:g}")
        print(_fmt_table(rows))
        for r in rows:
            if r.get("paper_makespan") is not None:
                print(f"  paper closed form for {r['schedule']}: {r['paper_makespan']:g}")
    return 0 if all(r.get("valid") for r in rows) else 1


def _grid_main(argv) -> int:
    p = OneLineParser(prog="python -m dash_fa3.schedule bench-grid",
                description="Validate (and optionally simulate) every schedule on the bench grid.")
    p.add_argument("--grid", default=None, help="bench_grid.json (default: the paper's grid)")
    p.add_argument("--sms", type=sm_list, default=[132, 114])
    p.add_argument("--schedule", default="all")
    p.add_argument("--simulate", action="store_true", help="also simulate (prints makespan/lower bound)")
    _add_cost_args(p, rc_default=0.25)
    args = p.parse_args(argv)
    grid = dict(DEFAULT_GRID)
    if args.grid:
        try:
            with open(args.grid) as f:
                grid.update(json.load(f))
        except (OSError, ValueError) as e:
            p.error(f"--grid {args.grid!r}: {getattr(e, 'strerror', None) or e}")
    try:
        geometries = list(grid_geometries(grid))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        p.error(f"bench grid: {e!r} (needs headdims, seqlens, masks, total_tokens and hidden)")
    for _, g in geometries:
        check_size(p, g)
    costs = _costs_from(p, args)
    names = _schedule_list(p, args.schedule)
    ok = True
    t0 = time.time()
    for sms in args.sms:
        for label, g in geometries:
            cells = []
            for name in _for_shape(names, g):
                try:
                    s = build_schedule(name, g, sms)
                    cell = "ok"
                    if args.simulate:
                        cell = f"{simulate(s, costs).ratio:.3f}"
                except ScheduleError as e:
                    ok = False
                    cell = f"REFUSED ({e})"
                cells.append(f"{name}={cell}")
            print(f"sms={sms:<4} {label:<22} steps={g.num_steps:<7} " + " ".join(cells), flush=True)
    print(f"{'all valid' if ok else 'SOME REFUSED'} in {time.time() - t0:.1f}s"
          + ("  (cells: makespan / lower bound)" if args.simulate else ""))
    return 0 if ok else 1


# (file stem, mask, schedule, n, m) of the paper-model charts in docs/gantt; c = 1, r = 0.5
GALLERY = [
    ("full", "fa3", 4, 2), ("full", "shift", 4, 2),
    ("full", "fa3", 8, 3), ("full", "shift", 8, 3),
    ("causal", "fa3", 6, 2), ("causal", "descending", 6, 2), ("causal", "symmetric_shift", 6, 2),
    ("causal", "fa3", 8, 4), ("causal", "spt", 8, 4), ("causal", "descending", 8, 4),
    ("causal", "symmetric_shift", 8, 4), ("causal", "symmetric_shift", 5, 2),
]


def _gallery_main(argv) -> int:
    p = OneLineParser(prog="python -m dash_fa3.schedule gallery",
                      description="Write the Gantt charts of docs/design/schedule.md.")
    p.add_argument("--out", default=os.path.join("docs", "gantt"))
    p.add_argument("--compute", type=positive_float, default=1.0)
    p.add_argument("--reduce", type=nonnegative_float, default=0.5)
    args = p.parse_args(argv)
    from .plot import plot_gantt

    writable_dir(p, args.out, "--out")
    costs = CostModel(args.compute, args.reduce, pipeline="serial")  # the paper's model
    for mask, name, n, m in GALLERY:
        g = Geometry.model(n, m, mask)
        sched = build_schedule(name, g, n)
        sim = simulate(sched, costs)
        path = os.path.join(args.out, f"{mask}_{name}_n{n}_m{m}.png")
        pm = paper_makespan(mask, name, n, m, costs.compute, costs.reduce)
        title = (f"{name}, {mask} mask: n={n} KV tiles = {n} SMs, m={m} heads, c={costs.compute:g}, "
                 f"r={costs.reduce:g}\nmakespan {sim.makespan:g} (lower bound {sim.lower_bound:g}"
                 + (f", paper {pm:g}" if pm is not None else "") + f"), {sim.waits} semaphore waits")
        plot_gantt(sched, sim, path, title=title)
        print(f"{path}: makespan {sim.makespan:g}")
    # a real-shape example with GQA and ragged tiles on 16 SMs
    g = Geometry(batch=1, heads=4, heads_kv=2, seqlen_q=1000, seqlen_k=1000, block_m=64, block_n=128,
                 mask="causal")
    for name in ("descending", "symmetric_shift"):
        sched = build_schedule(name, g, 16)
        sim = simulate(sched, costs.replace(epilogue=1.0))
        path = os.path.join(args.out, f"gqa_causal_{name}_s1000_sms16.png")
        title = (f"{name}: causal, seqlen 1000, block 64x128 (8 KV x 16 Q tiles, ragged), 4 q heads / 2 kv heads, "
                 f"16 SMs\nc={costs.compute:g}, r={costs.reduce:g}, epilogue 1 (dK/dV stores); "
                 f"makespan {sim.makespan:g}, lower bound {sim.lower_bound:.4g}")
        plot_gantt(sched, sim, path, title=title)
        print(f"{path}: makespan {sim.makespan:g}")
    return 0


def _calibrate_main(argv) -> int:
    from . import calibration as C
    p = OneLineParser(
        prog="python -m dash_fa3.schedule calibrate",
        description="The simulator against the measured H100 grid (model/calibration.py): per grid point and "
                    "schedule measured / predicted ms and error, the ranking agreement; --fit refits the costs "
                    "on the --train seqlens first (needs scipy; minutes).")
    p.add_argument("--fit", action="store_true", help="refit the costs (from the shipped ones) before the table")
    p.add_argument("--train", type=int_list, default=None,
                   help="seqlens of the grid the fit uses (default 512,2048,8192; the rest are held out)")
    p.add_argument("--headdim", type=int_list, default=None, help="head dims (default: all of the grid)")
    p.add_argument("--seqlens", type=int_list, default=None, help="seqlens of the table (default: all)")
    p.add_argument("--max-evals", type=bounded_int(1, 100000), default=None,
                   help="fit: evaluations per head dim (default 80 on the grid, 400 on the calls)")
    p.add_argument("--workers", type=bounded_int(1, 256), default=min(4, os.cpu_count() or 1))
    p.add_argument("--json", action="store_true", help="print rows, ranking and summary as JSON")
    p.add_argument("--calls", action="store_true",
                   help="judge (and with --fit refit) on the measured calls of model/measured.py (H100, 818979a: "
                        "square, rectangular and GQA shapes, every schedule), fitted on the sources "
                        "grid, first and held_out, the rest held out")
    args = p.parse_args(argv)
    if args.calls:
        for flag, given in (("--train", args.train), ("--seqlens", args.seqlens)):
            if given is not None:
                p.error(f"{flag} selects grid cells; with --calls the fit's sources are fixed "
                        f"(calibration.CALLS_TRAIN_SOURCES)")
        return _calibrate_calls(p, args)
    train = tuple(args.train or (512, 2048, 8192))
    grid = C.H100_B064A4D
    cal = C.H100
    measured, lengths = {r[0] for r in grid.rows}, {r[2] for r in grid.rows}
    hds = tuple(args.headdim) if args.headdim else tuple(sorted(measured))
    for what, given, known in (("--headdim", hds, measured), ("--seqlens", args.seqlens or (), lengths),
                               ("--train", train, lengths)):
        unknown = sorted(set(given) - known)
        if unknown:
            p.error(f"{what} {unknown} not in the measured grid ({', '.join(map(str, sorted(known)))})")
    if args.fit:
        cal = C.refit(cal, grid, train, hds, args.workers, args.max_evals or 80,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    rows = C.evaluate_grid(cal, grid, train, hds, args.workers, args.seqlens)
    ranks = C.ranking(rows)
    summary = C.summarize(rows, ranks)
    if args.json:
        print(json.dumps(dict(calibration=cal.to_dict(), rows=rows, ranking=ranks, summary=summary), indent=1))
    else:
        print(f"calibration: {cal.device}, {cal.num_sms} SMs; data: {cal.data}; fitted: {cal.fitted}")
        for hd in hds:
            print(f"  hdim {hd}: {cal.headdims[hd]}")
        print("cells: measured / predicted ms (error)")
        print(C.format_table(rows, ranks))
        print(json.dumps(summary, indent=1))
    return 0


def _calibrate_calls(p, args) -> int:
    from . import calibration as C
    from .measured import H100_818979A as calls
    cal = C.H100
    known = sorted({c.headdim for c in calls.calls} & set(cal.headdims))
    unknown = sorted(set(args.headdim or ()) - set(known))
    if unknown:
        p.error(f"--headdim {unknown}: no measured calls ({', '.join(map(str, known))})")
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    log(f"preparing {len(calls.calls)} calls of {calls.device}, {calls.date}, {calls.commit}")
    cells = C.call_cells(calls.calls, calls.num_sms, cal)
    if args.headdim:
        cells = [c for c in cells if c.hdim in args.headdim]
    if args.fit:
        cal = C.refit_calls(cal, cells, headdims=args.headdim, workers=args.workers,
                            max_evals=args.max_evals or 400, log=log)
    rows = C.evaluate_calls(cal, cells)
    summary = C.summarize_calls(rows)
    if args.json:
        print(json.dumps(dict(calibration=cal.to_dict(), rows=rows, summary=summary), indent=1))
    else:
        print(f"calibration: {cal.device}; fitted: {cal.fitted}")
        for hd in sorted(cal.headdims):
            print(f"  hdim {hd}: {cal.headdims[hd]}")
        print(f"calls: {calls.source}; fit on {', '.join(C.CALLS_TRAIN_SOURCES)}")
        print(json.dumps(summary, indent=1))
    return 0


def _export_main(argv) -> int:
    p = OneLineParser(
        prog="python -m dash_fa3.schedule export",
        description="Write the kernel's validated static schedule metadata (a bundle of flat int32 buffers, "
                    "dash_fa3/schedule/export.py) for programs without Python, e.g. benchmarks/cpp/bwd_bench.")
    p.add_argument("--out", required=True, help="bundle file to write")
    p.add_argument("--sms", type=sms_int, default=132,
                   help="SM count of the GPU that will run them (132 H100/H200 SXM, 114 PCIe)")
    p.add_argument("--schedule", default="fa3,spt", help="a name, a comma list, or all (default fa3,spt)")
    p.add_argument("--shapes", default=None,
                   help="file of shape lines 'batch heads heads_kv seqlen_q seqlen_k headdim causal' "
                        "('-': stdin; e.g. the output of bwd_bench shapes CMD); else the shape arguments")
    _add_shape_args(p, seqlen_required=False)
    args = p.parse_args(argv)
    names = _schedule_list(p, args.schedule)
    if args.shapes is not None:
        try:
            lines = sys.stdin.read().splitlines() if args.shapes == "-" else open(args.shapes).read().splitlines()
        except OSError as e:
            p.error(f"--shapes {args.shapes!r}: {e.strerror or e}")
        try:
            geometries = [g for g in map(export.parse_shape_line, lines) if g is not None]
        except ValueError as e:
            p.error(str(e))
    elif args.seqlen is None:
        p.error("give --shapes or --seqlen (and the other shape arguments)")
    else:
        geometries = [_shape_geometry(p, args)]
    for g in geometries:
        if g.n_q * g.n_kv > MAX_HEAD_CELLS:
            p.error(f"{g.describe()}: {g.n_q:,} x {g.n_kv:,} tiles per head is more than the {MAX_HEAD_CELLS:,} "
                    f"the metadata check walks")
        if g.num_heads_total * g.n_kv > MAX_TASKS:
            p.error(f"{g.describe()}: {g.num_heads_total * g.n_kv:,} tasks is more than the {MAX_TASKS:,} an "
                    f"exported schedule holds")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.access(out_dir, os.W_OK):
        p.error(f"--out {args.out!r} is a directory or not writable")
    try:
        metas = [get_kernel_metadata(name, g, args.sms, "static") for g in geometries
                 for name in _for_shape(names, g)]
    except (ScheduleError, OverflowError) as e:
        p.error(str(e))
    try:
        n = export.write_bundle(args.out, metas)
    except OSError as e:
        p.error(f"--out {args.out!r}: {e.strerror or e}")
    which = "all" if names is None else ", ".join(names)
    print(f"{args.out}: {len(metas)} schedules ({which}) for {len(geometries)} shapes, {args.sms} SMs, {4 * n} bytes")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return _export_main(argv[1:])
    if argv and argv[0] == "model":
        return _model_main(argv[1:])
    if argv and argv[0] == "bench-grid":
        return _grid_main(argv[1:])
    if argv and argv[0] == "gallery":
        return _gallery_main(argv[1:])
    if argv and argv[0] == "calibrate":
        return _calibrate_main(argv[1:])
    if argv and argv[0] == "shape":
        argv = argv[1:]
    return _real_main(argv)


if __name__ == "__main__":
    sys.exit(main())
