"""dash_fa3 side by side with upstream FlashAttention-3, FlashAttention-4 and cuDNN SDPA on the
paper's grid (dash_fa3/schedule/bench_grid.json), interleaved in rounds in one process.

    python benchmarks/bench_peers.py [--direction fwd|bwd|both] [--hdims 64 128] [--seqlens 512 1024 ...]
                                     [--masks full causal] [--rounds 3] [--json out.json] [--png ratios.png]

Per grid point (bf16 random normal inputs, seeded per point):
  1. a check, before any timing, that our forward output and backward gradients
     agree with FA3's (FA4's, cuDNN's) within bf16 tolerance, so the harness is
     known to time the same computation (a failure is a warning column);
  2. `--rounds` rounds; each times every implementation once, the order rotated
     by one per round, each timing the median of `--iters` CUDA-event samples
     with a queued device wait hiding the host time (dash_fa3._timing.median_ms,
     hide_host=True): GPU time per call.
Implementations: ours forward, non-deterministic backward, deterministic backward
with every schedule and with `auto`; FA3's forward and backward (non-deterministic
and deterministic), the ops FA3's autograd calls (benchmarks/peers/fa3.py); the
same of FA4 (the `flash-attn-4` package, benchmarks/peers/fa4.py); cuDNN SDPA
forward (no grad) and backward (torch.autograd.grad on a retained graph).
Each backward timing is what that library's backward costs: for ours the whole
dash_fa3::bwd op, for FA3 and FA4 their backward with pre- and postprocess.

Reported: TFLOP/s (fwd = 4*b*h*s^2*d, halved when causal; bwd = 2.5x fwd), the
median over rounds, and the ratios
  nd/FA3 nd          ours non-deterministic bwd / FA3 non-deterministic bwd
  nd/FA4 nd          the same against FA4
  best det/FA3 det   our best deterministic schedule / FA3 deterministic bwd
  best det/FA4 det   the same against FA4
  best det/max nd    our best deterministic schedule / max nd
  auto/max nd        ours deterministic `auto` / max nd
  fwd/max fwd        ours fwd / max(FA3 fwd, FA4 fwd, cuDNN fwd)
where max nd = max(ours nd, FA3 nd, FA4 nd, cuDNN bwd), each over the peers
present, with min/median/max rows. A missing peer (FA3 not built:
benchmarks/peers/build_fa3.py; FA4 not installed) is `n/a` with its reason,
unless --require-fa3 / --require-fa4. DASH_FA3_COMMIT overrides the
commit read from git.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH_DIR)

import torch  # noqa: E402

from dash_fa3 import _ext  # noqa: E402
from dash_fa3._timing import attention_flops, commit_label, median_ms  # noqa: E402
from dash_fa3.schedule import SCHEDULES  # noqa: E402
from peers import fa3 as fa3_peer  # noqa: E402
from peers import fa4 as fa4_peer  # noqa: E402

GRID = os.path.join(REPO, "dash_fa3", "schedule", "bench_grid.json")
# Timed by default; --schedules takes any of dash_fa3.schedule.SCHEDULES.
DEFAULT_SCHEDULES = ("fa3", "spt", "descending", "shift", "symmetric_shift", "lpt")
PEERS = ("fa3", "fa4", "cudnn")
MASKS = ("full", "causal")

FWD_IMPLS = ("FA3 fwd", "FA4 fwd", "cuDNN fwd", "ours fwd")
RATIOS = ("nd/FA3 nd", "nd/FA4 nd", "best det/FA3 det", "best det/FA4 det", "best det/max nd", "auto/max nd",
          "fwd/max fwd")
BWD_RATIOS = RATIOS[:6]
FWD_RATIOS = RATIOS[6:]
PEER_DET = ("FA3 det", "FA4 det")


def det_name(schedule: str) -> str:
    return f"ours det {schedule}"


def bwd_impls(schedules) -> tuple[str, ...]:
    return ("FA3 nd", "FA3 det", "FA4 nd", "FA4 det", "cuDNN bwd", "ours nd", *(det_name(s) for s in schedules),
            "ours auto")


def nondeterministic(names) -> list[str]:
    """names without the deterministic backwards (--nd-only)."""
    return [n for n in names if n not in (*PEER_DET, "ours auto") and not n.startswith("ours det ")]


def impl_names(direction: str, schedules) -> tuple[str, ...]:
    """Every implementation timed for a direction, in the first round's order."""
    return (FWD_IMPLS if direction != "bwd" else ()) + (bwd_impls(schedules) if direction != "fwd" else ())


