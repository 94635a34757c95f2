"""The simulator calibrated on measured GPU times.

One place for the fitted physical costs of the backward kernel: per head dim,
the MMA work of one step (a tile without mask, its growth with the sequence
length, the extra of a tile that needs the mask), the per-task epilogue, the
dQ reduce-add (until its sdQ buffer is read, until it has completed) and the
semaphore hand-off latency; plus the fixed cost of the rest of the call (the
pre- and postprocess kernels and launch gaps).  :data:`H100` holds the costs
fitted to measured H100 calls of every shape class (:data:`.measured.H100_818979A`:
the square grid, GQA and rectangular shapes, every schedule); the older square
grid :data:`H100_B064A4D` stays for the ranking table.  Both are package data
(``data/``), which also says where and when they were measured and fitted.  :func:`predict_ms` turns the costs into a predicted time of the whole
backward call, :func:`best_schedule` into a schedule choice for any shape.
``python -m dash_fa3.schedule calibrate --calls --fit`` refits them (needs scipy)
and prints the held-out accuracy; without ``--calls``, on the grid, the table of
docs/journal/schedule.md.

Units: microseconds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..geometry import Geometry, bwd_block_sizes
from .simulate import CostModel, simulate

# --------------------------------------------------------------------- the measured grid
#: Columns of a measured row: ``nd`` is our non-deterministic backward (its
#: ``auto``, the ``lpt`` order without semaphores), the others the
#: deterministic backward with that schedule.
COLUMNS = ("nd", "fa3", "spt", "descending", "shift", "symmetric_shift", "lpt")


@dataclass(frozen=True)
class MeasuredGrid:
    """Backward TFLOP/s of one benchmark run, per (head dim, mask, seqlen) and column."""

    device: str
    date: str
    commit: str
    source: str
    num_sms: int
    total_tokens: int
    hidden: int
    rows: tuple  # (hdim, mask, seqlen, (TFLOP/s per COLUMNS))

    def geometry(self, hdim: int, mask: str, seqlen: int) -> Geometry:
        return Geometry.from_shape(batch=self.total_tokens // seqlen, heads=self.hidden // hdim,
                                   seqlen_q=seqlen, headdim=hdim, causal=mask == "causal")

    def flops(self, hdim: int, mask: str, seqlen: int) -> float:
        """The benchmark's count: 2.5 x 4 b h s^2 d, halved when causal."""
        g = self.geometry(hdim, mask, seqlen)
        f = 2.5 * 4.0 * g.batch * g.heads * seqlen * seqlen * hdim
        return f / 2 if mask == "causal" else f

    def points(self):
        """(hdim, mask, seqlen, column, measured ms) of every cell."""
        for hdim, mask, seqlen, tflops in self.rows:
            for col, tf in zip(COLUMNS, tflops):
                yield hdim, mask, seqlen, col, self.flops(hdim, mask, seqlen) / (tf * 1e12) * 1e3


def measured_grid_from_dict(d: dict) -> MeasuredGrid:
    """A :class:`MeasuredGrid` from its JSON form (``rows``: [hdim, mask, seqlen, [TFLOP/s per ``columns``]])."""
    if tuple(d["columns"]) != COLUMNS:
        raise ValueError(f"measured grid columns {d['columns']} are not {list(COLUMNS)}")
    rows = tuple((int(h), str(m), int(sl), tuple(float(x) for x in tf)) for h, m, sl, tf in d["rows"])
    return MeasuredGrid(device=d["device"], date=d["date"], commit=d["commit"], source=d["source"],
                        num_sms=int(d["num_sms"]), total_tokens=int(d["total_tokens"]), hidden=int(d["hidden"]),
                        rows=rows)


