"""``grouped_*``: deterministic schedules whose tasks are whole GQA groups.

Why. Under GQA a task per (query head, KV tile) carries its fp32 dK and dV out
of the kernel, 2 x block_n x d x 4 bytes, and where queries are few that
epilogue takes as long as the task's steps (``groups``, docs/journal/rect-bwd.md
run 11). ``groups`` runs a group's heads at a KV tile as one chain on one CTA,
but its dQ order is ``fa3``'s: every chain of a KV head reaches a query head's
Q tiles at the same time and waits there.

The grouped view. A KV head stands for its group, and the group's Q tiles form
one range of ``n_q * group`` *virtual* tiles, interleaved: tile v is Q tile
v // group of the group's query head v % group (:attr:`.Geometry.q_interleave`).
A KV tile meets virtual tile v exactly when it meets Q tile v // group, so
under a full or causal mask each KV tile meets a contiguous range of virtual
tiles, and the view is an MHA problem with heads_kv heads: every schedule and
its rank rule applies unchanged. ``grouped_<base>`` is schedule ``<base>``
built on that view. A task is then a KV tile of a whole group: K and V load
once, dK/dV stay in registers over all the group's Q tiles and leave once, in
16 bits (header ``dkv_chained`` = WHOLE), and the dQ adds follow ``<base>``'s
order over the virtual tiles, so concurrent tasks of a KV head reach distinct
dQ tiles as they do in an MHA problem.

The kernel's metadata (:func:`.metadata.from_grouped_view`) names each row by
its group's first query head, and header ``group_interleave_log2`` tells the
kernel to read a step's tile v as (query head + v % group, Q tile v // group)
where it loads Q, dO and their statistics, masks, and adds dQ. The checks read
it back as the view (:func:`.metadata.grouped_view`). Groups must be powers of
two (the kernel splits v with a shift and a mask); MHA has groups of one, and
``grouped_<base>`` is ``<base>`` there.
"""

from __future__ import annotations

from . import metadata as M
from .contract import SCHEDULES
from .geometry import Geometry
from .schedules import (APPLIES, EXTRA_BUILDERS, EXTRA_QUEUES, Schedule, build_metadata as _build_metadata,
                        build_schedule, is_queue)

PREFIX = "grouped_"
#: The schedules with a grouped form.
BASES = ("sections", "shift", "split")


def base_of(name: str) -> str:
    """``<base>`` of ``grouped_<base>``."""
    if not name.startswith(PREFIX) or name[len(PREFIX):] not in BASES:
        raise ValueError(f"{name!r} is not a grouped schedule (one of {[PREFIX + b for b in BASES]})")
    return name[len(PREFIX):]


def applies(g: Geometry) -> bool:
    """Whether ``g`` has a grouped view: its group (1 under MHA) is a power of two."""
    return g.group & (g.group - 1) == 0


def view(g: Geometry) -> Geometry:
    """The grouped view of ``g`` (``g`` itself under MHA); ValueError for a group that is not a power of two."""
    if g.q_interleave > 1:
        raise ValueError("a grouped schedule is built for the call's geometry, not for a grouped view")
    return g.grouped() if g.group > 1 else g


def build_metadata(name: str, g: Geometry, num_sms: int) -> M.ScheduleMeta:
    """The kernel's input of ``grouped_<base>`` from its rows alone (unvalidated)."""
    meta = _build_metadata(base_of(name), view(g), num_sms)
    return M.from_grouped_view(meta, g, SCHEDULES.index(name))


def build(name: str, g: Geometry, num_sms: int) -> Schedule:
    """``grouped_<base>``: ``<base>`` built and validated on the grouped view; the schedule's
    geometry, tasks and steps are the view's, its metadata the kernel's."""
    s = build_schedule(base_of(name), view(g), num_sms, validate=False)
    return Schedule(name=name, geometry=s.geometry, num_sms=s.num_sms, dispatch=s.dispatch, num_ctas=s.num_ctas,
                    task_batch=s.task_batch, task_head=s.task_head, task_kv=s.task_kv, task_cta=s.task_cta,
                    task_unit=s.task_unit, step_offsets=s.step_offsets, step_q=s.step_q, step_rank=s.step_rank,
                    step_wave=s.step_wave, step_time=s.step_time,
                    meta=M.from_grouped_view(s.meta, g, SCHEDULES.index(name)))


for _base in BASES:
    EXTRA_BUILDERS[PREFIX + _base] = (build, build_metadata)
    APPLIES[PREFIX + _base] = applies
    if is_queue(_base):
        EXTRA_QUEUES.add(PREFIX + _base)
