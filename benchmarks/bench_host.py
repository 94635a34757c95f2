"""Host cost of one attention call as a training loop pays it: dash_fa3 against
torch SDPA (cuDNN and flash backends), in one process.

    python benchmarks/bench_host.py [--shapes default] [--layouts bshd,bhsd] [--profile] [--json out.json]

Per shape, layout and implementation it prints:
  * host us: the CPU time to issue one fwd, bwd or fwd+bwd, averaged over
    `--calls` back-to-back calls queued behind one long device wait, so no
    call ever blocks on the GPU (this VM's host timings jitter by 2x from
    call to call; the average over a burst is the stable figure);
  * wall us: the per-call time of `--calls` back-to-back fwd+bwd calls ended
    by one synchronize, i.e. what a step sees when host and GPU work overlap
    as far as they can.
Every figure is the median over `--rounds` rounds; within a round the
implementations run one after another (interleaved), so slow drifts of the
machine hit all of them alike.
Implementations: dash_fa3 non-deterministic (`nd`) and deterministic
(`det`, schedule auto), SDPA with the cuDNN and flash backends. Layout `bshd`
passes (batch, seqlen, heads, dim) contiguous tensors; `bhsd` passes the
transposed views of (batch, heads, seqlen, dim) tensors, as transformers does.
SDPA always gets (batch, heads, seqlen, dim) views of the same storage.
GQA: SDPA runs with enable_gqa=True.

--profile adds a cProfile of dash_fa3's fwd+bwd host path (GPU kept busy) and
prints the functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dash_fa3  # noqa: E402
from dash_fa3._timing import commit_label  # noqa: E402

# (batch, seqlen, heads, heads_kv, headdim): the host-path issue's table.
DEFAULT_SHAPES = ((4, 2048, 16, 4, 64), (2, 1024, 16, 4, 64), (1, 512, 8, 8, 128), (8, 4096, 32, 8, 128))
_BUSY_CYCLES = 4_000_000  # ~2 ms of queued device wait per call: longer than any host path measured here


def _inputs(shape, layout, seed):
    b, s, h, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads):
        if layout == "bshd":
            t = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        else:  # (b, h, s, d) storage, seen as (b, s, h, d)
            t = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        return t.requires_grad_()

    return make(h), make(hkv), make(hkv)


def _impls(q, k, v, causal):
    """name -> (fwd, bwd(out) , fwd+bwd) closures."""
    dout = torch.randn_like(q)

    def ours(det):
        def fwd():
            return dash_fa3.flash_attn_func(q, k, v, causal=causal, deterministic=det)

        def fwdbwd():
            out = fwd()
            return torch.autograd.grad(out, (q, k, v), dout)

        return fwd, fwdbwd

    def sdpa(backend):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        dt = dout.transpose(1, 2)
        gqa = q.shape[2] != k.shape[2]

        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

        def fwdbwd():
            out = fwd()
            return torch.autograd.grad(out, (q, k, v), dt)

        return fwd, fwdbwd

    return {"ours nd": ours(False), "ours det": ours(True),
            "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION)}, dout


def _host_us(fn, calls, prepare=None):
    """Mean host time of one call over `calls` calls issued behind one device wait."""
    args = [prepare() for _ in range(calls)] if prepare else [()] * calls
    torch.cuda.synchronize()
    torch.cuda._sleep(_BUSY_CYCLES * calls)
    t0 = time.perf_counter()
    for a in args:
        fn(*a)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def _wall_us(fn, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def _profile(fn, top):
    prof = cProfile.Profile()
    for _ in range(3):
        torch.cuda._sleep(_BUSY_CYCLES * 10)  # profiling slows the host path several times
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def _shape(text):
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected b,s,h,hkv,d integers") from None
    if len(vals) != 5 or min(vals) < 1 or vals[2] % vals[3]:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected b,s,h,hkv,d >= 1 with h % hkv == 0")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=_shape, nargs="+", default=list(DEFAULT_SHAPES), metavar="B,S,H,HKV,D")
    ap.add_argument("--layouts", default="bshd,bhsd")
    ap.add_argument("--causal", type=int, choices=[0, 1], default=1)
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per sample")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; figures are medians over rounds")
    ap.add_argument("--profile", action="store_true", help="cProfile dash_fa3's fwd+bwd host path")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    if not set(layouts) <= {"bshd", "bhsd"}:
        ap.error(f"--layouts takes bshd and/or bhsd, got {args.layouts!r}")
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU", file=sys.stderr)
        return 2

    commit = commit_label()
    print(f"# host cost per call, {torch.cuda.get_device_name()}, {datetime.date.today()}, commit {commit}, "
          f"torch {torch.__version__}, causal={bool(args.causal)}, bf16; us; median of {args.rounds} rounds "
          f"of {args.calls} back-to-back calls")
    cols = ["host fwd", "host bwd", "host fwd+bwd", "wall fwd+bwd"]
    print("| shape (b,s,h/hkv,d) | layout | impl | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    rows = []
    for shape in args.shapes:
        for layout in layouts:
            q, k, v = _inputs(shape, layout, seed=sum(shape))
            impls, dout = _impls(q, k, v, bool(args.causal))
            samples = {name: {c: [] for c in cols} for name in impls}
            errors = {}
            for name, (_, fwdbwd) in impls.items():  # warm-up; a peer backend may not support a shape
                try:
                    for _ in range(3):
                        fwdbwd()
                except Exception as exc:
                    errors[name] = str(exc).splitlines()[0][:160]
            torch.cuda.synchronize()
            for _ in range(args.rounds):
                for name, (fwd, fwdbwd) in impls.items():
                    if name in errors:
                        continue
                    grad_of = (q, k, v)
                    samples[name]["host fwd"].append(_host_us(fwd, args.calls))
                    samples[name]["host bwd"].append(_host_us(
                        lambda out: torch.autograd.grad(out, grad_of, dout if out.shape == dout.shape
                                                        else dout.transpose(1, 2)),
                        args.calls, prepare=lambda: (fwd(),)))
                    samples[name]["host fwd+bwd"].append(_host_us(fwdbwd, args.calls))
                    samples[name]["wall fwd+bwd"].append(_wall_us(fwdbwd, args.calls))
            b, s, h, hkv, d = shape
            for name in impls:
                row = {"shape": shape, "layout": layout, "impl": name, "samples": samples[name]}
                if name in errors:
                    row["error"] = errors[name]
                else:
                    row.update({c: statistics.median(samples[name][c]) for c in cols})
                rows.append(row)
                cells = [f"{row[c]:.0f}" if c in row else "n/a" for c in cols]
                print(f"| {b},{s},{h}/{hkv},{d} | {layout} | {name} | " + " | ".join(cells) + " |"
                      + (f" {row['error']}" if "error" in row else ""), flush=True)
            if args.profile and layout == layouts[0]:
                for name in ("ours nd", "ours det"):
                    print(f"\n## cProfile, {name}, shape {shape}, {layout}\n```")
                    print(_profile(impls[name][1], 25))
                    print("```")
            del q, k, v, impls
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "commit": commit, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