# --------------------------------------------------------------------- the fitted costs
@dataclass(frozen=True)
class HeadDimCosts:
    """Fitted costs of one head dim's kernel (microseconds).

    compute:          MMA work of one step on a tile without mask, extrapolated to seqlen_q -> 0
    compute_per_kquery: its growth per 1024 queries of seqlen_q: a head's Q, dO and dQ
                      accumulator, which its KV tiles read again and again, grow with it (K and V
                      are read once per task); fitted on square problems, where seqlen_q = seqlen_k.
                      Past the L2: Calibration.l2_bytes
    masked_extra:     extra of a step whose tile needs the causal mask
    epilogue:         per task: the dK/dV store and the next task's start (a chain of a GQA
                      group's rows: once, on its last row; simulate.epilogue_weights)
    reduce:           one 32 KiB fp32 reduce-add of a partial dQ, issue to completion
                      (deterministic: to the semaphore release)
    read:             from its issue until the add has read its sdQ buffer (frees it)
    latency:          semaphore hand-off: release -> the waiting writer sees it
    handoff_at:       fraction of a step's compute before the MMA warps wait for a free
                      sdQ buffer (the dK GEMM after it overlaps the wait)
    """

    compute: float
    compute_per_kquery: float
    masked_extra: float
    epilogue: float
    reduce: float
    read: float
    latency: float
    handoff_at: float = 1.0

    def step_compute(self, seqlen_q: int) -> float:
        return self.compute + self.compute_per_kquery * seqlen_q / 1024.0

    def cost_model(self, seqlen_q: int, deterministic: bool = True) -> CostModel:
        c = self.step_compute(seqlen_q)
        return CostModel(compute=c, reduce=self.reduce, latency=self.latency, epilogue=self.epilogue,
                         masked_compute=c + self.masked_extra, read=min(self.read, self.reduce),
                         deterministic=deterministic, pipeline="writer", handoff_at=self.handoff_at)


@dataclass(frozen=True)
class Calibration:
    """Fitted costs of one device, and where they came from."""

    device: str
    num_sms: int
    data: str                  # the measurement: date, commit, where it is written down
    fitted: str                # how and when the costs were fitted
    overhead: float            # us per call outside the kernels' HBM traffic (launch gaps); not fitted
    headdims: dict = field(default_factory=dict)   # head dim -> HeadDimCosts
    # the pre- and postprocess: their HBM bytes (pre_post_bytes) at this rate, bytes per us; 0: none
    # (overhead is then the whole cost outside the main kernel); not fitted. Also the rate of the
    # main kernel's steps when their working set (working_set_bytes) exceeds l2_bytes (0: never,
    # see predict_ms).
    pre_post_bytes_per_us: float = 0.0
    l2_bytes: int = 0

    def call_overhead_us(self, geometry: Geometry, headdim: int, *, deterministic: bool = True,
                         header=None) -> float:
        """Microseconds of one backward call outside the main kernel: ``overhead`` plus the pre- and
        postprocess's bytes (:func:`pre_post_bytes`; ``header``: the schedule's metadata header)
        at ``pre_post_bytes_per_us``."""
        if not self.pre_post_bytes_per_us:
            return self.overhead
        return self.overhead + pre_post_bytes(geometry, headdim, deterministic=deterministic,
                                              header=header) / self.pre_post_bytes_per_us

    def costs_for(self, headdim: int, geometry: Geometry) -> HeadDimCosts:
        """The costs of ``headdim``: its own, else those of the nearest calibrated head
        dim (one with the same tile sizes first), scaled by the tile's MMA work
        (compute, epilogue) and dQ bytes (reduce, read)."""
        if headdim in self.headdims:
            return self.headdims[headdim]
        tiles = (geometry.block_m, geometry.block_n)
        ref = min(self.headdims, key=lambda d: (bwd_block_sizes(d) != tiles, abs(d - headdim), d))
        hc = self.headdims[ref]
        rbm, rbn = bwd_block_sizes(ref)
        work = (geometry.block_m * geometry.block_n * headdim) / float(rbm * rbn * ref)
        dq = (geometry.block_m * headdim) / float(rbm * ref)
        return replace(hc, compute=hc.compute * work, compute_per_kquery=hc.compute_per_kquery * work,
                       masked_extra=hc.masked_extra * work, epilogue=hc.epilogue * work,
                       reduce=hc.reduce * dq, read=hc.read * dq)

    def cost_model(self, headdim: int, geometry: Geometry, deterministic: bool = True) -> CostModel:
        return self.costs_for(headdim, geometry).cost_model(geometry.seqlen_q, deterministic)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headdims"] = {str(k): asdict(v) for k, v in self.headdims.items()}
        return d


