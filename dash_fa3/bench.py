"""The main job: ``python -m dash_fa3.bench``.

On a Hopper GPU with the extension built it runs attention forward and
backward on a default shape (bench-grid point: hdim 128, seqlen 4096) and
prints which implementation ran each step and how fast. Without one it says
why, and runs what the CPU can: the reference path, on the shape flags you
give; flags you leave out take small CPU defaults, and the output says which.
``--plot PATH`` draws the run's TFLOP/s, its ratios and the schedule model's
predictions (PNG, PDF or SVG; needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

import torch

from . import _ext, ops, reference, validation, variants
from ._cli import OneLineParser, folder_problem
from ._timing import attention_flops, median_ms
from .interface import flash_attn_func
from .schedule import Geometry, bwd_block_sizes, resolve_call, resolve_schedule_name
from .schedule.model.cli import MAX_SMS, MAX_STEPS


def gpu_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        validation.check_cuda_device(torch.device("cuda"))
    except RuntimeError as exc:
        return str(exc)
    return _ext.ext_error()


def _inputs(args, device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.headdim)
    shape_k = (args.batch, args.seqlen, args.heads_kv or args.heads, args.headdim)
    q, k, v = (torch.randn(s, generator=g, device=device, dtype=dtype) for s in (shape_q, shape_k, shape_k))
    return q, k, v


def run_gpu(args) -> None:
    q, k, v = _inputs(args, "cuda")
    b, s, h, d = q.shape
    print(f"device: {torch.cuda.get_device_name()}  ({_ext.num_sms(torch.cuda.current_device())} SMs)")
    print(f"shape: batch {b}, seqlen {s}, heads {h}/{k.shape[2]} (q/kv), headdim {d}, {args.dtype}, "
          f"{'causal' if args.causal else 'full'}")
    variant = validation.AttnShape(b, s, s, h, k.shape[2], d, args.dtype).variant(args.causal)
    rows = []
    if variant.name in _ext.built_variants("fwd"):
        ms = median_ms(lambda: flash_attn_func(q, k, v, causal=args.causal), args.warmup, args.iters)
        tf = attention_flops(b, h, s, s, d, args.causal) / ms / 1e9
        rows.append(("forward", "dash_fa3 Hopper kernel", ms, f"{tf:.0f} TFLOP/s"))
        out, lse = flash_attn_func(q, k, v, causal=args.causal, return_attn_probs=True)
    else:
        rows.append(("forward", f"not run: {variant.name} is not in this build", float("nan"), ""))
        out, lse = reference.attention_ref(q, k, v, causal=args.causal)
        out = out.to(q.dtype)
    dout = torch.randn_like(out)
    c = _ext.ops()
    block_m = bwd_block_sizes(d)[0]
    ms = median_ms(lambda: c.bwd_preprocess(out, dout, lse, block_m), args.warmup, args.iters)
    gbytes = (2 * out.numel() * out.element_size() + lse.numel() * 4 * 3 + out.numel() * 4) / 1e9
    rows.append(("bwd preprocess", "dash_fa3 kernel", ms, f"{gbytes / ms * 1e3:.0f} GB/s"))
    accum = c.bwd_preprocess(out, dout, lse, block_m)[2]
    ms = median_ms(lambda: c.bwd_postprocess(accum, s, 0.1, q.dtype), args.warmup, args.iters)
    gbytes = (accum.numel() * 4 + out.numel() * out.element_size()) / 1e9
    rows.append(("bwd postprocess", "dash_fa3 kernel", ms, f"{gbytes / ms * 1e3:.0f} GB/s"))
    if variant.name not in _ext.built_variants("bwd"):
        rows.append(("backward", f"not run: {variant.name} is not in this build", float("nan"), ""))
        _print_rows(rows)
        return rows
    geometry = Geometry.from_shape(batch=b, heads=h, heads_kv=k.shape[2], seqlen_q=s, headdim=d, causal=args.causal)
    for deterministic in (False, True):
        ms = median_ms(lambda: ops.bwd(dout, q, k, v, out, lse, d ** -0.5, args.causal, deterministic, "auto", 0),
                       args.warmup, args.iters)
        tf = attention_flops(b, h, s, s, d, args.causal, "bwd") / ms / 1e9
        if deterministic:
            impl = f"dash_fa3 Hopper kernel, deterministic, schedule {resolve_schedule_name('auto', geometry)}"
        else:
            name, ordered = resolve_call("auto", geometry, deterministic=False)
            impl = ("dash_fa3 Hopper kernel, non-deterministic: " +
                    (f"the deterministic mode, the faster here, schedule {name}" if ordered
                     else f"adds in any order, task order {name}"))
        rows.append(("backward", impl, ms, f"{tf:.0f} TFLOP/s"))
    _print_rows(rows)
    return rows


def run_cpu(args, reason: str, note: str | None = None) -> list:
    print(f"No Hopper GPU run: {reason}.")
    print("Running the CPU reference path instead (correct, slow).")
    if note:
        print(note)
    q, k, v = (t.requires_grad_() for t in _inputs(args, "cpu"))
    b, s, h, d = q.shape
    print(f"shape: batch {b}, seqlen {s}, heads {h}/{k.shape[2]} (q/kv), headdim {d}, {args.dtype}, "
          f"{'causal' if args.causal else 'full'}; warmup {args.warmup}, iters {args.iters}")
    fwd_ms = median_ms(lambda: flash_attn_func(q, k, v, causal=args.causal), args.warmup, args.iters, device="cpu")
    out = flash_attn_func(q, k, v, causal=args.causal)
    dout = torch.randn_like(out)
    bwd_ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                       args.warmup, args.iters, device="cpu")
    rows = []
    for step, ms in (("forward", fwd_ms), ("backward", bwd_ms)):
        tf = attention_flops(b, h, s, s, d, args.causal, "bwd" if step == "backward" else "fwd") / ms / 1e9
        rows.append((step, "CPU fp32 reference", ms, f"{tf:.3g} TFLOP/s"))
    _print_rows(rows)
    return rows


def _model_argv(args, num_sms: int) -> list[str]:
    argv = ["--seqlen", str(args.seqlen), "--headdim", str(args.headdim), "--heads", str(args.heads),
            "--batch", str(args.batch), "--schedule", "all", "--sms", str(num_sms), "--no-gantt"]
    if args.heads_kv:
        argv += ["--heads-kv", str(args.heads_kv)]
    if args.causal:
        argv.append("--causal")
    return argv


def model_too_large(args) -> str | None:
    """Why the schedule model cannot describe this shape (None: it can): it enumerates every tile step."""
    g = Geometry.from_shape(batch=args.batch, heads=args.heads, heads_kv=args.heads_kv, seqlen_q=args.seqlen,
                            headdim=args.headdim, causal=args.causal)
    if g.num_steps > MAX_STEPS:
        return f"{g.num_steps:,} tile steps, more than the {MAX_STEPS:,} it enumerates"
    return None


def print_schedule_model(args, num_sms: int, what: str = "this shape") -> None:
    """The schedule model's prediction for this shape: what the deterministic backward's schedules cost."""
    from .schedule import cli

    print(f"\nSchedule model (dash_fa3.schedule) for {what}, {num_sms} SMs, deterministic backward:")
    skip = model_too_large(args)
    if skip:
        print(f"not run: {skip}")
        return
    cli.main(_model_argv(args, num_sms))


def schedule_model_rows(args, num_sms: int) -> list[dict]:
    """The schedule model's numbers for the plot (its --json output; none past its size limit)."""
    from .schedule import cli

    if model_too_large(args):
        return []
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(_model_argv(args, num_sms) + ["--json", "--no-critical-path"])
    return [r for r in json.loads(buf.getvalue()) if r.get("valid")]


