"""Timing helpers shared by the main job and the benchmarks."""

from __future__ import annotations

import os
import statistics
import subprocess
import time

import torch


def attention_flops(batch, heads, seqlen_q, seqlen_k, headdim, causal, direction="fwd", headdim_v=None) -> float:
    """FLOPs as the benchmark grid counts them: fwd = 4*b*h*sq*sk*d (halved when causal), bwd = 2.5x fwd.
    With a value head dim dv (``headdim_v``), each GEMM counts its own: fwd QK^T (d) and PV (dv),
    bwd S^T, dK, dQ (d) and dP^T, dV (dv): 2*b*h*sq*sk*(d + dv) and 2*b*h*sq*sk*(3d + 2dv)."""
    dv = headdim if headdim_v is None else headdim_v
    pairs = batch * heads * seqlen_q * seqlen_k / (2 if causal else 1)
    return 2.0 * pairs * ((3 * headdim + 2 * dv) if direction == "bwd" else (headdim + dv))


# A device-side wait queued ahead of a timed sample (`hide_host`): long enough
# (about 2 ms at Hopper clocks) to cover the host work of one attention call,
# so the start event fires only once the call's kernels are already queued.
_HIDE_HOST_CYCLES = 4_000_000


def median_ms(fn, warmup: int = 3, iters: int = 10, device: str = "cuda", inner: int = 1,
              hide_host: bool = False, samples: list | None = None) -> float:
    """Median wall time of fn() in ms: CUDA events on the GPU, perf_counter on the CPU.

    inner > 1 (GPU): each timed sample is `inner` back-to-back calls between one
    pair of events, divided by `inner`, so the host work of a call overlaps the
    previous call's kernels as in a training step; inner = 1 also counts the
    host time of the call, since nothing is queued before it.
    hide_host (GPU): queue a device-side wait before each sample's start event,
    so the sample measures the GPU time of the call's kernels (and the gaps
    between them) but not the host time spent before the first launch.
    samples: a list that receives every timed sample (ms), for raw-data dumps."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hide_host:
                torch.cuda._sleep(_HIDE_HOST_CYCLES)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if samples is not None:
        samples.extend(times)
    return statistics.median(times)


def host_us(fn, iters: int = 20) -> float:
    """Median host time of one fn() call in microseconds, measured while the GPU
    is busy with a queued wait, so the call never blocks on the device: the
    cost a training step pays on the CPU before the call's kernels are queued."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda._sleep(_HIDE_HOST_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def commit_label() -> str:
    """The commit a benchmark table names: DASH_FA3_COMMIT where git cannot tell
    (a copied tree whose .git is stale or absent), else the checkout's HEAD."""
    env = os.environ.get("DASH_FA3_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except FileNotFoundError:
        return "unknown"