def pre_post_bytes(geometry: Geometry, headdim: int, *, deterministic: bool = True, header=None,
                   dq_zeroed: bool | None = None) -> int:
    """HBM bytes the backward's preprocess and postprocess move (dense, 16-bit inputs; V's head dim
    taken equal to ``headdim``), after csrc/api/bwd_dispatch.cpp and bwd_workspace.cpp.

    Preprocess: reads O and dO, writes dPsum and the log2 LSE per row, zeroes the dQ semaphores
    (one set per dQ split) and, non-deterministic, the fp32 dQ accumulators (deterministic, each
    tile's first add stores) and, with GQA adding into one dK/dV accumulator per KV head, those. Postprocess: reads the dQ accumulators, writes dQ;
    with GQA reads the fp32 dK/dV partials (a slab per query head, or one accumulator per KV head
    where the schedule orders the turns or the non-deterministic mode adds) and writes dK, dV;
    a schedule of whole-group chains (``groups``) has none: the main kernel stores dK, dV.
    ``header``: the schedule's metadata header (num_splits, dkv_ordered, dkv_chained); None: one
    split, no turns, no chains. ``dq_zeroed``: whether the preprocess zeroes the dQ accumulators
    (None: as this kernel does, non-deterministic only; the grid measured before the deterministic
    first store zeroed them in both modes)."""
    from .. import metadata as M
    g = geometry
    splits = int(header[M.H_NUM_SPLITS]) if header is not None else 1
    ordered = header is not None and int(header[M.H_DKV_ORDERED]) == 1
    chained = header is not None and int(header[M.H_DKV_CHAINED]) == M.DKV_CHAINED_ADD
    whole = header is not None and int(header[M.H_DKV_CHAINED]) == M.DKV_CHAINED_WHOLE
    rows = g.batch * g.heads * g.n_q * g.block_m     # statistics and accumulator rows
    q_elems = g.batch * g.seqlen_q * g.heads * headdim
    acc = rows * headdim * 4
    zeroed = (not deterministic) if dq_zeroed is None else dq_zeroed
    pre = 2 * q_elems * 2 + rows * 4 * 2 + splits * ((acc if zeroed else 0) + g.batch * g.heads * g.n_q * 4)
    post = splits * acc + q_elems * 2
    if g.heads != g.heads_kv and not whole:
        kv_rows = g.batch * g.seqlen_k
        accumulate = not deterministic and (2 * g.seqlen_q <= g.seqlen_k or chained)
        per_kv = accumulate or (deterministic and ordered)
        partial = kv_rows * (g.heads_kv if per_kv else g.heads) * 2 * headdim * 4
        pre += partial if accumulate else 0
        post += partial + kv_rows * g.heads_kv * 2 * headdim * 2
    return int(pre + post)


def working_set_bytes(schedule, headdim: int, sim=None, *, calibration: Calibration | None = None,
                      deterministic: bool = True) -> int:
    """The L2 size that would hold half of what the run of ``schedule`` reads again (Q, dO and the
    fp32 dQ accumulators, one per dQ split) from one read to the next: the median reuse distance
    of its steps' accesses (:func:`.reuse.schedule_working_set`). ``sim``: the run (a
    :class:`SimResult` of ``schedule``); None: simulated here under ``calibration``'s costs
    (default :data:`H100`).

    Distances over a run's times, not the tiles its first tasks touch: CTAs that sweep a head's
    Q range side by side read each tile one after another and need few of them in L2 at once
    however long the range (the grouped view of an MQA shape), while a CTA that returns to its
    own tiles only after a pass over all of them (``runs``' accumulators) needs every CTA's
    pass in L2."""
    from .reuse import schedule_working_set
    if sim is None:
        cal = calibration or H100
        sms = max(int(cal.num_sms), int(schedule.num_ctas))
        sim = simulate(schedule, cal.cost_model(headdim, schedule.geometry, deterministic), num_sms=sms)
    return schedule_working_set(schedule, sim, headdim)


def calibration_from_dict(d: dict) -> Calibration:
    """A :class:`Calibration` from its JSON form (:meth:`Calibration.to_dict`)."""
    return Calibration(device=d["device"], num_sms=int(d["num_sms"]), data=d["data"], fitted=d["fitted"],
                       overhead=float(d["overhead"]),
                       pre_post_bytes_per_us=float(d.get("pre_post_bytes_per_us", 0.0)),
                       l2_bytes=int(d.get("l2_bytes", 0)),
                       headdims={int(k): HeadDimCosts(**v) for k, v in d["headdims"].items()})


#: The shipped H100 data: the measured grid of b064a4d and the costs ``python -m dash_fa3.schedule
#: calibrate --calls --fit`` fitted to part of the measured calls of 818979a (robust least squares of
#: the log error; the rest held out, docs/design/schedule.md "Calibration"). ``handoff_at`` and ``overhead`` are not fitted: the model is insensitive to the
#: first, and on this grid the second cannot be told apart from the epilogue (the file says how it
#: was set).
DATA_PATH = Path(__file__).with_name("data") / "h100.json"
_DATA = json.loads(DATA_PATH.read_text())
H100_B064A4D = measured_grid_from_dict(_DATA["grid"])
H100 = calibration_from_dict(_DATA["calibration"])


