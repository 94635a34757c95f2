"""Our packed forward alone, over document mixes: for A/B runs of two builds in alternating processes.

16k tokens per mix (``bench_varlen.document_mix``: log-uniform lengths in [64, 8192] and in
[64, 1024], seeds 0-2), heads = 2048 / hdim, bf16, full and causal, hdim 64 and 128 (those the
build has). Each figure: the median of 3 timings, each the median of 20 CUDA-event samples with a
queued device wait hiding host time (``dash_fa3._timing.median_ms``); TFLOP/s over the documents'
score entries (4·h·d per entry). No peer: compare builds only within one session.

    python benchmarks/bench_varlen_fwd.py TAG
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_varlen  # noqa: E402

import dash_fa3  # noqa: E402
from dash_fa3 import _ext, variants  # noqa: E402
from dash_fa3._timing import median_ms  # noqa: E402


def main(tag: str) -> None:
    built = set(_ext.built_variants("fwd", packed=True))
    for hdim in (64, 128):
        h = 2048 // hdim
        for mask in ("causal", "full"):
            if variants.Variant(hdim, "bf16", mask).name not in built:
                continue
            for seed in (0, 1, 2):
                for lo, hi in ((64, 8192), (64, 1024)):
                    lengths = bench_varlen.document_mix(16384, lo, hi, seed)
                    cu = bench_varlen.cu_seqlens(lengths)
                    n, longest = sum(lengths), max(lengths)
                    q, k, v = (torch.randn(n, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))

                    def call():
                        return dash_fa3.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                               causal=mask == "causal")

                    ms = statistics.median(median_ms(call, warmup=3, iters=20, hide_host=True) for _ in range(3))
                    entries = (bench_varlen.causal_entries(lengths) if mask == "causal"
                               else sum(x * x for x in lengths))
                    print(f"{tag} hdim {hdim} {mask} mix {lo}-{hi} seed {seed} docs {len(lengths)} "
                          f"longest {longest} {4 * h * hdim * entries / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ours")
