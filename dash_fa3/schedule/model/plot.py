"""Gantt charts of simulated schedules (matplotlib, Agg backend, imported lazily).

One row per SM.  Each step is drawn as its compute segment (solid, the colour
of its head) followed by its reduce segment (same colour, hatched); a red bar
marks the time a reduce waited for its semaphore (a collision), grey a task's
epilogue (dK/dV store).  A dashed line marks the lower bound.  Small charts
print the Q tile of each step in its compute segment.  Large runs (more than ``max_detail_steps`` steps) draw one
bar per task instead of per step, plus the waits.

Writer pipeline (the kernel's, :mod:`.simulate`): the adds run on the CTA's
dQ writer, drawn hatched in a thin band under the SM's row (they overlap the
next computes); red in that band is the time a handed-over partial dQ waited
for its add (the writer behind or its semaphore), red in the row itself the
MMA warps' stall for a free sdQ buffer.
"""

from __future__ import annotations

import numpy as np


def _mpl():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch
    return plt, PolyCollection, Patch


def _verts(y, x0, x1, h):
    y = np.asarray(y, dtype=float)
    x0 = np.asarray(x0, dtype=float)
    x1 = np.asarray(x1, dtype=float)
    lo, hi = y - h / 2, y + h / 2
    return np.stack([np.stack([x0, lo], -1), np.stack([x1, lo], -1),
                     np.stack([x1, hi], -1), np.stack([x0, hi], -1)], axis=1)


def plot_gantt(schedule, sim, path=None, *, title: str | None = None, max_detail_steps: int = 6000,
               label_steps: int | None = None, dpi: int = 90, width: float = 11.0):
    """Draw ``sim`` (a :class:`~.simulate.SimResult` of ``schedule``); save to ``path``
    if given.  Returns the matplotlib Figure."""
    plt, PolyCollection, Patch = _mpl()
    g = schedule.geometry
    S = sim.num_sms
    used = int(sim.task_cta.max()) + 1 if sim.task_cta.size else S
    rows = max(used, 1)
    height = min(max(1.6 + 0.32 * rows, 2.6), 14.0)
    fig, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    cmap = plt.get_cmap("tab10")
    hidx = schedule.task_head_index
    n_heads = int(hidx.max()) + 1 if hidx.size else 1
    tcol = np.asarray(cmap(np.arange(n_heads) % 10))[hidx]
    step_task = schedule.step_task
    detail = schedule.num_steps <= max_detail_steps
    bar_h = 0.8
    writer = getattr(sim, "pipeline", "serial") == "writer"
    if writer:
        bar_h = 0.6
    wy = 0.42  # writer band offset below the row (writer pipeline)
    if detail:
        y = sim.step_cta
        col = tcol[step_task]
        ax.add_collection(PolyCollection(_verts(y, sim.step_start, sim.step_compute_end, bar_h),
                                         facecolors=col, edgecolors="k", linewidths=0.3))
        ry, rh = (y + wy, 0.22) if writer else (y, bar_h)
        ax.add_collection(PolyCollection(_verts(ry, sim.step_reduce_start, sim.step_end, rh),
                                         facecolors=col * [0.75, 0.75, 0.75, 1], edgecolors="k",
                                         linewidths=0.3, hatch="////"))
        if label_steps is None:
            label_steps = 400
        if schedule.num_steps <= label_steps:
            fs = 7 if rows <= 16 else 5
            for k in range(schedule.num_steps):
                w = sim.step_compute_end[k] - sim.step_start[k]
                if w <= 0:
                    continue
                ax.text(sim.step_start[k] + w / 2, y[k], str(int(schedule.step_q[k])), ha="center",
                        va="center", fontsize=fs, color="white" if sum(col[k][:3]) < 1.6 else "black")
    else:
        ax.add_collection(PolyCollection(_verts(sim.task_cta, sim.task_start, sim.task_end, bar_h),
                                         facecolors=tcol, edgecolors="none"))
    eps = 1e-9 * max(sim.makespan, 1.0)
    if writer:
        ready = np.maximum(sim.step_compute_end, sim.step_handoff)
        w_idx = np.flatnonzero(sim.step_reduce_start - ready > eps)
        if w_idx.size:
            ax.add_collection(PolyCollection(_verts(sim.step_cta[w_idx] + wy, ready[w_idx],
                                                    sim.step_reduce_start[w_idx], 0.1),
                                             facecolors="red", edgecolors="none"))
        s_idx = np.flatnonzero(sim.step_handoff - sim.step_compute_end > eps)
        if s_idx.size:
            ax.add_collection(PolyCollection(_verts(sim.step_cta[s_idx], sim.step_compute_end[s_idx],
                                                    sim.step_handoff[s_idx], bar_h * 0.35),
                                             facecolors="red", edgecolors="none"))
    else:
        wait = sim.step_reduce_start - sim.step_compute_end
        w_idx = np.flatnonzero(wait > eps)
        if w_idx.size:
            ax.add_collection(PolyCollection(_verts(sim.step_cta[w_idx], sim.step_compute_end[w_idx],
                                                    sim.step_reduce_start[w_idx], bar_h * 0.35),
                                             facecolors="red", edgecolors="none"))
    ep = sim.task_end - sim.epilogue_start
    p_idx = np.flatnonzero(ep > eps)
    if p_idx.size:
        ax.add_collection(PolyCollection(_verts(sim.task_cta[p_idx], sim.epilogue_start[p_idx],
                                                sim.task_end[p_idx], bar_h),
                                         facecolors="0.35", edgecolors="k", linewidths=0.3))
    ax.axvline(sim.lower_bound, color="k", ls="--", lw=0.8)
    ax.set_xlim(0, sim.makespan * 1.01 if sim.makespan > 0 else 1)
    ax.set_ylim(rows - 0.5, -0.5)
    if rows <= 24:
        ax.set_yticks(range(rows))
    ax.set_ylabel("SM")
    ax.set_xlabel("time (units of the cost model)")
    if title is None:
        title = (f"{schedule.name}  [{g.mask}, {g.n_kv} KV x {g.n_q} Q tiles, {g.num_heads_total} heads, "
                 f"{S} SMs]  makespan {sim.makespan:g}, lower bound {sim.lower_bound:g}, "
                 f"idle {100 * sim.sm_idle_fraction:.1f}%")
    ax.set_title(title, fontsize=9)
    handles = [Patch(facecolor=cmap(i % 10), label=f"head {i}") for i in range(min(n_heads, 8))]
    if detail:
        handles.append(Patch(facecolor="white", edgecolor="k", hatch="////",
                             label="dQ add (writer band)" if writer else "reduce (dQ add)"))
    handles.append(Patch(facecolor="red", label="add waits / buffer stall" if writer else "semaphore wait"))
    if p_idx.size:
        handles.append(Patch(facecolor="0.35", label="epilogue (dK/dV)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
    return fig
