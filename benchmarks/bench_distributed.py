"""Context-parallel attention on P ranks (issues 16 and 21): dash_fa3.distributed.context_parallel_attn against
PyTorch's context_parallel, and against one GPU on the whole sequence; forward + backward wall time.

On the two-H200 machine (one process per GPU, NCCL):

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --out build/bench_distributed \\
        --commit "$(git rev-parse --short HEAD)"

Without torchrun's environment (RANK, WORLD_SIZE, ...) the script spawns ``--nproc`` processes itself
(torch.multiprocessing, rendezvous on 127.0.0.1). CPU smoke run, ours only, two gloo processes:

    python benchmarks/bench_distributed.py --device cpu --tokens 2048 --heads 2/2,4/2 --hdim 64

Per configuration (batch, total tokens N, heads/heads_kv, head dim, dtype, mask) it times, on the same
inputs (random normal, seeded, broadcast from rank 0):

* ours CP: ``context_parallel_attn`` on ``shard(x, group, layout=...)``, per --modes (nd:
  deterministic=False, det: deterministic=True) and per --layouts (contiguous, zigzag);
* torch CP: ``torch.distributed.tensor.experimental.context_parallel`` around
  ``F.scaled_dot_product_attention`` in ``sdpa_kernel(<backend>)``, per --peers backend (cudnn, flash) and
  --rotate method (allgather, alltoall; ``_attention.set_rotate_method``). Its inputs are this rank's
  head-tail shards (chunks r and 2P-1-r, the same tokens as our zigzag layout; checked against the
  shards torch's own ``buffers=`` sharding produces), in its native (batch, heads, seq, dim) layout,
  contiguous. GQA: ``enable_gqa=True`` first; if that raises, k/v are expanded to the query heads
  (repeat_interleave) and the output says so (--peer-gqa);
* T1, one GPU on the whole sequence, on rank 0 while the other ranks wait: ours
  ``dash_fa3.flash_attn_func`` per mode, and SDPA with each --peers backend. With --t1-tokens N, a
  longer configuration's T1 rows time the first N tokens and are scaled by the attention FLOP ratio
  (labelled extrapolated; issue 21 allows that where one GPU's time on the whole sequence is dear).

Ours det rows can be split by transport and chunk count (--cp-transports p2p:1,shared:4: the
head-parallel algorithm through NCCL or through the copy-engine transport, dash_fa3/distributed/shared.py).

A timed call is one forward + backward: every rank synchronizes its device and passes a barrier, then
records a CUDA event (perf_counter on CPU), runs the call, records the end event and waits for it; the
call's time is the maximum over ranks (all_reduce MAX). After one untimed check call per implementation
(outputs and gradients against ours T1 nd: max abs difference, all ranks) and --warmup untimed calls,
--rounds rounds each time every implementation --iters times, in an order rotated by one per round;
a round's figure is the median of its calls, the reported figure the median over rounds.

Reported per configuration: ms, efficiency T1 / (P * T_P) against ours T1 in the same mode (nd for
torch CP) and against SDPA cuDNN T1, ours / torch CP time ratios, and beside ours rows the model's
prediction (det: dash_fa3.distributed.heads.simulate at the row's chunk count; nd:
dash_fa3.distributed.runs.simulate; kernel rates scaled to the measured ours T1), labelled as the model.
Then the GPU bar per configuration (issue 16 at P = 2, issue 21 at P = 4 and 8). An implementation that
raises NotImplementedError is "not available" (with the message), one that runs out of memory "OOM";
neither stops the run. A hang inside a collective (one rank failing while the others wait in NCCL)
ends at --timeout-s.

NVLink multicast stays off (set below, before torch.distributed starts): on the shared GPU hosts a
program that uses it can take the host's GPUs out of service for a day or more (device docs, KINDS.md).
"""

from __future__ import annotations

import os

# Before anything can initialise NCCL, PyTorch's symmetric memory or NVSHMEM: NVLink multicast (NVLS)
# can put the shared host's GPUs out of service for a day or more, so it must stay off on that machine.
# setdefault: a stricter value already in the environment wins. Spawned workers inherit these.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path.insert(0, REPO)

import torch  # noqa: E402

