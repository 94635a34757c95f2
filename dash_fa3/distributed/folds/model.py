"""The fold schedules' cost model: each rank runs its steps in order; compute per step is the
step's block GEMMs (diagonal tiles weighted by ``diag``, pairs shared between a rank's two backward
folds counted once) at the kernel's rate; a message costs alpha + bytes / beta, each rank sending
one and receiving one at a time; wave-0 messages overlap the step's compute. Efficiency is
T1 / (P * TP), T1 one GPU's 5-GEMM kernels on the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layout import G
from ..model import CPCostModel, Estimate
from .plan import DATA_KINDS, DEFAULT_FANOUT, FOLD_KINDS, GEMMS, PASSES, PRESETS, DistSchedule
from .validate import DistReport, get_schedule

DEFAULT_COST = CPCostModel()


@dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 16
    heads_kv: int = 16
    headdim: int = 128
    dtype_bytes: int = 2

    def __post_init__(self):
        for f in ("batch", "heads", "heads_kv", "headdim", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Shape.{f} must be a positive int, got {v!r}")
        if self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of heads_kv ({self.heads_kv})")

    def kind_bytes(self, kind: str) -> int:
        """Bytes of one block of a data bundle."""
        b, h, hk, d, e = self.batch, self.heads, self.heads_kv, self.headdim, self.dtype_bytes
        row = b * G * h * d * e
        stats = b * h * G * 4
        return {"q": row, "kv": 2 * b * G * hk * d * e, "qrow": 2 * row + 2 * stats, "o": row + stats,
                "dq": row, "dkv": 2 * b * G * hk * d * e}[kind]

    def gemm_flops(self) -> float:
        """FLOPs of one (G x d) @ (d x G) block GEMM over all heads."""
        return 2.0 * G * G * self.headdim * self.heads * self.batch


@dataclass
class PassSim:
    time: float              # seconds until the last rank finishes
    single: float            # one GPU running the pass's kernel on the whole sequence
    compute: np.ndarray      # per-rank compute seconds
    bytes_sent: np.ndarray   # per rank
    messages: int
    gemms: float             # block GEMMs done (diagonal tiles weighted), all ranks
    gemms_single: float      # what one GPU's kernel does

    def as_dict(self, num_ranks: int) -> dict:
        return {"time_ms": 1e3 * self.time, "single_gpu_ms": 1e3 * self.single,
                "efficiency": self.single / (num_ranks * self.time),
                "max_rank_compute_ms": 1e3 * float(self.compute.max()),
                "max_rank_sent_mb": float(self.bytes_sent.max()) / 1e6, "messages": self.messages,
                "gemm_ratio": self.gemms / self.gemms_single}


def _step_gemms(s: DistSchedule, diag: float) -> np.ndarray:
    """(P, steps) weighted block-GEMM counts. In the backward, a pair whose dQ fold and dK/dV fold
    are on the same rank at the same step is computed once (5 GEMMs, not 3 + 4): the runtime
    shares S, P and dS between the two folds, which gives the same bits."""
    P, T = s.num_ranks, s.num_steps
    out = np.zeros((P, T))
    w = s.works
    tiles = (w[:, 5] - w[:, 4]).astype(float)
    if s.causal:
        on_diag = (w[:, 1] >= w[:, 4]) & (w[:, 1] < w[:, 5])
        tiles -= (1.0 - diag) * on_diag
    gemms = np.array([GEMMS[k] for k in FOLD_KINDS], dtype=float)[w[:, 0]]
    np.add.at(out, (w[:, 2], w[:, 3]), tiles * gemms)
    if s.pass_ == "bwd" and len(w):
        dq_k = FOLD_KINDS.index("bwd_dq")
        o = np.lexsort((w[:, 0], w[:, 3], w[:, 2]))
        ws = w[o]
        brk = np.flatnonzero(np.r_[True, np.any(ws[1:, 2:4] != ws[:-1, 2:4], axis=1), True])
        for a, z in zip(brk[:-1].tolist(), brk[1:].tolist()):
            g = ws[a:z]
            dq, dkv = g[g[:, 0] == dq_k], g[g[:, 0] != dq_k]
            if not len(dq) or not len(dkv):
                continue
            # pair (i, j) is shared when row i's dQ item covers j and column j's dK/dV item covers i
            both = ((dkv[None, :, 1] >= dq[:, None, 4]) & (dkv[None, :, 1] < dq[:, None, 5])
                    & (dq[:, None, 1] >= dkv[None, :, 4]) & (dq[:, None, 1] < dkv[None, :, 5]))
            shared = float(both.sum())
            if s.causal:
                shared -= (1.0 - diag) * float((both & (dq[:, None, 1] == dkv[None, :, 1])).sum())
            out[g[0, 2], g[0, 3]] -= 2.0 * shared
    return out


def simulate_pass(s: DistSchedule, report: DistReport, shape: Shape, cost: CPCostModel) -> PassSim:
    """Event simulation of one pass: each rank runs its steps in order; a step starts when the
    rank's previous step (compute and that step's transfers) is done; wave 0 transfers run during
    the step's compute, later waves after it; a message starts once both ranks posted it and the
    sender's outgoing and the receiver's incoming link are free."""
    P, T = s.num_ranks, s.num_steps
    gem = _step_gemms(s, cost.diag)
    g_sec = cost.gemm_seconds(shape.gemm_flops(), s.pass_)
    comp = gem * g_sec + (gem > 0) * cost.launch_us * 1e-6
    kb = np.array([shape.kind_bytes(k) for k in DATA_KINDS], dtype=float)
    tr = s.transfers
    nbytes = (tr[:, 2] - tr[:, 1]) * kb[tr[:, 0]]
    msgs: dict[tuple, float] = {}
    for (src, dst, t), v, nb_ in zip(tr[:, 3:6].tolist(), report.waves.tolist(), nbytes.tolist()):
        msgs[(t, v, src, dst)] = msgs.get((t, v, src, dst), 0.0) + nb_
    by_step: dict[int, list] = {}
    for key in sorted(msgs):
        by_step.setdefault(key[0], []).append(key)
    end = np.zeros(P)
    send_free, recv_free = np.zeros(P), np.zeros(P)
    sent = np.zeros(P)
    for t in range(T):
        start = end.copy()
        comp_end = start + comp[:, t]
        done = comp_end.copy()
        posted = start.copy()
        cur_wave = 0
        for (_, v, src, dst) in by_step.get(t, []):
            if v != cur_wave:   # a later wave is posted after the compute and the previous wave
                posted = done.copy()
                cur_wave = v
            begin = max(posted[src], posted[dst], send_free[src], recv_free[dst])
            fin = begin + cost.alpha_us * 1e-6 + msgs[(t, v, src, dst)] / (cost.beta_gbs * 1e9)
            send_free[src] = recv_free[dst] = fin
            done[src] = max(done[src], fin)
            done[dst] = max(done[dst], fin)
            sent[src] += msgs[(t, v, src, dst)]
        end = done
    nb = s.num_blocks
    tiles = nb * (nb + 1) / 2 - (1.0 - cost.diag) * nb if s.causal else float(nb * nb)
    single_gemms = tiles * (2 if s.pass_ == "fwd" else 5)
    return PassSim(time=float(end.max()), single=single_gemms * g_sec, compute=comp.sum(axis=1),
                   bytes_sent=sent, messages=len(msgs), gemms=float(gem.sum()), gemms_single=single_gemms)


def simulate(num_ranks: int, seqlen: int, *, causal: bool = True, schedule: str = "helper_worker",
             shape: Shape | None = None, cost: CPCostModel | None = None,
             fanout: int | None = DEFAULT_FANOUT, **rates) -> Estimate:
    """Predicted forward + backward time and efficiency T1 / (P * TP) of a preset schedule
    (validated first). ``cost`` defaults to :data:`DEFAULT_COST`; ``rates`` replace its fields."""
    if schedule not in PRESETS:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(PRESETS)}")
    layout, assignment = PRESETS[schedule]
    shape = shape or Shape()
    cost = (cost or DEFAULT_COST).with_(**rates)
    passes = {}
    for p in PASSES:
        s, rep = get_schedule(num_ranks, seqlen, bool(causal), p, layout, assignment, fanout)
        passes[p] = simulate_pass(s, rep, shape, cost)
    time_ms = 1e3 * sum(p.time for p in passes.values())
    compute_ms = tuple(1e3 * sum(float(p.compute[r]) for p in passes.values()) for r in range(num_ranks))
    return Estimate("folds", schedule, num_ranks, seqlen, bool(causal), compute_ms,
                    tuple(time_ms - c for c in compute_ms), time_ms, 1e3 * sum(p.single for p in passes.values()),
                    passes)