def _rate(rate: str) -> float | None:
    parts = rate.split()
    if len(parts) == 2 and parts[1] == "TFLOP/s":
        return float(parts[0])
    return None


def plot(path: str, rows, model_rows, title: str, model_shape: str) -> None:
    """TFLOP/s of each measured step, the run's ratios, and the schedule model's
    predicted makespan / lower bound per schedule, in one figure at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [(f"{step}\n{impl}", _rate(rate), ms) for step, impl, ms, rate in rows
                if _rate(rate) is not None and ms == ms]
    ratios = []
    fwd = [ms for step, _, ms, _ in rows if step == "forward" and ms == ms]
    bwd = {("non-det" if "non-deterministic" in impl else "det"): _rate(rate)
           for step, impl, _, rate in rows if step == "backward" and "Hopper kernel" in impl}
    if "det" in bwd and "non-det" in bwd:
        ratios.append(("deterministic / non-deterministic\nbackward TFLOP/s", bwd["det"] / bwd["non-det"]))
    bwd_ms = [ms for step, _, ms, _ in rows if step == "backward" and ms == ms]
    if fwd and bwd_ms:
        ratios.append(("fastest backward time /\nforward time", min(bwd_ms) / fwd[0]))

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [3, 2, 3]})
    ax = axes[0]
    ax.barh([m[0] for m in measured][::-1], [m[1] for m in measured][::-1], color="tab:blue")
    for y, (_, tf, ms) in enumerate(measured[::-1]):
        ax.text(tf, y, f" {tf:.3g} ({ms:.3g} ms)", va="center", fontsize=8)
    if measured:
        ax.set_xlim(0, 1.45 * max(m[1] for m in measured))
    ax.set_xlabel("TFLOP/s (fwd 4·b·h·s²·d, halved when causal; bwd 2.5× fwd)")
    ax.set_title("measured")
    ax.tick_params(axis="y", labelsize=7)
    ax = axes[1]
    if ratios:
        ax.bar([r[0] for r in ratios], [r[1] for r in ratios], color="tab:orange")
        for x, (_, val) in enumerate(ratios):
            ax.text(x, val, f"{val:.3f}", ha="center", va="bottom", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_title("ratios (this run)")
    ax = axes[2]
    if model_rows:
        names = [r["schedule"] for r in model_rows]
        vals = [r["ratio"] for r in model_rows]
        ax.bar(names, vals, color="tab:green")
        for x, val in enumerate(vals):
            ax.text(x, val, f"{val:.3f}", ha="center", va="bottom", fontsize=9)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    ax.set_title(f"schedule model, makespan / lower bound\n{model_shape}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_rows(rows) -> None:
    print(f"\n{'step':<16} {'ms':>9}  {'rate':>14}  implementation")
    for step, impl, ms, rate in rows:
        print(f"{step:<16} {ms:>9.3f}  {rate:>14}  {impl}")


# The main job's shape on a GPU (a bench-grid point) and the smaller one the CPU
# reference runs for every shape flag left out.
GPU_DEFAULTS = {"batch": 4, "seqlen": 4096, "heads": 16, "headdim": 128, "warmup": 5, "iters": 20}
CPU_DEFAULTS = {"batch": 1, "seqlen": 512, "heads": 4, "headdim": 64, "warmup": 1, "iters": 3}
PLOT_FORMATS = (".png", ".pdf", ".svg")
# Bounds on the flags, checked before anything runs: sizes no GPU holds, a reference run the CPU
# cannot hold (it materializes the scores of every head), timing loops that never end.
MAX_SIZE = {"batch": 1 << 16, "seqlen": 1 << 24, "heads": 1 << 12, "heads_kv": 1 << 12, "warmup": 10000,
            "iters": 10000, "sms": MAX_SMS}
CPU_MAX_SCORES = 1 << 28     # batch x heads x seqlen^2 of the CPU reference (fp32: 1 GiB per copy)


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m dash_fa3.bench", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    gd, cd = GPU_DEFAULTS, CPU_DEFAULTS
    ap.add_argument("--batch", type=int, default=None, help=f"default {gd['batch']} (CPU: {cd['batch']})")
    ap.add_argument("--seqlen", type=int, default=None, help=f"default {gd['seqlen']} (CPU: {cd['seqlen']})")
    ap.add_argument("--heads", type=int, default=None, help=f"query heads, default {gd['heads']} (CPU: {cd['heads']})")
    ap.add_argument("--heads-kv", type=int, default=None, help="key/value heads (GQA), default: --heads")
    ap.add_argument("--headdim", type=int, default=None,
                    help=f"one of {', '.join(map(str, variants.HEADDIMS))}; default {gd['headdim']} (CPU: {cd['headdim']})")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    mask = ap.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True, help="causal mask (default)")
    mask.add_argument("--full", dest="causal", action="store_false", help="no mask")
    ap.add_argument("--warmup", type=int, default=None, help=f"default {gd['warmup']} (CPU: {cd['warmup']})")
    ap.add_argument("--iters", type=int, default=None, help=f"timed runs per step, default {gd['iters']} (CPU: {cd['iters']})")
    ap.add_argument("--sms", type=int, default=132,
                    help="SM count for the schedule model without a GPU (default 132: H100/H200 SXM)")
    ap.add_argument("--plot", metavar="PATH", default=None,
                    help=f"also draw the run's TFLOP/s and ratios into PATH ({', '.join(PLOT_FORMATS)}; needs matplotlib)")
    return ap


def check_args(args) -> str | None:
    """The first problem with the arguments (None if there is none); shape flags may still be None."""
    for name, low in (("batch", 1), ("seqlen", 1), ("heads", 1), ("heads_kv", 1), ("warmup", 0), ("iters", 1),
                      ("sms", 1)):
        val = getattr(args, name)
        if val is not None and val < low:
            return f"--{name.replace('_', '-')} must be >= {low}, got {val}"
        if val is not None and val > MAX_SIZE[name]:
            return f"--{name.replace('_', '-')} must be <= {MAX_SIZE[name]}, got {val}"
    if args.headdim is not None:
        try:
            variants.check_head_dims(args.headdim, args.headdim)
        except ValueError as e:
            return f"--headdim: {e}"
    if args.heads is not None and args.heads_kv is not None and args.heads % args.heads_kv:
        return f"--heads ({args.heads}) must be a multiple of --heads-kv ({args.heads_kv})"
    if args.plot is not None:
        if os.path.splitext(args.plot)[1].lower() not in PLOT_FORMATS:
            return f"--plot {args.plot!r}: the file name must end in {', '.join(PLOT_FORMATS)}"
        if os.path.isdir(args.plot):
            return f"--plot {args.plot!r} is a directory; give a file name"
    return None


def check_plot_dir(path: str) -> str | None:
    """Make the plot's folder; the problem if it cannot be made or written."""
    return folder_problem(os.path.dirname(os.path.abspath(path)), f"--plot {path!r}: its folder")


