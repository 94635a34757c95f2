"""Rematerialization-aware checkpointing (issue 16, DistFlashAttn's third idea) on one GPU.

A stack of Llama-style blocks (RMSNorm, q/k/v projections, causal GQA attention through
``dash_fa3.flash_attn_func``, output projection, RMSNorm, SwiGLU MLP) trains one step
(forward + backward) at a long sequence, three ways:

* ``none``: no checkpointing (every activation kept);
* ``plain``: ``torch.utils.checkpoint.checkpoint`` per block (the whole block, attention included,
  reruns in the backward);
* ``selective``: ``dash_fa3.checkpoint.checkpoint_block`` per block (attention's output and LSE
  kept, the rest recomputed).

Reported per mode: the step's time (CUDA events; median of --rounds interleaved rounds), the peak
memory the step allocates above the model and inputs, and the number of forward attention kernels
the step launches (torch.profiler, kernels named ``fwd_kernel``): one per block is the goal,
``plain`` runs two.

    python benchmarks/bench_checkpoint.py --tokens 32768 --layers 4 --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dash_fa3  # noqa: E402
from dash_fa3 import checkpoint as ck  # noqa: E402
from dash_fa3._timing import commit_label  # noqa: E402

MODES = ("none", "plain", "selective")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.heads_kv:
        ap.error("hidden must be a multiple of heads, heads a multiple of heads-kv")
    return args


class Block(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        h, d = args.hidden, args.hidden // args.heads
        self.heads, self.heads_kv, self.d = args.heads, args.heads_kv, d
        self.deterministic = args.deterministic
        self.norm1 = torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, (args.heads + 2 * args.heads_kv) * d, bias=False)
        self.out = torch.nn.Linear(args.heads * d, h, bias=False)
        self.norm2 = torch.nn.RMSNorm(h)
        self.gate_up = torch.nn.Linear(h, 2 * args.ffn, bias=False)
        self.down = torch.nn.Linear(args.ffn, h, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.heads * self.d, self.heads_kv * self.d, self.heads_kv * self.d], -1)
        o = dash_fa3.flash_attn_func(q.view(b, n, self.heads, self.d), k.view(b, n, self.heads_kv, self.d),
                                     v.view(b, n, self.heads_kv, self.d), causal=True,
                                     deterministic=self.deterministic)
        x = x + self.out(o.reshape(b, n, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def step(blocks, x, mode):
    h = x
    for blk in blocks:
        if mode == "none":
            h = blk(h)
        elif mode == "plain":
            h = checkpoint(blk, h, use_reentrant=False)
        else:
            h = ck.checkpoint_block(blk, h)
    h.float().square().mean().backward()


def count_fwd_kernels(blocks, x, mode) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(blocks, x, mode)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "fwd_kernel" in e.name)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_checkpoint: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(args) for _ in range(args.layers)).cuda().bfloat16()
    x = torch.randn(args.batch, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for mode in MODES:                                   # warm-up, and the grads' buffers exist
        step(blocks, x, mode)
    torch.cuda.synchronize()
    res = {m: {"ms": [], "peak_gib": None, "fwd_kernels": None} for m in MODES}
    for m in MODES:
        res[m]["fwd_kernels"] = count_fwd_kernels(blocks, x, m)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(blocks, x, m)
        torch.cuda.synchronize()
        res[m]["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    for r in range(args.rounds):
        for m in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            step(blocks, x, m)
            b.record()
            b.synchronize()
            res[m]["ms"].append(a.elapsed_time(b))
    commit = args.commit or commit_label()
    print(f"# checkpointing, {torch.cuda.get_device_name()}, {datetime.date.today()}, commit {commit}, "
          f"torch {torch.__version__}; {args.layers} Llama-style blocks, hidden {args.hidden}, heads "
          f"{args.heads}/{args.heads_kv}, ffn {args.ffn}, {args.batch}x{args.tokens} tokens, bf16, "
          f"{'deterministic' if args.deterministic else 'non-deterministic'}; median of {args.rounds} rounds")
    print("| mode | step ms | peak GiB above inputs | forward attention kernels per step |")
    print("|---|---|---|---|")
    for m in MODES:
        med = statistics.median(res[m]["ms"])
        res[m]["median_ms"] = med
        print(f"| {m} | {med:.1f} | {res[m]['peak_gib']:.2f} | {res[m]['fwd_kernels']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "commit": commit, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