# --------------------------------------------------------------------- prediction
def predict_ms(name: str, geometry: Geometry, headdim: int, *, deterministic: bool = True,
               calibration: Calibration | None = None, num_sms: int | None = None) -> float:
    """Predicted time (ms) of one backward call (pre/postprocess included) with schedule ``name``."""
    from ..schedules import get_schedule
    cal = calibration or H100
    sms = int(num_sms or cal.num_sms)
    s = get_schedule(name, geometry, sms)
    costs = cal.cost_model(headdim, geometry, deterministic)
    sim = simulate(s, costs, num_sms=sms)
    if cal.l2_bytes and cal.pre_post_bytes_per_us and working_set_bytes(s, headdim, sim) > cal.l2_bytes:
        # Most of what the steps read again is gone from L2 by then (working_set_bytes, on the
        # run at the L2 rates): every step streams its Q and dO tiles and its dQ tile's read and
        # write from HBM, all CTAs at once.
        step_bytes = geometry.block_m * headdim * (2 + 2 + 4 + 4)
        floor = min(s.num_ctas, sms) * step_bytes / cal.pre_post_bytes_per_us
        costs = replace(costs, compute=max(costs.compute, floor),
                        masked_compute=max(costs.masked_compute or costs.compute, floor))
        sim = simulate(s, costs, num_sms=sms)
    overhead = cal.call_overhead_us(geometry, headdim, deterministic=deterministic, header=s.meta.header)
    return (overhead + sim.makespan) / 1000.0


# --------------------------------------------------------------------- fitting
PARAMS = ("compute", "compute_per_kquery", "masked_extra", "epilogue", "reduce", "read", "latency",
          "handoff_at")


class Cell:
    """One measured call and its prepared simulation (:class:`.simulate.WriterProgram`): the schedule
    ``schedule`` (concrete) on ``geometry``, deterministic or not. ``dq_zeroed``: as
    :func:`pre_post_bytes`. Where the schedule's working set exceeds the L2 (under ``calibration``'s
    costs, default :data:`H100`), every step costs at least the HBM floor, as in :func:`predict_ms`."""

    def __init__(self, geometry: Geometry, hdim: int, schedule: str, deterministic: bool, measured_ms: float,
                 num_sms: int, *, dq_zeroed: bool | None = None, calibration: Calibration | None = None,
                 column: str | None = None, source: str = ""):
        import numpy as np
        from ..schedules import build_schedule
        from .simulate import WriterProgram
        g = geometry
        self.geometry, self.hdim, self.measured_ms, self.source = g, hdim, measured_ms, source
        self.mask, self.seqlen, self.column = g.mask, g.seqlen_q, column or schedule
        self.schedule, self.deterministic = schedule, deterministic
        s = build_schedule(schedule, g, num_sms, validate=False)
        self.steps = s.num_steps
        self.prog = WriterProgram(s, num_sms, 2, deterministic=deterministic)
        self.pre_post_bytes = pre_post_bytes(g, hdim, deterministic=deterministic, header=s.meta.header,
                                             dq_zeroed=dq_zeroed)
        kv = s.task_kv[s.step_task]
        self.masked = np.asarray(g.tiles.needs_mask(g.real_q(s.step_q), kv), dtype=float)[self.prog.step_perm]
        cal = calibration or H100
        self.floor = 0.0
        if cal.l2_bytes and cal.pre_post_bytes_per_us:
            sim = simulate(s, cal.cost_model(hdim, g, deterministic), num_sms=num_sms)
            if working_set_bytes(s, hdim, sim) > cal.l2_bytes:
                self.floor = min(s.num_ctas, num_sms) * g.block_m * hdim * (2 + 2 + 4 + 4) / cal.pre_post_bytes_per_us

    @classmethod
    def of_grid(cls, grid: MeasuredGrid, hdim: int, mask: str, seqlen: int, column: str, measured_ms: float):
        """A cell of the measured grid: ``nd`` ran ``lpt`` without semaphores, and that grid's kernel
        (b064a4d) zeroed the dQ accumulator in both modes."""
        return cls(grid.geometry(hdim, mask, seqlen), hdim, "lpt" if column == "nd" else column, column != "nd",
                   measured_ms, grid.num_sms, dq_zeroed=True, column=column)

    @classmethod
    def of_call(cls, call, num_sms: int, calibration: Calibration | None = None):
        """A cell of a :class:`.measured.MeasuredCall`."""
        return cls(call.geometry(), call.headdim, call.resolved(num_sms), call.deterministic, call.ms, num_sms,
                   calibration=calibration, source=call.source)

    def makespan(self, hc: HeadDimCosts) -> float:
        import numpy as np
        n = self.masked.size
        c = max(hc.step_compute(self.geometry.seqlen_q), self.floor)
        c = np.maximum(c + hc.masked_extra * self.masked, self.floor)
        r = np.full(n, hc.reduce)
        rd = np.full(n, min(hc.read, hc.reduce))
        return self.prog.makespan(c, r, rd, hc.epilogue, hc.latency, hc.handoff_at)

    def predict_ms(self, hc: HeadDimCosts, overhead: tuple) -> float:
        """``overhead``: (fixed us, pre/postprocess bytes per us or 0), :func:`_overhead_of`."""
        fixed, rate = overhead
        return (fixed + (self.pre_post_bytes / rate if rate else 0.0) + self.makespan(hc)) / 1000.0


