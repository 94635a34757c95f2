"""What the plan models of every algorithm share: the cost parameters (:class:`CPCostModel`), the
estimate they return (:class:`Estimate`), and the argument types of their one CLI (``python -m
dash_fa3.distributed plan``, ``cli.py``).

Each algorithm's ``simulate`` (``heads.simulate``, ``runs.simulate``, ``folds.simulate``) prices
its own plan with the same parameters: the kernels' rates, an alpha-beta cost per message, the
memory passes at HBM speed and a per-launch overhead. ``ALGORITHMS`` names them. They are models, not measurements;
``benchmarks/bench_distributed.py`` scales the kernel rates to a measured one-GPU time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

ALGORITHMS = ("heads", "runs", "folds", "superblocks")


@dataclass(frozen=True)
class CPCostModel:
    """One GPU per rank. ``fwd_tflops`` / ``bwd_tflops``: the kernels' rates (standard FLOP counts,
    the backward 2.5x the forward's); ``alpha_us`` + bytes / ``beta_gbs`` per message (per direction
    per rank); ``hbm_gbs`` for the runtime's own copies; ``launch_us`` per kernel call or step with
    compute; ``diag``: a causal diagonal tile's cost relative to a full one (the fold model)."""

    fwd_tflops: float = 650.0
    bwd_tflops: float = 500.0
    alpha_us: float = 15.0
    beta_gbs: float = 350.0
    hbm_gbs: float = 3000.0
    launch_us: float = 5.0
    diag: float = 1.0

    POSITIVE = ("fwd_tflops", "bwd_tflops", "beta_gbs", "hbm_gbs")
    NON_NEGATIVE = ("alpha_us", "launch_us", "diag")

    def __post_init__(self):
        for f in self.POSITIVE + self.NON_NEGATIVE:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{f} must be a finite number, got {v!r}")
            if f in self.POSITIVE and not v > 0:
                raise ValueError(f"{f} must be > 0, got {v!r}")
            if not v >= 0:
                raise ValueError(f"{f} must be >= 0, got {v!r}")

    def with_(self, **overrides) -> "CPCostModel":
        """A copy with the fields in ``overrides`` replaced (None keeps the field)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def gemm_seconds(self, flops: float, pass_: str) -> float:
        """Seconds of ``flops`` at the pass's kernel rate."""
        return flops / ((self.fwd_tflops if pass_ == "fwd" else self.bwd_tflops) * 1e12)

    def message_seconds(self, nbytes: float) -> float:
        """One message: alpha + bytes / beta (nothing for an empty one)."""
        return self.alpha_us * 1e-6 + nbytes / (self.beta_gbs * 1e9) if nbytes else 0.0


COST_FIELDS = tuple(f.name for f in dataclasses.fields(CPCostModel))


@dataclass(frozen=True)
class Estimate:
    """A model's forward + backward of one plan. ``compute_ms``: per rank, its kernels' time;
    ``exposed_ms``: per rank, the rest of its time (communication, memory passes and waits that
    compute does not hide); ``time_ms``: the slowest rank; ``single_ms``: one GPU running the same
    kernels on the whole problem; ``passes``: per pass details where the model has them (folds)."""

    algorithm: str
    variant: str          # the layout, or the fold schedule's name
    num_ranks: int
    seqlen: int
    causal: bool
    compute_ms: tuple[float, ...]
    exposed_ms: tuple[float, ...]
    time_ms: float
    single_ms: float
    passes: dict = field(default_factory=dict, compare=False)

    @property
    def efficiency(self) -> float:
        """T1 / (P * TP), T1 = one GPU's kernels on the whole sequence."""
        return self.single_ms / (self.num_ranks * self.time_ms)

    @property
    def fwd(self):
        return self.passes["fwd"]

    @property
    def bwd(self):
        return self.passes["bwd"]

    def as_dict(self) -> dict:
        d = {"algorithm": self.algorithm, "variant": self.variant, "P": self.num_ranks, "seqlen": self.seqlen,
             "causal": self.causal, "time_ms": self.time_ms, "single_gpu_ms": self.single_ms,
             "efficiency": self.efficiency, "max_rank_compute_ms": max(self.compute_ms),
             "max_rank_exposed_ms": max(self.exposed_ms)}
        for name, p in self.passes.items():
            d[name] = p.as_dict(self.num_ranks)
        return d