PROG = "benchmarks/bench_distributed.py"
G = 128                                   # dash_fa3.distributed.G: N must be a multiple of 2 * P * G
MODES = ("nd", "det")
LAYOUTS = ("contiguous", "zigzag")
PEERS = ("cudnn", "flash")
ROTATES = ("allgather", "alltoall")
PEER_LABEL = {"cudnn": "cuDNN", "flash": "flash"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The GPU bars: efficiency by total tokens (issue 16, P = 2; issue 21, P = 4 and 8 from 256k tokens);
# ours / torch CP cuDNN time by mode; model within 0.05
EFF_TARGET = {65536: 0.90, 131072: 0.95}
EFF_TARGET_MANY = (262144, 0.90)   # (from tokens, target) at P in EFF_TARGET_MANY_P
EFF_TARGET_MANY_P = (4, 8)
PEER_RATIO_LIMIT = {"nd": 1.00, "det": 1.05}
MODEL_TOLERANCE = 0.05
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


# ============================================================================ pure parts (tested on CPU)


def parse_size(text: str) -> int:
    """'65536', '64k' (x1024) or '1m' (x1048576) -> int > 0."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1048576}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"expected a positive size like 65536, 64k or 1m, got {text!r}")
    return int(digits) * mult


def parse_heads(text: str) -> tuple[int, int]:
    """'32/8' -> (32, 8); '16' -> (16, 16)."""
    parts = text.strip().split("/")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"expected heads as H or H/H_KV with positive ints, got {text!r}")
    h, hk = int(parts[0]), int(parts[-1])
    if h % hk:
        raise ValueError(f"heads {h} must be a multiple of heads_kv {hk} ({text!r})")
    return h, hk


def _comma(text: str) -> list[str]:
    return [p.strip() for p in str(text).split(",") if p.strip()]


def size_label(n: int) -> str:
    if n % 1048576 == 0:
        return f"{n // 1048576}M"
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, no usage dump
        self.exit(2, f"{PROG}: error: {message}\n")


def world_size_hint(args) -> int:
    """The number of ranks this run will have: torchrun's WORLD_SIZE, else --nproc."""
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env and env.isdigit() else args.nproc


def parse_args(argv=None):
    ap = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64k,128k", help="total tokens N per sequence, comma list (64k = 65536)")
    ap.add_argument("--heads", default="16/16,32/8", help="heads/heads_kv pairs, comma list (16 means 16/16)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    mask = ap.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True, help="causal mask (default)")
    mask.add_argument("--full", dest="causal", action="store_false", help="no mask")
    ap.add_argument("--modes", default="nd,det", help="ours: nd (deterministic=False), det (deterministic=True)")
    ap.add_argument("--layouts", default="contiguous,zigzag", help="ours: token layouts")
    ap.add_argument("--peers", default=None,
                    help="SDPA backends for torch CP and T1: cudnn, flash, comma list or '' "
                         "(default cudnn,flash on cuda, none on cpu)")
    ap.add_argument("--rotate", default="allgather,alltoall", help="torch CP rotate methods")
    ap.add_argument("--cp-transports", default="",
                    help="ours det (the head-parallel algorithm): TRANSPORT:CHUNKS variants, each its own row, e.g. "
                         "p2p:1,shared:2,shared:4 (DASH_FA3_CP_TRANSPORT / DASH_FA3_CP_CHUNKS for the call); empty: "
                         "one row as the environment has it. The model assumes chunk transfers overlap compute, "
                         "which the p2p transport did not achieve (docs/design/distributed.md)")
    ap.add_argument("--nd-transports", default="",
                    help="ours nd through the head-parallel algorithm (algorithm='heads'): TRANSPORT:CHUNKS "
                         "variants, each its own row beside the run plan's, e.g. shared:1; empty: none")
    ap.add_argument("--nd-runs", action="store_true",
                    help="also ours nd through the run plan (algorithm='runs') where the default is the "
                         "head-parallel algorithm (CUDA, heads_kv >= P)")
    ap.add_argument("--peer-gqa", choices=["auto", "native", "expand"], default="auto",
                    help="torch CP / SDPA with heads_kv < heads: enable_gqa (native), k/v expanded to the query "
                         "heads (expand), or native falling back to expand where it raises (auto)")
    ap.add_argument("--t1-tokens", type=int, default=0,
                    help="time the T1 rows (one GPU) on the first N tokens of a longer configuration and scale "
                         "them by the attention FLOP ratio (reported as extrapolated); 0: always the whole sequence")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over rounds)")
    ap.add_argument("--iters", type=int, default=1, help="timed calls per implementation per round (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per implementation after the check call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-tol", type=float, default=0.05,
                    help="WARN where a max abs difference exceeds this times the reference's max abs value")
    ap.add_argument("--no-check", action="store_true", help="skip the check (the first call is then a warm-up)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on cuda, gloo on cpu")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank on cpu")
    ap.add_argument("--timeout-s", type=float, default=1800, help="process-group timeout (a hung collective)")
    ap.add_argument("--commit", default=None, help="dash_fa3 commit for the table (else $DASH_FA3_COMMIT, else git)")
    ap.add_argument("--json", default=None, help="write every sample and figure here")
    ap.add_argument("--out", default=None, help="directory for table.md and results.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the configurations, implementations and model predictions; start nothing")
    args = ap.parse_args(argv)

    try:
        args.tokens = [parse_size(t) for t in _comma(args.tokens)]
        args.heads = [parse_heads(h) for h in _comma(args.heads)]
    except ValueError as e:
        ap.error(str(e))
    args.modes, args.layouts, args.rotate = _comma(args.modes), _comma(args.layouts), _comma(args.rotate)
    try:
        args.cp_transports = parse_transports(args.cp_transports)
    except ValueError as e:
        ap.error(f"--cp-transports: {e}")
    try:
        args.nd_transports = parse_transports(args.nd_transports) if args.nd_transports.strip() else []
    except ValueError as e:
        ap.error(f"--nd-transports: {e}")
    if args.peers is None:
        args.peers = list(PEERS) if args.device == "cuda" else []
    else:
        args.peers = _comma(args.peers)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    for name, values, allowed in (("--modes", args.modes, MODES), ("--layouts", args.layouts, LAYOUTS),
                                  ("--peers", args.peers, PEERS), ("--rotate", args.rotate, ROTATES)):
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"{name}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    if not args.tokens or not args.heads:
        ap.error("--tokens and --heads need at least one value")
    if args.peers and not args.rotate:
        ap.error("--rotate needs at least one method when --peers names a backend")
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl needs --device cuda")
    for name in ("batch", "hdim", "rounds", "iters", "nproc", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.t1_tokens < 0 or args.t1_tokens % G:
        ap.error(f"--t1-tokens must be a non-negative multiple of {G}, got {args.t1_tokens}")
    if not args.timeout_s > 0 or not args.check_tol > 0:
        ap.error("--timeout-s and --check-tol must be > 0")
    P = world_size_hint(args)
    for n in args.tokens:
        problem = tokens_problem(n, P)
        if problem:
            ap.error(f"--tokens: {problem}")
    return args


def parse_transports(text: str) -> list[tuple[str, int]]:
    """"p2p:1,shared:4" -> [("p2p", 1), ("shared", 4)]; "" -> [("", 0)] (the environment's)."""
    from dash_fa3.distributed import transport

    out = []
    for item in _comma(text):
        name, _, chunks = item.partition(":")
        if name not in transport.TRANSPORTS:
            raise ValueError(f"unknown transport {name!r} in {item!r}; choose from {', '.join(transport.TRANSPORTS)}")
        if not chunks.isdigit() or int(chunks) < 1:
            raise ValueError(f"{item!r}: give the chunk count as TRANSPORT:N with N >= 1")
        out.append((name, int(chunks)))
    if len(set(out)) != len(out):
        raise ValueError(f"{text!r} names a variant twice")
    return out or [("", 0)]


def det_models(args, cfg: dict, P: int, t1_ms: float | None = None, t1_nd_ms: float | None = None) -> dict:
    """The head-parallel model per (layout, chunks) of the det rows and per ("nd-heads", layout, chunks)
    of the nd rows that run it (``Impl.model_key``), calibrated on ours T1 in the row's mode."""
    out = {}
    if "det" in args.modes:
        out.update({(lay, c or 1): model_prediction(cfg, P, lay, t1_ms, chunks=c or 1)
                    for lay in args.layouts for _, c in args.cp_transports})
    if "nd" in args.modes:
        out.update({("nd-heads", lay, c or 1): model_prediction(cfg, P, lay, t1_nd_ms, chunks=c or 1)
                    for lay in args.layouts for _, c in args.nd_transports})
    return out


def nd_models(args, cfg: dict, P: int, t1_nd_ms: float | None, device_type: str) -> dict:
    """The model of the nd rows that run the mode's default algorithm (("nd", layout): the one
    context_parallel_attn picks for the shape and device) and of the --nd-runs rows."""
    from dash_fa3.distributed.attention import resolve_algorithm

    default = resolve_algorithm(None, False, cfg["heads_kv"], P, device_type)
    out = {}
    for lay in args.layouts:
        out[("nd", lay)] = (model_prediction(cfg, P, lay, t1_nd_ms) if default == "heads"
                            else run_plan_model(cfg, P, lay, t1_nd_ms))
        if args.nd_runs:
            out[("nd-runs", lay)] = run_plan_model(cfg, P, lay, t1_nd_ms)
    return out


def t1_prefix(args, cfg: dict) -> int | None:
    """The tokens the T1 rows time for ``cfg`` when --t1-tokens shortens them (else None)."""
    return args.t1_tokens if 0 < args.t1_tokens < cfg["tokens"] else None


def flop_ratio(cfg: dict, n: int) -> float:
    """Attention FLOPs of cfg's whole sequence over those of its first n tokens (causal: query row i
    sees i + 1 keys)."""
    N = cfg["tokens"]
    return N * (N + 1) / (n * (n + 1)) if cfg["causal"] else (N / n) ** 2


def tokens_problem(n: int, P: int) -> str | None:
    """Why N tokens cannot be split over P ranks (None if they can): whole blocks of 128 per zigzag chunk."""
    if n % (2 * P * G):
        return f"{n} tokens is not a multiple of 2*P*{G} = {2 * P * G} (P = {P})"
    return None


def configs(args) -> list[dict]:
    """One configuration per (heads, tokens), heads-major."""
    return [{"batch": args.batch, "tokens": n, "heads": h, "heads_kv": hk, "hdim": args.hdim, "dtype": args.dtype,
             "causal": bool(args.causal)} for h, hk in args.heads for n in args.tokens]


def config_name(cfg: dict) -> str:
    kind = "MHA" if cfg["heads"] == cfg["heads_kv"] else ("MQA" if cfg["heads_kv"] == 1 else "GQA")
    return f"{kind} {cfg['heads']}/{cfg['heads_kv']}, {size_label(cfg['tokens'])} tokens"


def config_detail(cfg: dict) -> str:
    return (f"batch {cfg['batch']}, hdim {cfg['hdim']}, {cfg['dtype']}, {'causal' if cfg['causal'] else 'full'}")


class Impl(NamedTuple):
    name: str
    kind: str            # t1_ours, t1_sdpa, cp_ours, cp_torch
    mode: str = "nd"     # ours: nd / det; the peers count as nd
    layout: str = ""     # cp_ours: contiguous / zigzag
    backend: str = ""    # t1_sdpa, cp_torch: cudnn / flash
    rotate: str = ""     # cp_torch: allgather / alltoall
    transport: str = ""  # cp_ours det: DASH_FA3_CP_TRANSPORT for the call ("": as the environment has it)
    chunks: int = 0      # cp_ours det: DASH_FA3_CP_CHUNKS for the call (0: as the environment has it)
    algorithm: str = ""  # cp_ours: context_parallel_attn's algorithm ("": its default for the mode)

    @property
    def model_key(self):
        """The key of this row's model in ``models`` (see :func:`det_models`)."""
        if self.mode == "det":
            return (self.layout, self.chunks or 1)
        if self.algorithm == "heads":
            return ("nd-heads", self.layout, self.chunks or 1)
        return ("nd-runs", self.layout) if self.algorithm == "runs" else ("nd", self.layout)

    @property
    def single(self) -> bool:
        return self.kind.startswith("t1")

    @property
    def ours(self) -> bool:
        return self.kind.endswith("ours")


def t1_name(mode: str) -> str:
    return f"ours T1 {mode}"


def sdpa_t1_name(backend: str) -> str:
    return f"SDPA {PEER_LABEL[backend]} T1"


def implementations(args) -> list[Impl]:
    """Everything timed per configuration, in the first round's order."""
    out = [Impl(t1_name(m), "t1_ours", m) for m in args.modes]
    out += [Impl(sdpa_t1_name(b), "t1_sdpa", backend=b) for b in args.peers]
    for m in args.modes:
        for lay in args.layouts:
            variants = args.cp_transports if m == "det" else [("", 0)]
            out += [Impl(f"ours CP {m} {lay}" + (f" {t} x{c}" if t else ""), "cp_ours", m, lay, transport=t, chunks=c)
                    for t, c in variants]
            if m == "nd":
                out += [Impl(f"ours CP nd {lay} heads {t} x{c}", "cp_ours", m, lay, transport=t, chunks=c,
                             algorithm="heads") for t, c in args.nd_transports]
                if args.nd_runs:
                    out.append(Impl(f"ours CP nd {lay} runs", "cp_ours", m, lay, algorithm="runs"))
    out += [Impl(f"torch CP {PEER_LABEL[b]} {r}", "cp_torch", backend=b, rotate=r)
            for b in args.peers for r in args.rotate]
    return out


def rotated(items, round_index: int) -> list:
    """Round r starts one implementation later than round r-1."""
    items = list(items)
    if not items:
        return items
    k = round_index % len(items)
    return items[k:] + items[:k]


def call_time(per_rank_ms) -> float:
    """A distributed call takes as long as its slowest rank."""
    return max(per_rank_ms)


def round_stats(rounds: list[list[float]]) -> dict | None:
    """Per-round medians of the calls, then their median, min and max; None without samples."""
    meds = [statistics.median(r) for r in rounds if r]
    if not meds:
        return None
    return {"median": statistics.median(meds), "min": min(meds), "max": max(meds), "rounds": meds}


def efficiency(t1_ms, tp_ms, P: int):
    """T1 / (P * T_P), or None where a side is missing."""
    if t1_ms is None or tp_ms is None or not tp_ms > 0 or P < 1:
        return None
    return t1_ms / (P * tp_ms)


def ratio(a, b):
    return a / b if a is not None and b is not None and b > 0 else None


def _calibrated(simulate, cfg: dict, P: int, t1_ms: float | None, **kw):
    """``simulate(P, tokens, ...)`` with its kernel rates scaled so that its one-GPU time equals the
    measured ``t1_ms`` (the calibration; the default rates without one); the communication terms
    keep their defaults."""
    kw.update(causal=cfg["causal"], batch=cfg["batch"], heads=cfg["heads"], heads_kv=cfg["heads_kv"],
              headdim=cfg["hdim"])
    scale = simulate(P, cfg["tokens"], **kw).single_ms / t1_ms if t1_ms else 1.0
    return simulate(P, cfg["tokens"], fwd_tflops=650.0 * scale, bwd_tflops=500.0 * scale, **kw)


def model_prediction(cfg: dict, P: int, layout: str, t1_ms: float | None = None, chunks: int = 1) -> dict:
    """The head-parallel model's forward + backward for ours det
    (dash_fa3.distributed.heads.simulate), calibrated on the measured ours T1 det when given
    (``_calibrated``). {"eff", "ms", "t1_ms"} or {"unavailable": reason}."""
    from dash_fa3.distributed import heads as cp_heads

    try:
        if P > 64:
            raise ValueError(f"the model is meant for P <= 64, not {P}")
        r = _calibrated(cp_heads.simulate, cfg, P, t1_ms, layout=layout, chunks=chunks,
                        elem_bytes=DTYPES[cfg["dtype"]].itemsize)
        return {"eff": r.efficiency, "ms": r.time_ms, "t1_ms": r.single_ms}
    except Exception as e:   # a shape the model refuses: report why
        return {"unavailable": f"{type(e).__name__}: {e}"}


def run_plan_model(cfg: dict, P: int, layout: str, t1_ms: float | None) -> dict:
    """The run plan's model (dash_fa3.distributed.runs.simulate) for ours nd, calibrated on the
    measured ours T1 nd (``_calibrated``). {"eff", "ms", "t1_ms"} or {"unavailable": reason}."""
    from dash_fa3.distributed import runs as cp_runs

    if t1_ms is None:
        return {"unavailable": "no measured ours T1 nd to calibrate on"}
    try:
        r = _calibrated(cp_runs.simulate, cfg, P, t1_ms, layout=layout)
        return {"eff": r.efficiency, "ms": r.time_ms, "t1_ms": r.single_ms}
    except Exception as e:   # a shape the model refuses: report why
        return {"unavailable": f"{type(e).__name__}: {e}"}


def figures(impls: list[Impl], ms: dict, P: int, models: dict | None = None) -> dict:
    """The derived figures of one configuration from the medians ``ms`` (name -> ms or None).

    eff_ours: ours CP vs ours T1 in its mode; torch CP vs ours T1 nd. eff_cudnn: every CP row vs
    SDPA cuDNN T1. eff_own: torch CP vs SDPA T1 of its own backend (ours: = eff_ours).
    ratios[ours][peer] = ours ms / peer ms. best_cudnn: the fastest torch CP cuDNN rotate method.
    model: per ours row, the prediction and measured - model; ``models`` maps (layout, chunks) to the
    head-parallel model (ours det) and ("nd", layout) to the run plan's model (ours nd)."""
    models = models or {}
    t1_cudnn = ms.get(sdpa_t1_name("cudnn"))
    rows = {}
    for im in impls:
        if im.single:
            continue
        t = ms.get(im.name)
        t1 = ms.get(t1_name(im.mode)) if im.ours else ms.get(t1_name("nd"))
        row = {"eff_ours": efficiency(t1, t, P), "eff_cudnn": efficiency(t1_cudnn, t, P)}
        row["eff_own"] = row["eff_ours"] if im.ours else efficiency(ms.get(sdpa_t1_name(im.backend)), t, P)
        if im.ours and im.model_key in models:
            m = models[im.model_key]
            row["model"] = m
            if "eff" in m and row["eff_ours"] is not None:
                row["model_minus_measured"] = m["eff"] - row["eff_ours"]
        rows[im.name] = row
    peers = [im for im in impls if im.kind == "cp_torch"]
    ratios = {im.name: {p.name: ratio(ms.get(im.name), ms.get(p.name)) for p in peers}
              for im in impls if im.kind == "cp_ours"}
    cudnn = [(ms[p.name], p.name) for p in peers if p.backend == "cudnn" and ms.get(p.name) is not None]
    best = min(cudnn) if cudnn else None
    return {"rows": rows, "ratios": ratios, "best_cudnn": best[1] if best else None,
            "best_cudnn_ms": best[0] if best else None}


def eff_target(P: int, tokens: int) -> float | None:
    """The efficiency the issues ask for at P ranks and this many tokens (None: none asked)."""
    if P == 2:
        return EFF_TARGET.get(tokens)
    if P in EFF_TARGET_MANY_P and tokens >= EFF_TARGET_MANY[0]:
        return EFF_TARGET_MANY[1]
    return None


def bar_issue(P: int) -> str:
    return "Issue 16" if P == 2 else "Issue 21"


def bar_rows(cfg: dict, impls: list[Impl], ms: dict, fig: dict, gpu: bool = True, P: int = 2) -> list[dict]:
    """The GPU bar (issue 16 at P = 2, issue 21 above) for each ours CP row: efficiency >=
    :func:`eff_target` (where an issue sets one),
    time <= PEER_RATIO_LIMIT[mode] x the fastest torch CP cuDNN, model within MODEL_TOLERANCE (det).
    Each check is True / False / None (not applicable, a side missing, or not a GPU run)."""
    out = []
    target = eff_target(P, cfg["tokens"])
    judge = (lambda ok: ok) if gpu else (lambda ok: None)
    for im in impls:
        if im.kind != "cp_ours":
            continue
        row = fig["rows"].get(im.name, {})
        eff = row.get("eff_ours")
        vs = ratio(ms.get(im.name), fig.get("best_cudnn_ms"))
        limit = PEER_RATIO_LIMIT[im.mode]
        diff = row.get("model_minus_measured")
        out.append({
            "impl": im.name, "eff": eff, "eff_target": target,
            "eff_ok": judge(None if target is None or eff is None else eff >= target),
            "vs_cudnn": vs, "vs_limit": limit, "vs_ok": judge(None if vs is None else vs <= limit),
            "model_eff": row.get("model", {}).get("eff"), "model_diff": diff,
            "model_ok": judge(None if diff is None else abs(diff) <= MODEL_TOLERANCE),
        })
    return out


# ---------------------------------------------------------------------------------------- rendering


def fmt(x, spec=".2f", missing="n/a") -> str:
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fmt_ms(x) -> str:
    return fmt(x, ".1f") if x is None or x >= 10 else fmt(x, ".3g")


def verdict(ok) -> str:
    return "—" if ok is None else ("pass" if ok else "FAIL")


def check_text(check: dict | None, tol: float) -> str:
    """'out 3.9e-03, dq 1.2e-02, ...' with WARN where a difference exceeds tol x the reference's max."""
    if check is None:
        return ""
    if "skipped" in check or "is_reference" in check:
        return check.get("skipped", "reference")
    if "error" in check:
        return f"WARN check failed: {check['error']}"
    parts, warn = [], False
    for t in ("out", "dq", "dk", "dv"):
        if t in check["diff"]:
            d, ref = check["diff"][t], check["ref_max"][t]
            bad = not d <= tol * max(ref, 1e-30)
            warn |= bad
            parts.append(f"{t} {d:.1e}" + ("!" if bad else ""))
    return ("WARN " if warn else "") + ", ".join(parts)


def header_lines(meta: dict) -> list[str]:
    gpu = meta["device_type"] == "cuda"
    clock = "CUDA-event time" if gpu else "perf_counter time"
    one = "one GPU" if gpu else "one process"
    return [
        f"# dash_fa3 context parallelism, forward + backward: P = {meta['world_size']} ranks",
        "",
        f"{meta['device']} x{meta['world_size']} ({meta['backend']}), torch {meta['torch']}, cuDNN {meta['cudnn']}, "
        f"NCCL {meta['nccl']}, {meta['date']}, dash_fa3 {meta['commit']}",
        "",
        f"A call = forward + backward; its time is the max over ranks of {clock} after a device sync and a "
        f"barrier; {meta['rounds']} interleaved rounds (order rotated by one per round) of {meta['iters']} call(s) "
        f"after a check call and {meta['warmup']} warm-up(s); figures are medians over rounds (min–max over "
        f"rounds beside). T1 = {one} on the whole sequence (rank 0, the others wait). eff = T1 / (P · T_P): "
        "'vs ours T1' uses ours T1 in the row's mode (nd for torch CP), 'vs cuDNN T1' uses SDPA cuDNN T1. "
        "'model' = for ours det, dash_fa3.distributed.heads.simulate (the head-parallel model, at the row's "
        "chunk count) with its kernel rates scaled to the measured ours T1 det; for ours nd, "
        "dash_fa3.distributed.runs.simulate with its kernel rates scaled to the measured ours T1 nd. check = "
        "max abs difference of out, dq, dk, dv from ours T1 nd on the same inputs (! / WARN: above "
        f"{meta['check_tol']} x the reference's max abs value).",
    ]


def section_lines(rec: dict, impls: list[Impl], tol: float) -> list[str]:
    """Markdown for one configuration."""
    cfg = rec["config"]
    lines = ["", f"## {config_name(cfg)} ({config_detail(cfg)})", ""]
    if rec.get("skipped"):
        return lines + [f"not run: {rec['skipped']}"]
    res, fig = rec["impls"], rec["figures"]
    lines += ["| implementation | ms | rounds min–max | eff vs ours T1 | eff vs cuDNN T1 | model ms | model eff "
              "| check |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for im in impls:
        r = res.get(im.name, {})
        st = r.get("stats")
        if r.get("status", "ok") != "ok":
            cells = [r["status"], "", "", "", "", "", ""]
            notes.append(f"- {im.name}: {r['status']}: {r.get('error', '')}")
        else:
            row = fig["rows"].get(im.name, {})
            model = row.get("model", {})
            cells = [fmt_ms(st["median"]) if st else "n/a",
                     f"{fmt_ms(st['min'])}–{fmt_ms(st['max'])}" if st else "",
                     "" if im.single else fmt(row.get("eff_ours")),
                     "" if im.single else fmt(row.get("eff_cudnn")),
                     fmt_ms(model["ms"]) if "ms" in model else "",
                     fmt(model["eff"]) if "eff" in model else "",
                     check_text(r.get("check"), tol)]
            if "unavailable" in model:
                notes.append(f"- {im.name}: no model prediction: {model['unavailable']}")
        if r.get("note"):
            notes.append(f"- {im.name}: {r['note']}")
        lines.append(f"| {im.name} | " + " | ".join(cells) + " |")
    peers = [im for im in impls if im.kind == "cp_torch"]
    ours = [im for im in impls if im.kind == "cp_ours"]
    if peers and ours:
        lines += ["", "ours / torch CP, time ratio (< 1: ours faster):", "",
                  "| ours \\ torch CP | " + " | ".join(p.name.removeprefix("torch CP ") for p in peers) + " |",
                  "|---|" + "---|" * len(peers)]
        for o in ours:
            lines.append(f"| {o.name.removeprefix('ours CP ')} | "
                         + " | ".join(fmt(fig["ratios"][o.name][p.name]) for p in peers) + " |")
    if rec.get("peer_layout"):
        lines += ["", f"torch CP shards: {rec['peer_layout']}"]
    if notes:
        lines += [""] + notes
    return lines


def bar_lines(records: list[dict], gpu: bool = True, P: int = 2) -> list[str]:
    lines = ["", f"## {bar_issue(P)} bar", ""] + ([] if gpu else ["Not a GPU run: the bar is for GPUs, no verdicts.", ""])
    if P == 2:
        targets = ", ".join(f"{v:.2f} at {size_label(k)}" for k, v in EFF_TARGET.items())
    else:
        targets = (f"{EFF_TARGET_MANY[1]:.2f} from {size_label(EFF_TARGET_MANY[0])}" if P in EFF_TARGET_MANY_P else
                   f"none at P = {P}")
    lines += [f"eff target {targets} tokens (— elsewhere); ours ≤ {PEER_RATIO_LIMIT['nd']:.2f}x (nd) / "
              f"{PEER_RATIO_LIMIT['det']:.2f}x (det) the fastest torch CP cuDNN; model within {MODEL_TOLERANCE:.2f} "
              "of the measured efficiency (model = simulation, not a measurement).", "",
              "| configuration | ours | eff vs ours T1 | eff bar | / best torch CP cuDNN | ratio bar | model eff "
              "| model − measured | model bar |", "|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        if rec.get("skipped"):
            continue
        for b in rec["bar"]:
            lines.append(
                f"| {config_name(rec['config'])} | {b['impl'].removeprefix('ours CP ')} | {fmt(b['eff'])} | "
                f"{verdict(b['eff_ok'])} | {fmt(b['vs_cudnn'])} | {verdict(b['vs_ok'])} | "
                f"{fmt(b['model_eff'], missing='')} | {fmt(b['model_diff'], '+.2f', missing='')} | "
                f"{verdict(b['model_ok'])} |")
    return lines


def render(meta: dict, records: list[dict], impls: list[Impl]) -> str:
    lines = header_lines(meta)
    for rec in records:
        lines += section_lines(rec, impls, meta["check_tol"])
    lines += bar_lines(records, meta["device_type"] == "cuda", meta["world_size"])
    return "\n".join(lines) + "\n"


def commit_string(args) -> str:
    if args.commit:
        return args.commit
    env = os.environ.get("DASH_FA3_COMMIT")
    if env:
        return env
    from dash_fa3._timing import commit_label

    return f"{commit_label()} (git here; no --commit or DASH_FA3_COMMIT)"


def dry_run(args) -> str:
    """What a run would do, without processes or devices."""
    P = world_size_hint(args)
    impls = implementations(args)
    lines = [f"P = {P}, device {args.device}, backend {args.backend}",
             "implementations: " + ", ".join(im.name for im in impls)]
    for cfg in configs(args):
        models = det_models(args, cfg, P)
        def label(key):
            if key[0] == "nd-heads":
                return f"nd heads {key[1]} x{key[2]}"
            return key[0] if args.cp_transports == [("", 0)] else f"{key[0]} x{key[1]}"
        pred = ", ".join(f"{label(key)}: eff {m['eff']:.3f}, {m['ms']:.1f} ms (model T1 {m['t1_ms']:.1f} ms)"
                         if "eff" in m else f"{label(key)}: {m['unavailable']}" for key, m in models.items())
        lines.append(f"{config_name(cfg)} ({config_detail(cfg)})" + (f"; model, ours det: {pred}" if pred else ""))
    return "\n".join(lines) + "\n"


# ============================================================================ runtime (devices, processes)


class Failed(Exception):
    """An implementation failed on some rank; ``status`` is 'not available', 'OOM' or 'error'."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


STATUS_CODES = {None: 0, "error": 1, "not available": 2, "OOM": 3}


def classify(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    if isinstance(exc, NotImplementedError):
        return "not available"
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    return "error"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


class Ctx:
    """This rank's view of the process group and device."""

    def __init__(self, args):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.cuda = args.device == "cuda"
        timeout = datetime.timedelta(seconds=args.timeout_s)
        if self.cuda:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            dist.init_process_group(args.backend, timeout=timeout, device_id=self.device)
        else:
            torch.set_num_threads(args.threads)
            self.device = torch.device("cpu")
            dist.init_process_group(args.backend, timeout=timeout)
        self.group = dist.group.WORLD
        self._mesh = None

    @property
    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def barrier(self):
        self.sync()
        if self.cuda:
            self.dist.barrier(device_ids=[self.local_rank])
        else:
            self.dist.barrier()

    def max_all(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def agree(self, local_exc: BaseException | None, values=()) -> list[float]:
        """All ranks learn whether any failed (raising Failed everywhere, with the first failing rank's
        message) and the max over ranks of ``values``."""
        status = classify(local_exc)
        out = self.max_all([float(STATUS_CODES[status])] + [float(v) for v in values])
        if out[0] > 0:
            msgs = [None] * self.world
            self.dist.all_gather_object(msgs, None if local_exc is None else one_line(local_exc))
            worst = {v: k for k, v in STATUS_CODES.items()}[int(out[0])]
            r, m = next((r, m) for r, m in enumerate(msgs) if m is not None)
            raise Failed(worst, f"rank {r}: {m}")
        return out[1:]

    def close(self):
        self.dist.destroy_process_group()


def make_inputs(cfg: dict, seed: int, ctx: Ctx):
    """Full q, k, v, dout (batch, N, heads, hdim), random normal from rank 0, the same on every rank."""
    b, n, h, hk, d = cfg["batch"], cfg["tokens"], cfg["heads"], cfg["heads_kv"], cfg["hdim"]
    dt = DTYPES[cfg["dtype"]]
    shapes = ((b, n, h, d), (b, n, hk, d), (b, n, hk, d), (b, n, h, d))
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    out = []
    for s in shapes:
        if ctx.rank == 0:
            x = torch.randn(s, generator=g, device=ctx.device, dtype=torch.float32).to(dt)
        else:
            x = torch.empty(s, device=ctx.device, dtype=dt)
        ctx.dist.broadcast(x, src=0)
        out.append(x)
    return out


def _leaf(x):
    return x.detach().clone().requires_grad_()


class Runner:
    """One implementation on one configuration's inputs: ``call()`` runs forward + backward (grads land
    on the leaves), ``context()`` wraps the timed region, ``result(out)`` gives out/dq/dk/dv in
    (batch, seq, heads, hdim), local to this rank for CP runners, and ``ref_layout`` the layout by which
    to shard the reference for comparison (None: whole sequence)."""

    ref_layout = None
    note = ""
    expand = False

    def __init__(self, im: Impl, cfg: dict, ctx: Ctx, everywhere: bool = False):
        self.im, self.cfg, self.ctx = im, cfg, ctx
        self.everywhere = everywhere   # a T1 runner that runs on every rank (the check's reference)
        self.leaves = ()

    def runs_here(self) -> bool:
        return not self.im.single or self.everywhere or self.ctx.rank == 0

    def context(self):
        return contextlib.nullcontext()

    def prepare(self):
        for t in self.leaves:
            t.grad = None

    def result(self, out):
        q, k, v = self.leaves
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


class OursT1(Runner):
    def __init__(self, im, cfg, ctx, full, everywhere=False):
        super().__init__(im, cfg, ctx, everywhere)
        if self.runs_here():
            self.leaves = tuple(_leaf(x) for x in full[:3])
            self.dout = full[3]

    def call(self):
        from dash_fa3 import flash_attn_func

        q, k, v = self.leaves
        out = flash_attn_func(q, k, v, causal=self.cfg["causal"], deterministic=self.im.mode == "det")
        out.backward(self.dout)
        return out


def _gqa(cfg):
    return cfg["heads"] != cfg["heads_kv"]


class SdpaRunner(Runner):
    """SDPA in its (batch, heads, seq, hdim) layout, contiguous; k/v expanded to the query heads or
    enable_gqa for GQA."""

    def _setup(self, q, k, v, dout, expand: bool):
        g = self.cfg["heads"] // self.cfg["heads_kv"]
        self.expand = expand and _gqa(self.cfg)
        self.native_gqa = _gqa(self.cfg) and not expand
        if self.expand:
            k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
            self.note = (f"k/v expanded from {self.cfg['heads_kv']} to {self.cfg['heads']} heads "
                         "(repeat_interleave, outside the timed call)")
        elif self.native_gqa:
            self.note = "enable_gqa=True (k/v not expanded)"
        self.leaves = tuple(_leaf(x.transpose(1, 2).contiguous()) for x in (q, k, v))
        self.dout = dout.transpose(1, 2).contiguous()

    def sdpa(self):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[self.im.backend]
        q, k, v = self.leaves
        kw = {"enable_gqa": True} if self.native_gqa else {}
        with sdpa_kernel(backend):
            # looked up on the module at call time: context_parallel replaces F.scaled_dot_product_attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.cfg["causal"], **kw)
        out.backward(self.dout)
        return out

    call = sdpa

    def result(self, out):
        q, k, v = self.leaves
        g = self.cfg["heads"] // self.cfg["heads_kv"]

        def back(x, kv):
            x = x.transpose(1, 2)
            if kv and self.expand:   # the expanded heads' gradients summed back per kv head
                b, s, _, d = x.shape
                x = x.reshape(b, s, self.cfg["heads_kv"], g, d).sum(3)
            return x

        return {"out": back(out.detach(), False), "dq": back(q.grad, False), "dk": back(k.grad, True),
                "dv": back(v.grad, True)}


class SdpaT1(SdpaRunner):
    def __init__(self, im, cfg, ctx, full, expand):
        super().__init__(im, cfg, ctx)
        if self.runs_here():
            self._setup(*full, expand=expand)


class OursCP(Runner):
    def __init__(self, im, cfg, ctx, full):
        super().__init__(im, cfg, ctx)
        from dash_fa3.distributed import shard

        self.ref_layout = im.layout
        self.leaves = tuple(_leaf(shard(x, ctx.group, layout=im.layout)) for x in full[:3])
        self.dout = shard(full[3], ctx.group, layout=im.layout).contiguous()

    def call(self):
        from dash_fa3.distributed import context_parallel_attn

        q, k, v = self.leaves
        with transport_env(self.im):
            out = context_parallel_attn(q, k, v, self.ctx.group, causal=self.cfg["causal"],
                                        deterministic=self.im.mode == "det", layout=self.im.layout,
                                        algorithm=self.im.algorithm or None)
            out.backward(self.dout)
        return out


@contextlib.contextmanager
def transport_env(im: Impl):
    """DASH_FA3_CP_TRANSPORT / DASH_FA3_CP_CHUNKS as the row names them, for one call (forward and
    backward), then as they were."""
    if not im.transport:
        yield
        return
    names = ("DASH_FA3_CP_TRANSPORT", "DASH_FA3_CP_CHUNKS")
    before = {n: os.environ.get(n) for n in names}
    os.environ.update(zip(names, (im.transport, str(im.chunks))))
    try:
        yield
    finally:
        for n, v in before.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _cp_module():
    """torch 2.11's context-parallel internals: (context_parallel, _cp_options, set_rotate_method)."""
    from torch.distributed.tensor.experimental import _attention as A
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel, A._cp_options, A.set_rotate_method


class TorchCP(SdpaRunner):
    """torch's context_parallel: load-balanced (head-tail = our zigzag) when causal, contiguous otherwise
    (torch refuses load balancing without a causal mask). The shards are ours, made the same way torch's
    ``buffers=`` sharding makes them (verified once per configuration: ``peer_layout``)."""

    def __init__(self, im, cfg, ctx, full, expand):
        super().__init__(im, cfg, ctx)
        from dash_fa3.distributed import shard

        self.ref_layout = "zigzag" if cfg["causal"] else "contiguous"
        self._setup(*(shard(x, ctx.group, layout=self.ref_layout) for x in full), expand=expand)

    @contextlib.contextmanager
    def _options(self):
        _, opts, set_rotate_method = _cp_module()
        saved = (opts.rotate_method, opts.enable_load_balance)
        set_rotate_method(self.im.rotate)       # read when the ring starts, in forward and backward
        opts.enable_load_balance = self.cfg["causal"]
        try:
            yield
        finally:
            opts.rotate_method, opts.enable_load_balance = saved

    @contextlib.contextmanager
    def context(self):
        # context_parallel() needs one buffer to shard; a throwaway of 2P elements (its own sharding of
        # the real inputs is checked in check_peer_layout). Exceptions must not cross its `yield`: its
        # generator has no finally, and would leave F.scaled_dot_product_attention patched; the callers
        # catch inside this context.
        context_parallel = _cp_module()[0]
        dummy = torch.zeros(2 * self.ctx.world, device=self.ctx.device)
        with self._options(), context_parallel(self.ctx.mesh, buffers=[dummy], buffer_seq_dims=[0],
                                               no_restore_buffers={dummy}):
            yield

    def check_layout(self, full_q) -> bool:
        """Whether torch's own ``buffers=`` sharding of the full q gives this rank the shard we use."""
        context_parallel = _cp_module()[0]
        buf = full_q.transpose(1, 2).contiguous()   # resized in place to this rank's shard
        with self._options(), context_parallel(self.ctx.mesh, buffers=[buf], buffer_seq_dims=[2],
                                               no_restore_buffers={buf}):
            pass
        q = self.leaves[0].detach()
        return buf.shape == q.shape and torch.equal(buf, q)


def make_runner(im: Impl, cfg: dict, ctx: Ctx, full, expand: bool) -> Runner:
    if im.kind == "t1_ours":
        return OursT1(im, cfg, ctx, full)
    if im.kind == "t1_sdpa":
        return SdpaT1(im, cfg, ctx, full, expand)
    if im.kind == "cp_ours":
        return OursCP(im, cfg, ctx, full)
    return TorchCP(im, cfg, ctx, full, expand)


def run_once(runner: Runner):
    """(out or None, exception or None): one call inside the runner's context, exceptions caught inside it."""
    out, err = None, None
    if not runner.runs_here():
        return None, None
    runner.prepare()
    try:
        with runner.context():
            try:
                out = runner.call()
            except Exception as e:   # reported; must not cross the context's yield
                err = e
    except Exception as e:   # entering or leaving the context failed
        err = err or e
    return out, err


def timed_call(runner: Runner, ctx: Ctx) -> float:
    """One forward + backward, timed on every rank that runs it after a sync and a barrier; the max over
    ranks (ranks that do not run it, for T1, count 0). Raises Failed on every rank if any failed."""
    ms, err = 0.0, None
    ctx.barrier()
    ctx.sync()
    if runner.runs_here():
        runner.prepare()
        try:
            with runner.context():
                try:
                    if ctx.cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        runner.call()
                        end.record()
                        end.synchronize()
                        ms = start.elapsed_time(end)
                    else:
                        t0 = time.perf_counter()
                        runner.call()
                        ms = (time.perf_counter() - t0) * 1e3
                except Exception as e:   # reported; must not cross the context's yield
                    err = e
        except Exception as e:
            err = err or e
    if isinstance(err, torch.OutOfMemoryError) and ctx.cuda:
        torch.cuda.empty_cache()
    return ctx.agree(err, [ms])[0]


def max_abs_diff(x, r, chunk: int = 8192) -> tuple[float, float]:
    """(max |x - r|, max |r|) in fp32, in sequence chunks (dim 1) to bound the temporaries; (inf, ...) on a
    shape mismatch or a missing tensor."""
    if x is None or x.shape != r.shape:
        return float("inf"), float(r.float().abs().max()) if r is not None else float("inf")
    d = m = 0.0
    for i in range(0, r.shape[1], chunk):
        xs, rs = x[:, i:i + chunk].float(), r[:, i:i + chunk].float()
        d = max(d, (xs - rs).abs().max().item())
        m = max(m, rs.abs().max().item())
    return d, m


def compare(res: dict, ref: dict, layout, ctx: Ctx, distributed: bool) -> dict:
    """Max abs difference per tensor against the reference (sharded by ``layout`` for a CP result),
    the max over ranks when ``distributed`` (every rank reaches the reduction, even after an error)."""
    from dash_fa3.distributed import shard

    names = ("out", "dq", "dk", "dv")
    diffs, refmax, error = [float("inf")] * 4, [float("inf")] * 4, None
    try:
        for i, t in enumerate(names):
            r = ref[t] if layout is None else shard(ref[t], ctx.group, layout=layout)
            diffs[i], refmax[i] = max_abs_diff(res[t], r)
    except Exception as e:   # the check failed, not the implementation: inf differences say so
        error = one_line(e)
    if distributed:
        vals = ctx.max_all(diffs + refmax)
        diffs, refmax = vals[:4], vals[4:]
    out = {"diff": dict(zip(names, diffs)), "ref_max": dict(zip(names, refmax))}
    if error:
        out["error"] = error
    return out


def reference(cfg, ctx, full):
    """Ours T1 nd on the whole sequence, on every rank (untimed): (results, name) or (None, reason)."""
    im = Impl(t1_name("nd"), "t1_ours", "nd")
    r = OursT1(im, cfg, ctx, full, everywhere=True)
    out, err = run_once(r)
    try:
        ctx.agree(err)
    except Failed as f:
        return None, f"no reference ({im.name}: {f})"
    res = r.result(out)
    return {k: v.detach() for k, v in res.items()}, im.name


def check_call(im: Impl, runner: Runner, cfg: dict, args, ctx: Ctx, full, ref, rec,
               prefix: int | None = None) -> Runner | None:
    """The first call of an implementation, untimed: its outputs and gradients against ``ref`` (T1 rows on
    rank 0, CP rows on every rank, reduced; not a T1 row on the first ``prefix`` tokens). With --peer-gqa
    auto, a GQA peer whose enable_gqa call raises is retried with k/v expanded. Returns the runner to
    time, or None (the failure is in ``rec``)."""
    res = rec["impls"][im.name]
    retry = bool(im.backend) and _gqa(cfg) and args.peer_gqa == "auto"   # built native first
    out, err = run_once(runner)
    try:
        ctx.agree(err)
    except Failed as f:
        if isinstance(err, torch.OutOfMemoryError) and ctx.cuda:
            torch.cuda.empty_cache()
        if not retry:
            res.update(status=f.status, error=str(f))
            return None
        first = f"with enable_gqa: {f}"
        runner = err = None
        try:
            runner = make_runner(im, cfg, ctx, full, expand=True)
        except Exception as e:
            err = e
        try:
            ctx.agree(err)
        except Failed as f2:
            res.update(status=f2.status, error=f"{first}; expanded: {f2}")
            return None
        out, err = run_once(runner)
        try:
            ctx.agree(err)
        except Failed as f2:
            res.update(status=f2.status, error=f"{first}; expanded: {f2}")
            return None
        res["note"] = f"{runner.note}; {first}"
    else:
        if runner.note:
            res["note"] = runner.note
    if ref is None:
        res["check"] = {"skipped": rec["reference"]}
    elif prefix is not None:
        res["check"] = {"skipped": f"timed on the first {prefix} tokens"}
    elif not im.single:
        res["check"] = compare(runner.result(out), ref, runner.ref_layout, ctx, distributed=True)
    elif im == Impl(t1_name("nd"), "t1_ours", "nd"):
        res["check"] = {"is_reference": True}
    elif runner.runs_here():
        res["check"] = compare(runner.result(out), ref, None, ctx, distributed=False)
    del out
    runner.prepare()   # drop the check's gradients
    return runner


def run_config(cfg: dict, args, ctx: Ctx, impls: list[Impl]) -> dict:
    rec = {"config": cfg, "name": config_name(cfg), "impls": {}}
    problem = tokens_problem(cfg["tokens"], ctx.world)
    if problem:
        rec["skipped"] = problem
        return rec
    full = err = None
    try:
        full = make_inputs(cfg, args.seed + cfg["tokens"] + 1000 * cfg["heads"] + cfg["heads_kv"], ctx)
    except Exception as e:   # OOM creating the inputs is reported, the run goes on
        err = e
    try:
        ctx.agree(err)
    except Failed as f:
        rec["skipped"] = f"{f.status}: inputs: {f}"
        return rec

    # ---- build every runner; one that cannot be built is reported
    runners: dict[str, Runner] = {}
    prefix = t1_prefix(args, cfg)
    t1_inputs = full if prefix is None or full is None else [x[:, :prefix] for x in full]
    for im in impls:
        res = rec["impls"][im.name] = {"status": "ok"}
        expand = args.peer_gqa == "expand"
        runner, err = None, None
        try:
            runner = make_runner(im, cfg, ctx, t1_inputs if im.single else full, expand)
        except Exception as e:
            err = e
        try:
            ctx.agree(err)
            runners[im.name] = runner
        except Failed as f:
            res.update(status=f.status, error=str(f))

    # torch CP's shards: ours, built as its buffers= sharding builds them; checked even where it cannot run
    peer = next((runners[im.name] for im in impls if im.kind == "cp_torch" and im.name in runners), None)
    if peer is not None:
        err, same = None, False
        try:
            same = peer.check_layout(full[0])
        except Exception as e:
            err = e
        try:
            ok = ctx.agree(err, [0.0 if same else 1.0])[0] == 0.0
            rec["peer_layout"] = (f"the same tokens as our {peer.ref_layout} layout on every rank (checked against "
                                  "torch's buffers= sharding)" if ok else
                                  f"WARN: torch's buffers= sharding differs from our {peer.ref_layout} layout")
        except Failed as f:
            rec["peer_layout"] = f"not checked: {f}"

    # ---- check call (also the first warm-up): outputs and gradients against ours T1 nd
    ref, rec["reference"] = (None, "skipped (--no-check)") if args.no_check else reference(cfg, ctx, full)
    for im in impls:
        if im.name in runners:
            runners[im.name] = check_call(im, runners[im.name], cfg, args, ctx, t1_inputs if im.single else full,
                                          ref, rec, prefix if im.single else None)
            if runners[im.name] is None:
                del runners[im.name]
    del ref

    # ---- warm-up, then interleaved rounds
    live = [im for im in impls if im.name in runners]
    for im in live:
        for _ in range(args.warmup):
            try:
                timed_call(runners[im.name], ctx)
            except Failed as f:
                rec["impls"][im.name].update(status=f.status, error=f"warm-up: {f}")
                runners.pop(im.name)
                break
    samples = {im.name: [] for im in impls}
    for r in range(args.rounds):
        for im in rotated([im for im in live if im.name in runners], r):
            calls = []
            try:
                for _ in range(args.iters):
                    calls.append(timed_call(runners[im.name], ctx))
            except Failed as f:
                rec["impls"][im.name].update(status=f.status, error=f"round {r}: {f}")
                runners.pop(im.name)
                continue
            samples[im.name].append(calls)
    ms = {}
    for im in impls:
        res = rec["impls"][im.name]
        res["samples_ms"] = samples[im.name]
        res["stats"] = round_stats(samples[im.name]) if res["status"] == "ok" else None
        if im.single and prefix is not None and res["stats"]:
            scale = flop_ratio(cfg, prefix)
            res["measured_stats"] = res["stats"]
            res["stats"] = {k: ([x * scale for x in v] if isinstance(v, list) else v * scale)
                            for k, v in res["stats"].items()}
            res["note"] = ((res.get("note", "") + "; ") if res.get("note") else "") + (
                f"extrapolated: timed on the first {prefix} tokens ({res['measured_stats']['median']:.1f} ms), "
                f"scaled by the attention FLOP ratio {scale:.3f}")
        ms[im.name] = res["stats"]["median"] if res["stats"] else None
    models = det_models(args, cfg, ctx.world, ms.get(t1_name("det")), ms.get(t1_name("nd")))
    if "nd" in args.modes:
        models.update(nd_models(args, cfg, ctx.world, ms.get(t1_name("nd")), "cuda" if ctx.cuda else "cpu"))
    rec["model"] = {"/".join(map(str, k)): m for k, m in models.items()}
    rec["figures"] = figures(impls, ms, ctx.world, models)
    rec["bar"] = bar_rows(cfg, impls, ms, rec["figures"], gpu=ctx.cuda, P=ctx.world)
    runners.clear()
    del full
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    return rec


def _json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def worker(args) -> int:
    ctx = Ctx(args)
    try:
        impls = implementations(args)
        meta = {"world_size": ctx.world, "backend": args.backend, "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version() if ctx.cuda else None,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ctx.cuda else None,
                "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "CPU", "device_type": args.device,
                "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit_string(args),
                "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup, "check_tol": args.check_tol,
                "args": vars(args)}
        if ctx.rank == 0:
            print("\n".join(header_lines(meta)), flush=True)
        records = []
        for cfg in configs(args):
            rec = run_config(cfg, args, ctx, impls)
            records.append(rec)
            if ctx.rank == 0:
                print("\n".join(section_lines(rec, impls, args.check_tol)), flush=True)
                write_outputs(args, meta, records, impls)   # after every configuration: partial results survive
        if ctx.rank == 0:
            print("\n".join(bar_lines(records, ctx.cuda, ctx.world)), flush=True)
            write_outputs(args, meta, records, impls)
        ctx.barrier()
    finally:
        ctx.close()
    return 0


def write_outputs(args, meta, records, impls):
    blob = {"meta": meta, "implementations": [im._asdict() for im in impls], "configs": records}
    paths = [args.json] if args.json else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "results.json"))
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(render(meta, records, impls))
    for p in paths:
        with open(p, "w") as f:
            json.dump(blob, f, indent=1, default=_json_default)


def _spawned(local_rank: int, world: int, argv):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    sys.exit(worker(parse_args(argv)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.dry_run:
        print(dry_run(args), end="")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{PROG}: error: --device cuda but no CUDA device (use --device cpu for the smoke run)",
              file=sys.stderr)
        return 2
    if all(v in os.environ for v in TORCHRUN_VARS):
        return worker(args)
    # no torchrun: spawn --nproc processes on this host
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"{PROG}: error: --nproc {args.nproc} but {torch.cuda.device_count()} CUDA devices", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if args.backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args.nproc, argv), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