def check_fits(args, on_gpu: bool) -> str | None:
    """The problem with running this shape here (None: it fits): the CPU reference holds every head's
    scores; the GPU run its inputs, outputs and gradients."""
    b, s, h, d = args.batch, args.seqlen, args.heads, args.headdim
    if not on_gpu:
        if b * h * s * s > CPU_MAX_SCORES:
            return (f"the CPU reference holds batch x heads x seqlen^2 = {b * h * s * s:,} scores, more than "
                    f"{CPU_MAX_SCORES:,}: give a smaller shape")
        return None
    hkv = args.heads_kv or h
    need = b * s * d * (2 * 5 * h + 2 * 3 * hkv + 4 * h)  # q, out, dout, dq, k... in 16 bits; fp32 dQ accumulator
    free = torch.cuda.mem_get_info()[0]
    if need > free:
        return f"this shape needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB is free"
    return None


def resolve(args, defaults: dict) -> list[str]:
    """Fill the flags left out from ``defaults``; returns the names of those filled."""
    filled = [name for name, value in defaults.items() if getattr(args, name) is None]
    for name in filled:
        setattr(args, name, defaults[name])
    return filled


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    problem = check_args(args)
    if problem:
        ap.error(problem)
    given = argparse.Namespace(**vars(args))
    reason = gpu_unavailable_reason()
    filled = resolve(args, GPU_DEFAULTS if reason is None else CPU_DEFAULTS)
    if "heads" in filled and args.heads_kv is not None and args.heads % args.heads_kv:
        ap.error(f"--heads-kv {args.heads_kv} does not divide --heads, which defaults to {args.heads} "
                 f"on this run; pass --heads too")
    problem = check_fits(args, reason is None) or (check_plot_dir(args.plot) if args.plot else None)
    if problem:
        ap.error(problem)
    if reason is None:
        rows = run_gpu(args)
        num_sms, model_args, what = _ext.num_sms(torch.cuda.current_device()), args, "this shape"
    else:
        smaller = [n for n in filled if n in ("batch", "seqlen", "heads", "headdim")]
        note = None
        if smaller:
            note = ("CPU defaults for the shape flags not given: "
                    + ", ".join(f"--{n} {CPU_DEFAULTS[n]}" for n in smaller) + " (a GPU run uses "
                    + ", ".join(f"--{n} {GPU_DEFAULTS[n]}" for n in smaller) + ")")
        rows = run_cpu(args, reason, note)
        # The model describes the shape a GPU run would use: the flags given, GPU defaults for the rest.
        model_args = given
        resolve(model_args, GPU_DEFAULTS)
        num_sms, what = args.sms, "the shape a GPU run would use"
    print_schedule_model(model_args, num_sms, what)
    if args.plot:
        device = torch.cuda.get_device_name() if reason is None else "CPU (fp32 reference)"
        title = (f"python -m dash_fa3.bench on {device}: batch {args.batch}, seqlen {args.seqlen}, heads "
                 f"{args.heads}/{args.heads_kv or args.heads}, headdim {args.headdim}, {args.dtype}, "
                 f"{'causal' if args.causal else 'full'}")
        m = model_args
        model_shape = (f"batch {m.batch}, seqlen {m.seqlen}, heads {m.heads}/{m.heads_kv or m.heads}, "
                       f"headdim {m.headdim}, {num_sms} SMs")
        plot(args.plot, rows, schedule_model_rows(model_args, num_sms), title, model_shape)
        print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