_CELLS: list = []


def _cell_ms(args):
    i, x, overhead = args
    return _CELLS[i].predict_ms(HeadDimCosts(*x), overhead)


def _overhead_of(calibration: Calibration) -> tuple:
    return (calibration.overhead, calibration.pre_post_bytes_per_us)


def predict_cells(cells_idx, hc: HeadDimCosts, overhead: tuple, pool=None) -> list:
    args = [(i, tuple(asdict(hc).values()), overhead) for i in cells_idx]
    return list(pool.map(_cell_ms, args, chunksize=1)) if pool else [_cell_ms(a) for a in args]


class _Stop(Exception):
    pass


def fit_headdim(cells_idx, x0: HeadDimCosts, overhead: tuple, pool=None, max_evals: int = 120,
                log=print, loss: str = "linear") -> HeadDimCosts:
    """Least squares of log(predicted / measured) over the cells (scipy, imported
    here), from ``x0``; stops after ``max_evals`` evaluations (Jacobian ones
    included) with the best point seen. ``loss="soft_l1"``: residuals past 5% weigh
    linearly, not quadratically (a few cells the model misses do not drag the rest)."""
    import numpy as np
    from scipy.optimize import least_squares
    meas = np.log([_CELLS[i].measured_ms for i in cells_idx])

    # read as a fraction of reduce, so that read <= reduce is a box bound
    def unpack(z):
        d = dict(zip(PARAMS, (float(v) for v in z)))
        d["read"] = d["read"] * d["reduce"]
        return HeadDimCosts(**d)
    z0 = np.array(list(asdict(x0).values()), dtype=float)
    z0[PARAMS.index("read")] = x0.read / x0.reduce if x0.reduce > 0 else 0.5
    lo = np.zeros(len(PARAMS))
    hi = np.full(len(PARAMS), np.inf)
    hi[PARAMS.index("read")] = 1.0
    hi[PARAMS.index("handoff_at")] = 1.0
    lo[PARAMS.index("handoff_at")] = 0.05
    z0 = np.clip(z0, lo + 1e-6, np.where(np.isfinite(hi), hi - 1e-6, np.inf))
    best = [np.inf, z0]
    calls = [0]

    def resid(z):
        if calls[0] >= max_evals:
            raise _Stop
        calls[0] += 1
        pred = np.log(predict_cells(cells_idx, unpack(z), overhead, pool))
        res = pred - meas
        ss = float(np.sum(res ** 2))
        if ss < best[0]:
            best[0], best[1] = ss, np.array(z, dtype=float)
            log(f"  eval {calls[0]}: rms {np.sqrt(np.mean(res ** 2)):.4f} max {np.abs(res).max():.3f} "
                + " ".join(f"{v:.4g}" for v in z))
        return res
    try:
        least_squares(resid, z0, bounds=(lo, hi), diff_step=0.03, x_scale="jac", loss=loss, f_scale=0.05)
    except _Stop:
        pass
    return unpack(best[1])


# --------------------------------------------------------------------- evaluation and the table
def headdim_of(geometry: Geometry) -> int:
    """The head dim a geometry's backward tiles stand for (its calibrated costs):
    the smallest head dim with these block sizes (64x128 tiles: 96 and 128 -> 96)."""
    from ..contract import BWD_BLOCK_SIZES
    for hd in sorted(BWD_BLOCK_SIZES):
        if BWD_BLOCK_SIZES[hd] == (geometry.block_m, geometry.block_n):
            return hd
    return 128


