"""Reads the backward's hand-off traces (``bwd_bench trace``, a
``DASH_FA3_BWD_TRACE=1`` build; csrc/kernels/bwd/bwd_trace.h) and prints, per
traced run, where the time of the MMA warpgroups and the dQ writers goes:

    python benchmarks/trace_summary.py DIR [--bundle FILE] [--json OUT]

Each run's steps are decoded from the schedule it ran: the bundle the harness
read (DASH_SCHEDULE_FILE), or else the schedule this checkout builds for the
shape (the same unless the schedules changed since).

Times are in microseconds. Durations on one SM come from clock64; the
hand-off latency (a release on one SM, the acquire it unblocks on another)
from the %globaltimer readings recorded beside those events. For task
begin/end times each SM's clock64 is mapped to %globaltimer by a fit (one
slope, one offset per SM).

Columns (medians over steps unless said otherwise):
  step         MMA warpgroup 0: start of a step to the start of the next one in the
               same task (p10 / p90 beside it: the per-step jitter)
  compute      MMA warpgroup 0: start of a step to its dq_empty wait (the step's GEMMs
               and softmax, without waiting for the dQ writer; p50 / p90)
  mma wait     share of the MMA warpgroups' task time spent in the dq_empty wait
               (waiting for the dQ writer to free an sdQ buffer)
  load wait    MMA warpgroup 0: share of its task time spent waiting for the steps'
               Q and dO stages (the producer's loads)
  blocked      dQ writer: share of the contributions after the first of their dQ
               tile whose predecessor had not yet released when the writer asked
  poll         dQ writer, the others: from asking to holding the turn (p50 / p90; the
               spin's round trips to L2, no waiting on anyone)
  add          writer: reduce-adds issued -> read (the copy engine has the data)
  chain        writer: issued -> complete and released (deterministic)
  handoff      release on one SM -> the waiting writer of the next rank sees it
               (only for waits that began before the release)
  start skew   spread of the first-step start times of tasks that share a head
               and a wave (static schedules) or a head (others)
  gaps         MMA warpgroups between the end of one task and the start of the
               next on the same CTA (epilogue, K/V load), share of the makespan
  tail         mean over CTAs of (makespan end - CTA's last task end), share
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dash_fa3.schedule import metadata as M  # noqa: E402
from dash_fa3.schedule.contract import SCHEDULES  # noqa: E402
from dash_fa3.schedule.export import read_bundle  # noqa: E402
from dash_fa3.schedule.geometry import Geometry  # noqa: E402
from dash_fa3.schedule.lowering import get_kernel_metadata  # noqa: E402
from dash_fa3.schedule.schedules import accumulation_predecessors  # noqa: E402

# csrc/kernels/bwd/bwd_trace.h
(W_WAIT, W_ACQ, W_ISSUED, W_READ, W_REL, W_WAIT_NS, W_ACQ_NS, W_REL_NS, M_STEP, M_STEP_NS, M_EMPTY_WAIT,
 M_EMPTY_DONE) = range(12)
M_Q_WAIT, M_DO_WAIT = 14, 15  # cycles, MMA warpgroup 0
M_Q_WAIT, M_DO_WAIT = 14, 15  # cycles, MMA warpgroup 0
T_CTA, T_SM, T_BEGIN, T_BEGIN_NS, T_END, T_END_NS, T_EPILOGUE, T_K_ISSUED, T_V_ISSUED = range(9)

INDEX_COLUMNS = ("tag", "schedule", "mode", "d", "causal", "b", "h", "hkv", "sq", "sk", "num_tasks", "max_steps",
                 "step_fields", "task_fields", "num_sms", "ms_plain", "ms_traced")


def read_index(directory: Path) -> list[dict]:
    runs = []
    for line in (directory / "index.tsv").read_text().splitlines():
        if not line.strip():
            continue
        values = line.split("\t")
        row = dict(zip(INDEX_COLUMNS, values))
        for k in INDEX_COLUMNS[3:15]:
            row[k] = int(row[k])
        row["ms_plain"], row["ms_traced"] = float(row["ms_plain"]), float(row["ms_traced"])
        runs.append(row)
    return runs


def load(directory: Path, run: dict):
    tasks = np.fromfile(directory / f"{run['tag']}.tasks.bin", dtype=np.int64)
    steps = np.fromfile(directory / f"{run['tag']}.steps.bin", dtype=np.int64)
    tasks = tasks.reshape(run["num_tasks"], run["task_fields"])
    steps = steps.reshape(run["num_tasks"], run["max_steps"], run["step_fields"])
    return tasks, steps


def clock_fit(sm: np.ndarray, clk: np.ndarray, ns: np.ndarray):
    """(slope ns per cycle, offset per SM) with ns ~ slope * clk + offset[sm]."""
    # Slope from within-SM variation (both centred per SM), then each SM's mean offset.
    clk_c = clk.astype(np.float64).copy()
    ns_c = ns.astype(np.float64).copy()
    for s in np.unique(sm):
        sel = sm == s
        clk_c[sel] -= clk_c[sel].mean()
        ns_c[sel] -= ns_c[sel].mean()
    slope = float((clk_c * ns_c).sum() / (clk_c * clk_c).sum())
    offset = {int(s): float(np.mean(ns[sm == s] - slope * clk[sm == s].astype(np.float64))) for s in np.unique(sm)}
    resid = ns - (slope * clk + np.array([offset[int(s)] for s in sm]))
    return slope, offset, float(np.std(resid))


def pct(x, q):
    return float(np.percentile(x, q)) if len(x) else float("nan")


class Decoded:
    """Every step of a schedule's task table as the kernel decodes it: the task
    row, the step, the dQ tile (batch, head, q) and its rank; rows in table order."""

    def __init__(self, meta: M.ScheduleMeta, heads: int, n_q: int):
        rows = meta.tasks.astype(np.int64)
        self.rows = rows
        self.task_steps = rows[:, M.C_N_STEPS]
        self.step_offsets = np.concatenate([[0], np.cumsum(self.task_steps)])
        self.step_task, self.step_index, q, self.step_rank = M.decode_all(meta.header, rows)
        hidx = rows[:, M.C_BATCH] * heads + rows[:, M.C_HEAD]
        self.step_dq_tile = hidx[self.step_task] * n_q + q
        # Tasks that start together: a head's units of one wave (static shift), else a head.
        self.group = hidx * (rows[:, M.C_SEG_BEGIN].max() + 1) + rows[:, M.C_SEG_BEGIN]


def schedule_of(run: dict, bundle: list[M.ScheduleMeta] | None) -> M.ScheduleMeta:
    g = Geometry.from_shape(batch=run["b"], heads=run["h"], heads_kv=run["hkv"], seqlen_q=run["sq"],
                            seqlen_k=run["sk"], headdim=run["d"], causal=bool(run["causal"]))
    if bundle is None:
        return get_kernel_metadata(run["schedule"], g, run["num_sms"], "static")
    want = {M.H_SCHEDULE: SCHEDULES.index(run["schedule"]), M.H_BATCH: g.batch, M.H_HEADS: g.heads,
            M.H_HEADS_KV: g.heads_kv, M.H_SEQLEN_Q: g.seqlen_q, M.H_SEQLEN_K: g.seqlen_k,
            M.H_BLOCK_M: g.block_m, M.H_MASK: M.MASK_CODES[g.mask]}
    for meta in bundle:
        if all(int(meta.header[k]) == v for k, v in want.items()):
            return meta
    raise SystemExit(f"the bundle has no {run['schedule']} schedule for {run['tag']}")


def summarize(directory: Path, run: dict, bundle: list[M.ScheduleMeta] | None = None) -> dict:
    tasks, steps = load(directory, run)
    sched = Decoded(schedule_of(run, bundle), run["h"], run["max_steps"])  # max_steps = n_q
    assert sched.rows.shape[0] == run["num_tasks"], (sched.rows.shape[0], run["num_tasks"])
    det = run["mode"] == "det"
    lens = sched.task_steps
    has_steps = lens > 0
    task_sm = tasks[:, T_SM]

    # Every (clock, ns) pair on each SM: task begin/end, step begins, writer events.
    pairs_sm, pairs_clk, pairs_ns = [tasks[has_steps, T_SM]] * 2, [tasks[has_steps, T_BEGIN],
                                                                    tasks[has_steps, T_END]], \
        [tasks[has_steps, T_BEGIN_NS], tasks[has_steps, T_END_NS]]
    t_idx = sched.step_task
    s_idx = sched.step_index
    st = steps[t_idx, s_idx]  # (num_steps, fields), schedule order
    sm_of_step = task_sm[t_idx]
    for c, n in ((M_STEP, M_STEP_NS), (W_WAIT, W_WAIT_NS)) + (((W_ACQ, W_ACQ_NS), (W_REL, W_REL_NS)) if det else ()):
        pairs_sm.append(sm_of_step)
        pairs_clk.append(st[:, c])
        pairs_ns.append(st[:, n])
    fit_sm, fit_clk, fit_ns = (np.concatenate(a) for a in (pairs_sm, pairs_clk, pairs_ns))
    recorded = (fit_clk > 0) & (fit_ns > 0)
    # %globaltimer counts from an epoch (~1.8e18 ns): relative to the first event,
    # so that float64 keeps nanoseconds.
    ns0 = fit_ns[recorded].min()
    slope, offset, resid = clock_fit(fit_sm[recorded], fit_clk[recorded], fit_ns[recorded] - ns0)
    off_step = np.array([offset[int(s)] for s in sm_of_step])
    off_task = np.array([offset.get(int(s), 0.0) for s in task_sm])

    def ns_of(col):  # a step field on the common time base, in microseconds
        return (slope * st[:, col] + off_step) * 1e-3

    t0 = (slope * tasks[has_steps, T_BEGIN] + off_task[has_steps]).min() * 1e-3
    begin = (slope * tasks[:, T_BEGIN] + off_task) * 1e-3 - t0
    end = (slope * tasks[:, T_END] + off_task) * 1e-3 - t0
    makespan = float(end[has_steps].max())
    out = {"tag": run["tag"], "schedule": run["schedule"], "mode": run["mode"], "ms_plain": run["ms_plain"],
           "ms_traced": run["ms_traced"], "ghz": 1.0 / slope, "fit_resid_ns": resid, "makespan_us": makespan}
    # Resolution of %globaltimer: the smallest positive difference seen.
    ns_all = np.unique(st[:, W_WAIT_NS])
    d_ns = np.diff(ns_all)
    out["timer_step_ns"] = float(d_ns[d_ns > 0].min()) if d_ns.size else float("nan")

    # Steps: start-to-start within a task (the last step of a task has no successor);
    # traces without step starts use warpgroup 0's dq_empty wait, once per step too.
    step_start = ns_of(M_STEP) if (st[:, M_STEP] > 0).all() else ns_of(M_EMPTY_WAIT)
    nxt = np.ones(len(st), bool)
    nxt[sched.step_offsets[1:][has_steps] - 1] = False
    dur = np.diff(step_start)[nxt[:-1]]
    out["step_us"] = (pct(dur, 50), pct(dur, 10), pct(dur, 90))
    if (st[:, M_STEP] > 0).all():
        compute = (st[:, M_EMPTY_WAIT] - st[:, M_STEP]) * slope * 1e-3
        out["compute_us"] = (pct(compute, 50), pct(compute, 90))

    # MMA waits on dq_empty, per warpgroup, as a share of task time.
    task_time = float((end - begin)[has_steps].sum())
    mma_wait = 0.0
    for wg in range(2):
        w = (st[:, M_EMPTY_DONE + 2 * wg] - st[:, M_EMPTY_WAIT + 2 * wg]) * slope * 1e-3
        mma_wait += float(w[st[:, M_EMPTY_WAIT + 2 * wg] > 0].sum())
    out["mma_wait_share"] = mma_wait / (2 * task_time)
    out["load_wait_share"] = float((st[:, M_Q_WAIT] + st[:, M_DO_WAIT]).sum()) * slope * 1e-3 / task_time

    if det:
        out["chain_us"] = pct((st[:, W_REL] - st[:, W_ISSUED]) * slope * 1e-3, 50)
        # Hand-off: predecessor (same dQ tile, rank - 1) released -> this writer acquired.
        pred = accumulation_predecessors(sched.step_dq_tile, sched.step_rank)
        has_pred = pred >= 0
        # Events on two SMs: their %globaltimer readings (the clock fit's residual,
        # about a microsecond on an H100 whose SM clock moves, is too coarse here).
        def gns(col):
            return (st[:, col] - ns0) * 1e-3
        rel_pred = np.where(has_pred, gns(W_REL_NS)[np.maximum(pred, 0)], np.nan)
        acq = gns(W_ACQ_NS)
        wait_start = gns(W_WAIT_NS)
        blocked = has_pred & (wait_start < rel_pred)
        lat = (acq - rel_pred)[blocked]
        out["handoff_us"] = (pct(lat, 50), pct(lat, 10), pct(lat, 90), int(blocked.sum()))
        out["blocked_share"] = float(blocked.sum() / max(int(has_pred.sum()), 1))
        poll = (acq - wait_start)[~blocked]
        out["poll_us"] = (pct(poll, 50), pct(poll, 90))
    out["add_us"] = pct((st[:, W_READ] - st[:, W_ISSUED]) * slope * 1e-3, 50)

    # Start skew of tasks sharing a head (and a wave, for static schedules).
    first_step = begin
    groups = {}
    for t in np.flatnonzero(has_steps):
        groups.setdefault(int(sched.group[t]), []).append(first_step[t])
    spreads = [max(v) - min(v) for v in groups.values() if len(v) > 1]
    out["start_skew_us"] = (pct(spreads, 50), pct(spreads, 90))

    # Gaps between consecutive tasks of a CTA, and each CTA's idle tail.
    gaps = 0.0
    tails = []
    for cta in np.unique(tasks[has_steps, T_CTA]):
        sel = np.flatnonzero(has_steps & (tasks[:, T_CTA] == cta))
        sel = sel[np.argsort(begin[sel])]
        gaps += float(np.maximum(begin[sel][1:] - end[sel][:-1], 0).sum())
        tails.append(makespan - end[sel].max())
    n_cta = len(tails)
    out["gap_share"] = gaps / (n_cta * makespan)
    out["tail_share"] = float(np.mean(tails)) / makespan
    return out


def fmt(x, nd=2):
    if isinstance(x, tuple):
        return " / ".join(fmt(v, nd) for v in x)
    if isinstance(x, float):
        return "-" if np.isnan(x) else f"{x:.{nd}f}"
    return str(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--bundle", type=Path, default=None, help="the schedule bundle the harness ran")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    bundle = read_bundle(args.bundle) if args.bundle else None
    rows = [summarize(args.dir, run, bundle) for run in read_index(args.dir)]
    cols = [("run", lambda r: r["tag"]), ("ms (traced)", lambda r: f"{r['ms_plain']:.3f} ({r['ms_traced']:.3f})"),
            ("makespan us", lambda r: fmt(r["makespan_us"], 0)),
            ("step us p50/p10/p90", lambda r: fmt(r["step_us"])),
            ("compute us p50/p90", lambda r: fmt(r["compute_us"]) if "compute_us" in r else "-"),
            ("mma wait", lambda r: f"{100 * r['mma_wait_share']:.1f}%"),
            ("load wait", lambda r: f"{100 * r['load_wait_share']:.1f}%"),
            ("blocked", lambda r: f"{100 * r['blocked_share']:.0f}%" if "blocked_share" in r else "-"),
            ("poll us p50/p90", lambda r: fmt(r["poll_us"]) if "poll_us" in r else "-"),
            ("add us", lambda r: fmt(r["add_us"])),
            ("chain us", lambda r: fmt(r.get("chain_us", float("nan")))),
            ("handoff us p50/p10/p90 (n)", lambda r: fmt(r["handoff_us"]) if "handoff_us" in r else "-"),
            ("start skew p50/p90", lambda r: fmt(r["start_skew_us"])),
            ("gaps", lambda r: f"{100 * r['gap_share']:.1f}%"), ("tail", lambda r: f"{100 * r['tail_share']:.1f}%")]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f(r) for _, f in cols) + " |")
    if rows:
        print(f"\nclock {rows[0]['ghz']:.3f} GHz (fit), residual {rows[0]['fit_resid_ns']:.0f} ns, "
              f"%globaltimer step {rows[0]['timer_step_ns']:.0f} ns")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
