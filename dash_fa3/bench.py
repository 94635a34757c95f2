"""The main job: ``python -m dash_fa3.bench``.

On a Hopper GPU with the extension built it runs attention forward and
backward on a default shape (bench-grid point: hdim 128, seqlen 4096) and
prints which implementation ran each step and how fast. Without one it says
why, and runs what the CPU can: the reference path on a small shape.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from . import _ext, ops, reference, validation
from ._timing import attention_flops, median_ms
from .interface import flash_attn_func
from .schedule import Geometry, bwd_block_sizes, resolve_schedule_name


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
    if variant.name in _ext.built_fwd_variants():
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
    kernel_bwd = variant.name in _ext.built_bwd_variants()
    geometry = Geometry.from_shape(batch=b, heads=h, heads_kv=k.shape[2], seqlen_q=s, headdim=d, causal=args.causal)
    for deterministic in ([False, True] if kernel_bwd else [True]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ops.ReferenceBackwardWarning)
            ms = median_ms(
                lambda: ops.bwd(dout, q, k, v, out, lse, d ** -0.5, args.causal, deterministic, "auto", 0),
                args.warmup if kernel_bwd else 1, args.iters if kernel_bwd else 3,
            )
        tf = attention_flops(b, h, s, s, d, args.causal, "bwd") / ms / 1e9
        if not kernel_bwd:
            impl = f"fp32 reference (no backward kernel for {variant.name})"
        elif deterministic:
            impl = f"dash_fa3 Hopper kernel, deterministic, schedule {resolve_schedule_name('auto', geometry)}"
        else:
            impl = ("dash_fa3 Hopper kernel, non-deterministic (adds in any order), task order "
                    f"{resolve_schedule_name('auto', geometry, deterministic=False)}")
        rows.append(("backward", impl, ms, f"{tf:.0f} TFLOP/s"))
    _print_rows(rows)


def run_cpu(args, reason: str) -> None:
    print(f"No Hopper GPU run: {reason}.")
    print("Running the CPU reference path on a small shape instead (correct, slow).")
    args.batch, args.seqlen, args.heads, args.headdim = 1, 512, 4, 64
    q, k, v = (t.requires_grad_() for t in _inputs(args, "cpu"))
    print(f"shape: batch 1, seqlen 512, heads 4, headdim 64, {args.dtype}, {'causal' if args.causal else 'full'}")
    fwd_ms = median_ms(lambda: flash_attn_func(q, k, v, causal=args.causal), 1, 3, device="cpu")
    out = flash_attn_func(q, k, v, causal=args.causal)
    dout = torch.randn_like(out)
    bwd_ms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), 1, 3, device="cpu")
    _print_rows([
        ("forward", "CPU fp32 reference", fwd_ms, ""),
        ("backward", "CPU fp32 reference", bwd_ms, ""),
    ])


def print_schedule_model(args, num_sms: int, what: str = "this shape") -> None:
    """The schedule model's prediction for this shape: what the deterministic backward's schedules cost."""
    from .schedule import cli

    print(f"\nSchedule model (dash_fa3.schedule) for {what}, {num_sms} SMs, deterministic backward:")
    argv = ["--seqlen", str(args.seqlen), "--headdim", str(args.headdim), "--heads", str(args.heads),
            "--batch", str(args.batch), "--schedule", "all", "--sms", str(num_sms), "--no-gantt"]
    if args.heads_kv:
        argv += ["--heads-kv", str(args.heads_kv)]
    if args.causal:
        argv.append("--causal")
    cli.main(argv)


def _print_rows(rows) -> None:
    print(f"\n{'step':<16} {'ms':>9}  {'rate':>14}  implementation")
    for step, impl, ms, rate in rows:
        print(f"{step:<16} {ms:>9.3f}  {rate:>14}  {impl}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dash_fa3.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=None)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    mask = ap.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True)
    mask.add_argument("--full", dest="causal", action="store_false")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sms", type=int, default=132, help="SM count for the schedule model without a GPU (default: H100/H200 SXM)")
    args = ap.parse_args(argv)
    reason = gpu_unavailable_reason()
    if reason is None:
        run_gpu(args)
        print_schedule_model(args, _ext.num_sms(torch.cuda.current_device()))
    else:
        model_args = argparse.Namespace(**vars(args))
        run_cpu(args, reason)
        print_schedule_model(model_args, args.sms, "the shape a GPU run would use")
    return 0


if __name__ == "__main__":
    sys.exit(main())