def _pool(workers: int):
    import multiprocessing as mp
    return mp.get_context("fork").Pool(workers) if workers > 1 else None


def evaluate_grid(calibration: Calibration, grid: MeasuredGrid, train_seqlens=(), headdims=None,
                  workers: int = 1, seqlens=None) -> list[dict]:
    """Measured and predicted ms of every cell of ``grid`` (one dict per cell;
    only ``headdims`` / ``seqlens`` when given); ``split`` says whether the
    cell's seqlen was among the fit's."""
    global _CELLS
    # the cells are built before the pool forks: the workers inherit them
    _CELLS = [Cell.of_grid(grid, *p) for p in grid.points()
              if (headdims is None or p[0] in headdims) and (seqlens is None or p[2] in seqlens)]
    pool = _pool(workers)
    out = []
    try:
        for hd in sorted({c.hdim for c in _CELLS}):
            idx = [i for i, c in enumerate(_CELLS) if c.hdim == hd]
            pred = predict_cells(idx, calibration.headdims[hd], _overhead_of(calibration), pool)
            for i, p in zip(idx, pred):
                c = _CELLS[i]
                out.append(dict(hdim=c.hdim, mask=c.mask, seqlen=c.seqlen, column=c.column,
                                measured_ms=c.measured_ms, predicted_ms=p, error=p / c.measured_ms - 1.0,
                                split="fit" if c.seqlen in train_seqlens else "held out"))
    finally:
        if pool:
            pool.close()
        _CELLS = []
    out.sort(key=lambda r: (r["hdim"], r["mask"] != "full", r["seqlen"], COLUMNS.index(r["column"])))
    return out


def refit(calibration: Calibration, grid: MeasuredGrid, train_seqlens, headdims=None, workers: int = 1,
          max_evals: int = 80, log=print) -> Calibration:
    """``calibration`` with the costs of ``headdims`` refitted on the cells of
    ``train_seqlens`` (least squares of the log error, from the current costs)."""
    global _CELLS
    fitted = dict(calibration.headdims)
    for hd in headdims or sorted({r[0] for r in grid.rows}):
        _CELLS = [Cell.of_grid(grid, *p) for p in grid.points() if p[0] == hd and p[2] in train_seqlens]
        pool = _pool(workers)
        try:
            log(f"fitting head dim {hd} on seqlens {tuple(train_seqlens)}: {len(_CELLS)} cells")
            fitted[hd] = fit_headdim(list(range(len(_CELLS))), calibration.headdims[hd], _overhead_of(calibration),
                                     pool, max_evals=max_evals, log=log)
            log(f"  {fitted[hd]}")
        finally:
            if pool:
                pool.close()
            _CELLS = []
    return replace(calibration, headdims=fitted,
                   fitted=f"refit on seqlens {tuple(train_seqlens)} (calibrate --fit)")


#: The sources of :data:`.measured.H100_818979A` the shipped costs are fitted on; the rest (the
#: rectangular shapes of bench_rect.py and bench_auto.py's probe sets) are held out.
CALLS_TRAIN_SOURCES = ("grid", "first", "held_out")
#: Calls of more steps than this are left out of a fit (their simulation dominates its time).
CALLS_FIT_MAX_STEPS = 150_000


def call_cells(calls, num_sms: int, calibration: Calibration | None = None) -> list:
    """A :class:`Cell` per :class:`.measured.MeasuredCall` (the head dims of ``calibration``)."""
    cal = calibration or H100
    return [Cell.of_call(c, num_sms, cal) for c in calls if c.headdim in cal.headdims]


def evaluate_calls(calibration: Calibration, cells: list) -> list[dict]:
    """Measured and predicted ms of every cell of :func:`call_cells`."""
    out = []
    for c in cells:
        p = c.predict_ms(calibration.headdims[c.hdim], _overhead_of(calibration))
        b, sq, sk, h, hkv = (c.geometry.batch, c.geometry.seqlen_q, c.geometry.seqlen_k, c.geometry.heads,
                             c.geometry.heads_kv)
        out.append(dict(source=c.source, shape=f"{b}x{sq}x{sk} {h}/{hkv} d{c.hdim} {c.mask}", schedule=c.schedule,
                        deterministic=c.deterministic, measured_ms=c.measured_ms, predicted_ms=p,
                        error=p / c.measured_ms - 1.0))
    return out