def impl_direction(name: str) -> str:
    return "fwd" if name in FWD_IMPLS else "bwd"


def impl_peer(name: str) -> str:
    for prefix, peer in (("FA3", "fa3"), ("FA4", "fa4"), ("cuDNN", "cudnn")):
        if name.startswith(prefix):
            return peer
    return "ours"


def rotated(names, round_index: int) -> list:
    """Round r starts one implementation later than round r-1, so none always
    runs right after the same other one or always first."""
    names = list(names)
    if not names:
        return names
    k = round_index % len(names)
    return names[k:] + names[:k]


# ---------------------------------------------------------------- arguments


def _flat(values, convert, what):
    out = []
    for v in values:
        for part in str(v).split(","):
            if part.strip():
                try:
                    out.append(convert(part.strip()))
                except ValueError:
                    raise argparse.ArgumentTypeError(f"{what}: {part!r}") from None
    return out


def parse_args(argv=None, grid=None):
    grid = grid or json.load(open(GRID))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    ap.add_argument("--hdims", nargs="+", default=grid["headdims"],
                    help="head dims (space or comma list); 192v128: q/k 192 with v 128 (MLA)")
    ap.add_argument("--seqlens", nargs="+", default=grid["seqlens"], help="sequence lengths (space or comma list)")
    ap.add_argument("--masks", nargs="+", default=grid["masks"], help="full, causal")
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                    help="our deterministic schedules to time (auto is always timed too)")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of fa3, fa4, cudnn, or ''")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point (median over rounds)")
    ap.add_argument("--iters", type=int, default=10, help="CUDA-event samples per timing (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before each timing")
    ap.add_argument("--fa3-build", default=str(fa3_peer.DEFAULT_BUILD_DIR), help="FA3 build folder (build_fa3.py)")
    ap.add_argument("--require-fa3", action="store_true", help="fail instead of reporting FA3 as n/a")
    ap.add_argument("--require-fa4", action="store_true", help="fail instead of reporting FA4 as n/a")
    ap.add_argument("--fa3-prealloc", action="store_true",
                    help="time FA3's backward into preallocated dq/dk/dv (default: fresh ones, as its autograd)")
    ap.add_argument("--check-tol", type=float, default=0.02,
                    help="relative (Frobenius) difference above which a peer disagrees with us")
    ap.add_argument("--no-check", action="store_true", help="skip the per-point agreement check")
    ap.add_argument("--nd-only", action="store_true",
                    help="time only the non-deterministic backwards (ours nd, FA3 nd, cuDNN) and forwards, e.g. "
                         "for a DASH_FA3_BWD_FIXED_STEPS=1 measurement build, which has no deterministic mode")
    ap.add_argument("--skip", default="",
                    help="comma list of implementations not to time, e.g. 'FA4 det' where a peer has no such mode")
    ap.add_argument("--seed", type=int, default=0, help="base seed; each point adds its own offset")
    ap.add_argument("--json", help="write every raw sample and the table's figures here")
    ap.add_argument("--png", help="draw the ratios per grid point here (matplotlib)")
    args = ap.parse_args(argv)

    try:
        args.hdims = _flat(args.hdims, hdim_pair, "--hdims")
        args.seqlens = _flat(args.seqlens, int, "--seqlens")
        args.masks = _flat(args.masks, str, "--masks")
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    args.schedules = _flat([args.schedules], str, "--schedules")
    args.peers = _flat([args.peers], str, "--peers")
    args.skip = [n.strip() for n in args.skip.split(",") if n.strip()]
    known = set(impl_names("both", SCHEDULES))
    if unknown := [n for n in args.skip if n not in known]:
        ap.error(f"--skip: unknown {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    for d, _ in args.hdims:
        if d <= 0 or d > grid["hidden"]:
            ap.error(f"--hdims: {d} must be in 1..{grid['hidden']} (the grid's hidden size)")
    for s in args.seqlens:
        if s <= 0 or grid["total_tokens"] % s:
            ap.error(f"--seqlens: {s} does not divide the grid's {grid['total_tokens']} tokens")
    for name, values, allowed in (("--masks", args.masks, MASKS), ("--schedules", args.schedules, SCHEDULES),
                                  ("--peers", args.peers, PEERS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{name}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if not (args.hdims and args.seqlens and args.masks):
        ap.error("--hdims, --seqlens and --masks each need at least one value")
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--rounds and --iters must be >= 1, --warmup >= 0")
    return args


def hdim_pair(text) -> tuple[int, int]:
    """A --hdims entry: "128" (or 128) is (128, 128), "192v128" q/k 192 with v 128; a pair stays."""
    if isinstance(text, tuple):
        return text
    d, _, dv = str(text).partition("v")
    return int(d), int(dv or d)


def hdim_v(p: dict) -> int:
    """A point's value head dim (points built elsewhere may leave it out: the head dim)."""
    return p.get("hdim_v", p["hdim"])


def hdim_label(p: dict) -> str:
    return str(p["hdim"]) if hdim_v(p) == p["hdim"] else f"{p['hdim']}v{hdim_v(p)}"


def grid_points(grid, hdims, seqlens, masks) -> list[dict]:
    """The grid's shapes for the chosen (head dim, value head dim) pairs, lengths and masks
    (hdim-major, then mask, then length): batch = tokens / seqlen, heads = hidden // hdim (as
    FA3's benchmark: a head dim that does not divide the hidden size, e.g. 192 of
    2048, gets the largest whole number of heads, 10)."""
    return [{"hdim": d, "hdim_v": dv, "mask": m, "seqlen": s, "batch": grid["total_tokens"] // s,
             "heads": grid["hidden"] // d}
            for d, dv in map(hdim_pair, hdims) for m in masks for s in seqlens]


def nd_runs_ordered(p: dict, num_sms: int = 132) -> bool:
    """Whether our non-deterministic call (schedule auto) at point p runs the kernel's deterministic
    mode, the faster where a Q tile takes few dQ adds (dash_fa3.schedule.policy.nd_runs_ordered)."""
    from dash_fa3.schedule import Geometry, resolve_call

    g = Geometry.from_shape(batch=p["batch"], heads=p["heads"], heads_kv=p.get("heads_kv", p["heads"]),
                            seqlen_q=p["seqlen"], headdim=p["hdim"], causal=p["mask"] == "causal")
    return resolve_call("auto", g, False, num_sms=num_sms, headdim=p["hdim"])[1]


def point_flops(p: dict, direction: str) -> float:
    return attention_flops(p["batch"], p["heads"], p["seqlen"], p["seqlen"], p["hdim"], p["mask"] == "causal",
                           direction, hdim_v(p))


# ---------------------------------------------------------------- figures


def tflops_from_rounds(round_ms: dict, flops: dict) -> dict:
    """name -> TFLOP/s: the median over rounds of flops / (that round's median ms);
    None where an implementation has no timing."""
    out = {}
    for name, times in round_ms.items():
        vals = [flops[impl_direction(name)] / ms / 1e9 for ms in times if ms and ms > 0]
        out[name] = statistics.median(vals) if vals else None
    return out


def _ratio(num, den):
    return num / den if num is not None and den else None


def _max_present(values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


def best_det(tf: dict, schedules) -> tuple[float | None, str | None]:
    best = [(tf.get(det_name(s)), s) for s in schedules if tf.get(det_name(s)) is not None]
    if not best:
        return None, None
    return max(best)


def point_ratios(tf: dict, schedules) -> dict:
    """The ratios of one point (None where a side is missing). The maxima run over
    the implementations present, so without FA3 and FA4 "auto/max nd" compares
    against ours and cuDNN only."""
    best, _ = best_det(tf, schedules)
    max_nd = _max_present([tf.get(n) for n in ("ours nd", "FA3 nd", "FA4 nd", "cuDNN bwd")])
    return {
        "nd/FA3 nd": _ratio(tf.get("ours nd"), tf.get("FA3 nd")),
        "nd/FA4 nd": _ratio(tf.get("ours nd"), tf.get("FA4 nd")),
        "best det/FA3 det": _ratio(best, tf.get("FA3 det")),
        "best det/FA4 det": _ratio(best, tf.get("FA4 det")),
        "best det/max nd": _ratio(best, max_nd),
        "auto/max nd": _ratio(tf.get("ours auto"), max_nd),
        "fwd/max fwd": _ratio(tf.get("ours fwd"), _max_present([tf.get(n) for n in ("FA3 fwd", "FA4 fwd",
                                                                                    "cuDNN fwd")])),
    }


def summarize(ratio_rows: list[dict]) -> dict:
    """{"min"|"median"|"max": {ratio: value or None}} over the points that have it."""
    out = {"min": {}, "median": {}, "max": {}}
    for key in RATIOS:
        vals = [r[key] for r in ratio_rows if r.get(key) is not None and not math.isnan(r[key])]
        for stat, fn in (("min", min), ("median", statistics.median), ("max", max)):
            out[stat][key] = fn(vals) if vals else None
    return out


def columns(direction: str, schedules) -> list[str]:
    cols = list(FWD_IMPLS) if direction != "bwd" else []
    if direction != "fwd":
        cols += [*bwd_impls(schedules), "best det"]
    cols += [r for r in RATIOS if (r in BWD_RATIOS and direction != "fwd") or (r in FWD_RATIOS and direction != "bwd")]
    return cols + ["check"]


def _header_name(col: str) -> str:
    return col.replace("ours det ", "det ")


def table_header(cols) -> str:
    return ("| hdim | mask | seqlen | " + " | ".join(_header_name(c) for c in cols) + " |\n"
            + "|---|---|---|" + "---|" * len(cols))


def format_row(p: dict, tf: dict, ratios: dict, check: str, cols, schedules) -> str:
    cells = []
    for c in cols:
        if c == "check":
            cells.append(check)
        elif c == "best det":
            best, sched = best_det(tf, schedules)
            cells.append(f"{best:.0f} ({sched})" if best is not None else "n/a")
        elif c in RATIOS:
            cells.append(f"{ratios[c]:.2f}" if ratios.get(c) is not None else "n/a")
        else:
            cells.append(f"{tf[c]:.0f}" if tf.get(c) is not None else "n/a")
    return f"| {hdim_label(p)} | {p['mask']} | {p['seqlen']} | " + " | ".join(cells) + " |"


def format_summary(summary: dict, cols) -> list[str]:
    lines = []
    for stat in ("min", "median", "max"):
        cells = [f"{summary[stat][c]:.2f}" if summary[stat].get(c) is not None else ("n/a" if c in RATIOS else "")
                 for c in cols]
        lines.append(f"| {stat} | | | " + " | ".join(cells) + " |")
    return lines


def point_label(p: dict) -> str:
    s = p["seqlen"]
    return (f"d{hdim_label(p)} {p['mask']} {s // 1024}k" if s >= 1024 and s % 1024 == 0
            else f"d{hdim_label(p)} {p['mask']} {s}")


def draw_png(path: str, points: list[dict], ratio_rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(points) + 3), 5))
    xs = list(range(len(points)))
    for key, marker in zip(RATIOS, "osD^vx*"):
        ys = [r.get(key) if r.get(key) is not None else float("nan") for r in ratio_rows]
        if any(not math.isnan(y) for y in ys):
            ax.plot(xs, ys, marker=marker, linewidth=1, label=key)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(xs)
    ax.set_xticklabels([point_label(p) for p in points], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("ratio (TFLOP/s / TFLOP/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- GPU side


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def point_seed(base: int, p: dict) -> int:
    return base + 1000 * p["hdim"] + 7 * (p["hdim"] - hdim_v(p)) + 2 * p["seqlen"] + (p["mask"] == "causal")


def make_inputs(p: dict, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (p["batch"], p["seqlen"], p["heads"], p["hdim"])
    shape_v = (*shape[:3], hdim_v(p))  # v and dout
    return tuple(torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) for s in (shape, shape, shape_v, shape_v))


def _cudnn_fwd(q, k, v, causal, grad):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(grad) for t in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return run, (qt, kt, vt)


def _cudnn_bwd(q, k, v, dout, causal):
    """(callable, grads): one forward with grad, then autograd.grad over the
    retained graph, so each call runs only cuDNN's backward."""
    fwd, leaves = _cudnn_fwd(q, k, v, causal, True)
    out = fwd()
    dout_t = dout.transpose(1, 2)
    return lambda: torch.autograd.grad(out, leaves, dout_t, retain_graph=True)


def make_impls(names, q, k, v, dout, causal, fa3, prealloc, fa4=None) -> tuple[dict, dict]:
    """(name -> no-argument callable, name -> error) for the implementations asked for."""
    from dash_fa3 import ops

    scale = q.shape[-1] ** -0.5
    fns, errors = {}, {}
    ours_fwd_out = {}

    def ours_out():
        if "v" not in ours_fwd_out:
            ours_fwd_out["v"] = ops.fwd(q, k, v, scale, causal, 0)
        return ours_fwd_out["v"]

    def ours_bwd(deterministic, schedule):
        out, lse = ours_out()
        return lambda: ops.bwd(dout, q, k, v, out, lse, scale, causal, deterministic, schedule, 0)

    makers = {
        "ours fwd": lambda: (lambda: ops.fwd(q, k, v, scale, causal, 0)),
        "ours nd": lambda: ours_bwd(False, "auto"),
        "ours auto": lambda: ours_bwd(True, "auto"),
        "FA3 fwd": lambda: fa3_peer.forward_fn(fa3, q, k, v, causal),
        "FA3 nd": lambda: fa3_peer.backward_fn(fa3, q, k, v, dout, causal, False, prealloc),
        "FA3 det": lambda: fa3_peer.backward_fn(fa3, q, k, v, dout, causal, True, prealloc),
        "FA4 fwd": lambda: fa4_peer.forward_fn(fa4, q, k, v, causal),
        "FA4 nd": lambda: fa4_peer.backward_fn(fa4, q, k, v, dout, causal, False),
        "FA4 det": lambda: fa4_peer.backward_fn(fa4, q, k, v, dout, causal, True),
        "cuDNN fwd": lambda: _cudnn_fwd(q, k, v, causal, False)[0],
        "cuDNN bwd": lambda: _cudnn_bwd(q, k, v, dout, causal),
    }
    for s in SCHEDULES:
        makers[det_name(s)] = lambda s=s: ours_bwd(True, s)
    for name in names:
        try:
            fns[name] = makers[name]()
        except Exception as exc:  # a peer may reject a shape; report it, keep timing the rest
            errors[name] = _first_line(exc)
    return fns, errors


def rel_diff(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_point(q, k, v, dout, causal, fa3, use_cudnn, direction, fa4=None) -> tuple[dict, dict]:
    """(peer -> {tensor: relative difference from ours}, peer -> error) on the same
    inputs; each library runs its own forward and, unless direction is fwd, its
    own backward."""
    from dash_fa3 import ops

    scale = q.shape[-1] ** -0.5
    out, lse = ops.fwd(q, k, v, scale, causal, 0)
    ours = {"out": out}
    if direction != "fwd":
        ours.update(zip(("dq", "dk", "dv"), ops.bwd(dout, q, k, v, out, lse, scale, causal, False, "auto", 0)))

    def fa3_outputs():
        f_out, f_lse = fa3_peer.forward(fa3, q, k, v, causal)
        theirs = {"out": f_out}
        if direction != "fwd":
            theirs.update(zip(("dq", "dk", "dv"), fa3_peer.backward(fa3, dout, q, k, v, f_out, f_lse, causal, False)))
        return theirs

    def fa4_outputs():
        f_out, f_lse = fa4_peer.forward(fa4, q, k, v, causal)
        theirs = {"out": f_out}
        if direction != "fwd":
            theirs.update(zip(("dq", "dk", "dv"), fa4_peer.backward(fa4, dout, q, k, v, f_out, f_lse, causal, False)))
        return theirs

    def cudnn_outputs():
        fwd, leaves = _cudnn_fwd(q, k, v, causal, direction != "fwd")
        c_out = fwd()
        theirs = {"out": c_out.transpose(1, 2)}
        if direction != "fwd":
            grads = torch.autograd.grad(c_out, leaves, dout.transpose(1, 2))
            theirs.update(zip(("dq", "dk", "dv"), (g.transpose(1, 2) for g in grads)))
        return theirs

    diffs, errors = {}, {}
    for peer, run in (("FA3", fa3_outputs if fa3 is not None else None),
                      ("FA4", fa4_outputs if fa4 is not None else None),
                      ("cuDNN", cudnn_outputs if use_cudnn else None)):
        if run is None:
            continue
        try:
            theirs = run()
            diffs[peer] = {t: rel_diff(ours[t], theirs[t]) for t in ours}
        except Exception as exc:  # the timing loop reports the same failure as n/a
            errors[peer] = _first_line(exc)
    return diffs, errors


def check_text(diffs: dict, tol: float, errors: dict | None = None) -> str:
    """"ok", or the tensors whose difference exceeds tol (NaN counts as a failure)
    and the peers whose check could not run."""
    bad = [f"{peer} {t} {d:.1e}" for peer, per in diffs.items() for t, d in per.items() if not d <= tol]
    bad += [f"{peer} not checked" for peer in (errors or {})]
    return "ok" if not bad else "WARN " + ", ".join(bad)


def time_point(fns: dict, errors: dict, rounds: int, warmup: int, iters: int) -> tuple[dict, dict]:
    """(name -> per-round median ms, name -> per-round raw samples), interleaved in rounds."""
    round_ms = {n: [] for n in fns}
    samples = {n: [] for n in fns}
    for r in range(rounds):
        for name in rotated(fns, r):
            if name in errors:
                continue
            raw = []
            try:
                round_ms[name].append(median_ms(fns[name], warmup=warmup, iters=iters, hide_host=True, samples=raw))
                samples[name].append(raw)
            except Exception as exc:
                errors[name] = _first_line(exc)
    return {n: t for n, t in round_ms.items() if t}, {n: s for n, s in samples.items() if s}


# The side-by-side tables of bench_window.py and bench_varlen.py: their own leading columns, then these.
PAIR_COLUMNS = ("ours fwd", "FA3 fwd", "ours nd", "FA3 nd", "ours det", "FA3 det")
PAIR_HEADER = (" | ".join(PAIR_COLUMNS) + " | fwd ours/FA3 | nd ours/FA3 | det ours/FA3 | det/nd ours "
               "| max rel diff out, dq vs FA3")


def pair_cells(fns: dict, fwd_flops: float, diffs, args) -> str:
    """The PAIR_HEADER cells of one configuration: ``fns`` (PAIR_COLUMNS -> call) timed in
    interleaved rounds (args.rounds, .warmup, .iters), TFLOP/s of the per-round medians' median
    (forward at ``fwd_flops``, backward 2.5x), the ratios, and ``diffs`` (out, dq vs FA3)."""
    errors: dict = {}
    round_ms, _ = time_point(fns, errors, args.rounds, args.warmup, args.iters)
    tf = {}
    for name, ms in round_ms.items():
        flops = fwd_flops if name.endswith("fwd") else 2.5 * fwd_flops
        tf[name] = flops / (sorted(ms)[len(ms) // 2] * 1e-3) / 1e12

    def cell(name):
        return f"{tf[name]:.0f}" if name in tf else f"n/a ({errors.get(name, '?')})"

    def ratio(a, b):
        return f"{tf[a] / tf[b]:.2f}" if a in tf and b in tf else "n/a"

    return " | ".join([cell(n) for n in PAIR_COLUMNS] + [
        ratio("ours fwd", "FA3 fwd"), ratio("ours nd", "FA3 nd"), ratio("ours det", "FA3 det"),
        ratio("ours det", "ours nd"), f"{diffs[0]:.1e}, {diffs[1]:.1e}"])


def add_pair_arguments(ap) -> None:
    """The timing and FA3 options of bench_window.py / bench_varlen.py."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fa3-build", default=str(fa3_peer.DEFAULT_BUILD_DIR))
    ap.add_argument("--commit", default=None, help="the commit the table names (default: git's HEAD)")


def pair_table_start(name: str, subject: str, details: str, leading: list[str], args):
    """FA3, loaded for a side-by-side table of bench_window.py / bench_varlen.py, once the
    table's title line ("# SUBJECT, device, date, commit, FA3's commit; DETAILS; rounds") and
    header (the ``leading`` columns, then PAIR_HEADER) are printed; None without a GPU
    (after a one-line error)."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        return None
    fa3 = fa3_peer.load_fa3(args.fa3_build)
    print(f"# {subject}, {torch.cuda.get_device_name()}, {datetime.date.today()}, commit "
          f"{args.commit or commit_label()}, FA3 {fa3.commit}; {details}; median of {args.rounds} interleaved rounds")
    print(f"| {' | '.join(leading)} | {PAIR_HEADER} |")
    print("|" + "---|" * (len(leading) + len(PAIR_COLUMNS) + 5))
    return fa3


def load_peer(args):
    """(FA3 or None, reason it is missing or None)."""
    if "fa3" not in args.peers:
        return None, "not requested (--peers)"
    try:
        return fa3_peer.load_fa3(args.fa3_build), None
    except fa3_peer.FA3NotBuilt as exc:
        return None, str(exc)


def load_fa4_peer(args):
    """(FA4 or None, reason it is missing or None)."""
    if "fa4" not in args.peers:
        return None, "not requested (--peers)"
    try:
        return fa4_peer.load_fa4(), None
    except fa4_peer.FA4NotInstalled as exc:
        return None, str(exc)


def main(argv=None) -> int:
    grid = json.load(open(GRID))
    args = parse_args(argv, grid)
    if not torch.cuda.is_available():
        print("error: bench_peers needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    fa3, fa3_missing = load_peer(args)
    if fa3 is None and args.require_fa3:
        print(f"error: FA3 is required (--require-fa3): {fa3_missing}", file=sys.stderr)
        return 2
    fa4, fa4_missing = load_fa4_peer(args)
    if fa4 is None and args.require_fa4:
        print(f"error: FA4 is required (--require-fa4): {fa4_missing}", file=sys.stderr)
        return 2

    device, date, commit = torch.cuda.get_device_name(), datetime.date.today().isoformat(), commit_label()
    fa3_commit = fa3.commit if fa3 is not None else None
    names = [n for n in impl_names(args.direction, args.schedules)
             if impl_peer(n) == "ours" or (impl_peer(n) == "fa3" and fa3 is not None)
             or (impl_peer(n) == "fa4" and fa4 is not None) or (impl_peer(n) == "cudnn" and "cudnn" in args.peers)]
    if args.nd_only:
        names = nondeterministic(names)
    names = [n for n in names if n not in args.skip]
    cols = columns(args.direction, args.schedules)
    fa3_desc = (f"FA3 {fa3_commit[:12]}" + ("" if fa3_peer.build_fa3.is_pinned(fa3_commit) else " (not the pinned commit)")
                + f" (hdims {','.join(map(str, fa3.info.get('hdims', [])))})") if fa3 is not None else "FA3 n/a"
    fa4_desc = f"FA4 {fa4.version}" if fa4 is not None else "FA4 n/a"
    title = (f"{device}, {date}, dash_fa3 {commit}, {fa3_desc}, {fa4_desc}, cuDNN {torch.backends.cudnn.version()}, "
             f"torch {torch.__version__}")
    print(f"# Peer grid ({args.direction}), TFLOP/s: {title}")
    print(f"# bf16; {args.rounds} rounds per point, implementations in rotated order, each a median of "
          f"{args.iters} CUDA-event samples after {args.warmup} warm-ups with a queued device wait hiding host "
          f"time; figures are medians over rounds")
    print("# nd = non-deterministic; det X = ours deterministic with schedule X; auto = ours deterministic, "
          "schedule auto; max nd = max(ours nd, FA3 nd, FA4 nd, cuDNN bwd) and max fwd = max(FA3 fwd, FA4 fwd, "
          f"cuDNN fwd) over the peers present; check = agreement with ours (relative difference <= {args.check_tol})")
    if fa3 is None:
        print(f"# FA3: n/a ({fa3_missing})")
    if fa4 is None:
        print(f"# FA4: n/a ({fa4_missing})")
    print(table_header(cols), flush=True)

    points = grid_points(grid, args.hdims, args.seqlens, args.masks)
    ratio_rows, records, reported = [], [], set()
    for p in points:
        causal = p["mask"] == "causal"
        flops = {d: point_flops(p, d) for d in ("fwd", "bwd")}
        q, k, v, dout = make_inputs(p, point_seed(args.seed, p))
        record = dict(p, seed=point_seed(args.seed, p), flops=flops)
        check = "skipped"
        if not args.no_check:
            try:
                diffs, check_errors = check_point(q, k, v, dout, causal, fa3, "cudnn" in args.peers, args.direction,
                                                  fa4)
                check = check_text(diffs, args.check_tol, check_errors)
                record.update(check=diffs, check_errors=check_errors)
            except Exception as exc:  # our own side failed
                check = f"WARN check failed: {_first_line(exc)}"
        fns, errors = make_impls(names, q, k, v, dout, causal, fa3, args.fa3_prealloc, fa4)
        round_ms, samples = time_point(fns, errors, args.rounds, args.warmup, args.iters)
        tf = tflops_from_rounds(round_ms, flops)
        for name in errors:
            tf[name] = None
        ratios = point_ratios(tf, args.schedules)
        ratio_rows.append(ratios)
        record.update(check_text=check, round_ms=round_ms, samples_ms=samples, tflops=tf, ratios=ratios,
                      errors=errors, best_det_schedule=best_det(tf, args.schedules)[1],
                      ours_nd_ordered=nd_runs_ordered(p, _ext.num_sms(torch.cuda.current_device())))
        records.append(record)
        print(format_row(p, tf, ratios, check, cols, args.schedules), flush=True)
        for name, err in errors.items():
            if (name, err) not in reported:  # each distinct failure once, not once per point
                reported.add((name, err))
                print(f"#   {name}: n/a at hdim {hdim_label(p)} {p['mask']} {p['seqlen']} and wherever it recurs: {err}",
                      flush=True)
        del q, k, v, dout, fns
        torch.cuda.empty_cache()

    summary = summarize(ratio_rows)
    for line in format_summary(summary, cols):
        print(line)
    ordered = [f"hdim {hdim_label(r)} {r['mask']} {r['seqlen']}" for r in records if r["ours_nd_ordered"]]
    if ordered:
        print(f"# ours nd runs the kernel's deterministic mode (few dQ adds per Q tile) at: {', '.join(ordered)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "date": date, "commit": commit, "fa3_commit": fa3_commit,
                       "fa3_missing": fa3_missing, "fa3_build": fa3.info if fa3 is not None else None,
                       "fa4_version": fa4.version if fa4 is not None else None, "fa4_missing": fa4_missing,
                       "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                       "args": {k: v for k, v in vars(args).items()}, "points": records, "summary": summary},
                      f, indent=1)
    if args.png:
        draw_png(args.png, points, ratio_rows, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
