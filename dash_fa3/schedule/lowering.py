"""Lowering dynamically dispatched schedules to static ones for the kernel.

The backward kernel runs static task lists: CTA i runs table rows
[offsets[i], offsets[i+1]). ``fa3``, ``spt`` and ``descending`` are defined
with a global queue that free CTAs claim from (how the hardware hands a plain
grid to SMs). Lowering fixes, ahead of the launch, the CTA each task would be
claimed by under the cost model: tasks in queue order, each to the CTA that
becomes free first (ties to the lowest index), with a task's cost its number of
Q-tile steps plus a fixed per-task cost (``schedules.task_claim_cost``). Orders (b) and (c) are unchanged: only (a) becomes explicit.

Deadlock-freedom carries over: a task only waits on tasks earlier in the queue,
and each CTA runs its tasks in queue order, so the earliest unfinished task
can always run. Validation checks it again on the lowered schedule.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from . import metadata as M
from .geometry import Geometry
from .schedules import (Schedule, _check_num_sms, _concrete, _i32, build_metadata, get_schedule,
                        greedy_assignment, is_queue, task_claim_cost)
from .validate import check_metadata, with_dkv_order


def lowering_order(s: Schedule, num_ctas: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(task_cta, perm) of the lowering of dynamic schedule ``s``: the CTA each
    task (in queue order) is claimed by, and the task-table order of the
    lowered schedule (by CTA, queue order within a CTA). ``num_ctas`` defaults
    to the schedule's."""
    T = s.num_tasks
    cta = greedy_assignment(task_claim_cost(s.task_steps), int(num_ctas or s.num_ctas))
    return cta, np.lexsort((np.arange(T), cta))


def lower_to_static(s: Schedule, *, validate: bool = True) -> Schedule:
    """The static form of ``s`` (``s`` itself when it is already static)."""
    if not s.dynamic:
        return s
    cta, perm = lowering_order(s)
    lens = s.task_steps[perm]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    step_idx = np.repeat(s.step_offsets[perm] - offsets[:-1], lens) + np.arange(int(offsets[-1]))
    counts = np.bincount(cta, minlength=s.num_ctas)
    cta_offsets = np.concatenate([[0], np.cumsum(counts)])

    rows = s.meta.tasks.astype(np.int64)[perm]
    rows[:, M.C_CTA] = cta[perm]
    header = s.meta.header.astype(np.int64).copy()
    header[M.H_DISPATCH] = M.DISPATCH_STATIC
    header[M.H_OFFSETS_LEN] = s.num_ctas + 1
    meta = M.ScheduleMeta(_i32(header), _i32(cta_offsets), _i32(rows))
    lowered = Schedule(
        name=s.name, geometry=s.geometry, num_sms=s.num_sms, dispatch="static", num_ctas=s.num_ctas,
        task_batch=s.task_batch[perm], task_head=s.task_head[perm], task_kv=s.task_kv[perm],
        task_cta=cta[perm], task_unit=s.task_unit[perm],
        step_offsets=offsets, step_q=s.step_q[step_idx], step_rank=s.step_rank[step_idx],
        step_wave=None, step_time=None, meta=meta,
    )
    if validate:
        lowered.validate()
    return lowered


#: How the backward kernel runs a queue schedule (fa3, spt, descending, lpt): "dynamic" (the
#: default), CTAs claim its tasks in queue order as they free up, as the schedules define it
#: (csrc/kernels/bwd/bwd_tasks.h); "static", the lowering above fixes each CTA's list ahead
#: of the launch. Static schedules (shift, symmetric_shift) and packed documents are static
#: either way. DASH_FA3_BWD_DISPATCH sets it at import.
KERNEL_DISPATCHES = ("dynamic", "static")
KERNEL_DISPATCH = os.environ.get("DASH_FA3_BWD_DISPATCH", "dynamic")
if KERNEL_DISPATCH not in KERNEL_DISPATCHES:
    raise ValueError(f"DASH_FA3_BWD_DISPATCH must be one of {KERNEL_DISPATCHES}, got {KERNEL_DISPATCH!r}")


@lru_cache(maxsize=1024)
def _kernel_metadata_cached(name: str, geometry: Geometry, num_sms: int, dispatch: str) -> M.ScheduleMeta:
    if dispatch == "static" and is_queue(name):
        return lower_to_static(get_schedule(name, geometry, num_sms)).meta
    # From the rows alone, checked on what the kernel decodes: time and memory grow with the steps
    # of one head, not of the whole call (build_schedule's full check held 12 GB and took a minute
    # at 128k tokens and 32 heads).
    meta = with_dkv_order(build_metadata(name, geometry, num_sms), geometry, num_sms)
    check_metadata(meta, geometry, num_sms)
    return meta


def get_kernel_metadata(name: str, geometry: Geometry, num_sms: int, dispatch: str | None = None) -> M.ScheduleMeta:
    """The validated metadata the backward kernel runs; cached by shape. ``dispatch``
    (default :data:`KERNEL_DISPATCH`): how a queue schedule is run. ``name`` is concrete:
    :func:`.policy.get_kernel_metadata` resolves ``auto`` first."""
    num_sms = _check_num_sms(num_sms)
    dispatch = dispatch or KERNEL_DISPATCH
    if dispatch not in KERNEL_DISPATCHES:
        raise ValueError(f"dispatch must be one of {KERNEL_DISPATCHES}, got {dispatch!r}")
    name = _concrete(name)
    # a static schedule runs its own CTA lists whatever the dispatch: one cache entry
    return _kernel_metadata_cached(name, geometry, num_sms, dispatch if is_queue(name) else "static")