def summarize_calls(rows: list[dict], within: float = 0.10) -> dict:
    """Per source: cells, how many within ``within``, the median error; and per shape of the
    ``rect`` source, the non-deterministic call and the fastest deterministic schedule's."""
    import statistics
    out = {}
    for src in sorted({r["source"] for r in rows}):
        errs = [r["error"] for r in rows if r["source"] == src]
        out[src] = dict(cells=len(errs), within=sum(abs(e) <= within for e in errs),
                        median_error=round(statistics.median(errs), 4))
    shapes = {}
    for r in rows:
        if r["source"] == "rect":
            shapes.setdefault(r["shape"], []).append(r)
    if shapes:
        nd = [next(r for r in rs if not r["deterministic"]) for rs in shapes.values()]
        best = [min((r for r in rs if r["deterministic"]), key=lambda r: r["measured_ms"]) for rs in shapes.values()]
        out["rect shapes"] = dict(shapes=len(shapes), nd_within=sum(abs(r["error"]) <= within for r in nd),
                                  best_det_within=sum(abs(r["error"]) <= within for r in best))
    return out


def refit_calls(calibration: Calibration, cells: list, train_sources=CALLS_TRAIN_SOURCES, headdims=None,
                workers: int = 1, max_evals: int = 400, max_steps: int = CALLS_FIT_MAX_STEPS,
                log=print) -> Calibration:
    """``calibration`` with the costs of ``headdims`` refitted on the cells of ``train_sources`` of at
    most ``max_steps`` steps (robust least squares of the log error, from the current costs)."""
    global _CELLS
    fitted = dict(calibration.headdims)
    for hd in headdims or sorted({c.hdim for c in cells}):
        _CELLS = [c for c in cells if c.hdim == hd and c.source in train_sources and c.steps <= max_steps]
        pool = _pool(workers)
        try:
            log(f"fitting head dim {hd} on {len(_CELLS)} calls of {', '.join(train_sources)}")
            fitted[hd] = fit_headdim(list(range(len(_CELLS))), calibration.headdims[hd], _overhead_of(calibration),
                                     pool, max_evals=max_evals, log=log, loss="soft_l1")
            log(f"  {fitted[hd]}")
        finally:
            if pool:
                pool.close()
            _CELLS = []
    return replace(calibration, headdims=fitted)


def _kendall(a, b) -> float:
    n = len(a)
    s = 0
    m = 0
    for i in range(n):
        for j in range(i + 1, n):
            x = (a[i] - a[j]) * (b[i] - b[j])
            s += (x > 0) - (x < 0)
            m += 1
    return s / m if m else 1.0


def ranking(rows: list[dict], tie: float = 0.02) -> list[dict]:
    """Per grid point, the deterministic schedules ranked by the GPU and by the
    model: the best of each, what the model's pick costs on the GPU
    (``pick_loss``: its measured time over the measured best's, - 1), Kendall's
    tau, and ``pairs_agree`` / ``pairs``: pairs of schedules whose measured
    times differ by more than ``tie`` that the model orders the same way."""
    pts = {}
    for r in rows:
        if r["column"] != "nd":
            pts.setdefault((r["hdim"], r["mask"], r["seqlen"]), []).append(r)
    out = []
    for key, rs in pts.items():
        names = [r["column"] for r in rs]
        m = [r["measured_ms"] for r in rs]
        p = [r["predicted_ms"] for r in rs]
        best_m = names[m.index(min(m))]
        best_p = names[p.index(min(p))]
        loss = m[names.index(best_p)] / min(m) - 1.0
        pairs = agree = 0
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                if abs(m[i] / m[j] - 1.0) > tie:
                    pairs += 1
                    agree += (m[i] < m[j]) == (p[i] < p[j])
        out.append(dict(hdim=key[0], mask=key[1], seqlen=key[2], measured_best=best_m, model_best=best_p,
                        pick_loss=loss, kendall_tau=_kendall(m, p), pairs=pairs, pairs_agree=agree,
                        order_measured=[names[i] for i in sorted(range(len(m)), key=m.__getitem__)],
                        order_model=[names[i] for i in sorted(range(len(p)), key=p.__getitem__)]))
    return out


def format_table(rows: list[dict], ranks: list[dict]) -> str:
    """The markdown table of docs/journal/schedule.md: per grid point, each column's
    measured / predicted ms and error, then the ranking columns."""
    short = {"nd": "nd (lpt)", "fa3": "fa3", "spt": "spt", "descending": "desc", "shift": "shift",
             "symmetric_shift": "sym_shift", "lpt": "lpt"}
    lines = ["| hdim | mask | seqlen | split | " + " | ".join(short[c] for c in COLUMNS)
             + " | GPU best | model best | pick loss | tau | pairs |",
             "|---" * (4 + len(COLUMNS) + 5) + "|"]
    rk = {(r["hdim"], r["mask"], r["seqlen"]): r for r in ranks}
    pts = {}
    for r in rows:
        pts.setdefault((r["hdim"], r["mask"], r["seqlen"]), {})[r["column"]] = r
    for key, cols in pts.items():
        k = rk[key]
        cells = []
        for c in COLUMNS:
            r = cols.get(c)
            cells.append("" if r is None else
                         f"{r['measured_ms']:.3f} / {r['predicted_ms']:.3f} ({100 * r['error']:+.1f}%)")
        split = next(iter(cols.values()))["split"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {split} | " + " | ".join(cells)
                     + f" | {k['measured_best']} | {k['model_best']} | {100 * k['pick_loss']:.1f}% | "
                       f"{k['kendall_tau']:.2f} | {k['pairs_agree']}/{k['pairs']} |")
    return "\n".join(lines)


def summarize(rows: list[dict], ranks: list[dict]) -> dict:
    import statistics
    out = {}
    for split in ("fit", "held out", "all"):
        rs = [r for r in rows if split == "all" or r["split"] == split]
        if not rs:
            continue
        errs = [abs(r["error"]) for r in rs]
        out[split] = dict(cells=len(rs), median_abs_error=statistics.median(errs), max_abs_error=max(errs),
                          within_10pct=sum(e <= 0.10 for e in errs),
                          within_5pct=sum(e <= 0.05 for e in errs))
    out["ranking"] = dict(points=len(ranks),
                          same_best=sum(r["measured_best"] == r["model_best"] for r in ranks),
                          pick_within_2pct=sum(r["pick_loss"] <= 0.02 for r in ranks),
                          max_pick_loss=max(r["pick_loss"] for r in ranks),
                          same_full_order=sum(r["order_measured"] == r["order_model"] for r in ranks),
                          median_kendall_tau=statistics.median(r["kendall_tau"] for r in ranks),
                          pairs=sum(r["pairs"] for r in ranks),
                          pairs_agree=sum(r["pairs_agree"] for r in ranks))
    return out


# --------------------------------------------------------------------- auto from the model
def model_candidates(geometry: Geometry, whole_groups: bool = True) -> tuple[str, ...]:
    """The deterministic schedules the model policy weighs for ``geometry``: every one defined for it
    (:func:`..schedules.schedules_for`, in the contract's order), less those of whole GQA groups where
    the call wants fp32 dK/dV partials (``whole_groups=False``: :data:`..contract.WHOLE_GROUP_SCHEDULES`)."""
    from ..contract import WHOLE_GROUP_SCHEDULES
    from ..schedules import schedules_for
    names = schedules_for(geometry)
    if not whole_groups and geometry.heads != geometry.heads_kv:
        names = tuple(n for n in names if n not in WHOLE_GROUP_SCHEDULES)
    return names


def predict_all(geometry: Geometry, num_sms: int, headdim: int | None = None,
                calibration: Calibration | None = None, candidates=None) -> dict:
    """Predicted ms of each candidate deterministic schedule for this shape (default:
    :func:`model_candidates`)."""
    cal = calibration or H100
    hd = headdim or headdim_of(geometry)
    names = model_candidates(geometry) if candidates is None else candidates
    return {name: predict_ms(name, geometry, hd, calibration=cal, num_sms=num_sms) for name in names}


_BEST_CACHE: dict = {}


def best_schedule(geometry: Geometry, num_sms: int, headdim: int | None = None,
                  calibration: Calibration | None = None, whole_groups: bool = True) -> str:
    """The deterministic schedule the calibrated model predicts fastest among
    :func:`model_candidates` (ties: their order); cached per (shape, SMs, head dim, calibration,
    ``whole_groups``)."""
    cal = calibration or H100
    key = (geometry, int(num_sms), headdim or headdim_of(geometry), id(cal), bool(whole_groups))
    name = _BEST_CACHE.get(key)
    if name is None:
        names = model_candidates(geometry, whole_groups)
        pred = predict_all(geometry, num_sms, key[2], cal, candidates=names)
        name = min(names, key=lambda n: pred[n])
        _BEST_CACHE[key] = name
    return name
