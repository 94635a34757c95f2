"""The kernel's input: compact per-task metadata, and the Python form of the
integer arithmetic that turns it back into visiting orders and ranks.

The layout (header fields, task columns, codes) is :mod:`.contract`, which the
build also turns into the C++ header the kernels include.  The decode is
written twice, once per language, and compared on every bench-grid schedule
by ``tests/test_contract_cpp.py``: :func:`decode_all` here (vectorized; the
validation runs it on every schedule it accepts) and ``decode_step`` in
``csrc/schedules/schedule_metadata.h`` (C++, host and device).  Every ``/``
and ``%`` has non-negative operands, so C's truncating division gives the same
result as Python's floor division.

``as_int32_array()`` returns one flat int32 buffer::

    [ header (HEADER_LEN) | cta_offsets (header[H_OFFSETS_LEN]) | tasks (num_tasks * NUM_COLS) ]

Step ``s`` of a row (0 <= s < n_steps) visits Q tile::

    q = cyc_base + (cyc_off + s) % cyc_len          if s < cyc_len
    q = lin_base + lin_dir * (s - cyc_len)          otherwise

and its contribution to dQ tile (batch, head, q) has the rank given by the
header's rank kind (ASC: kv - kv_begin(q); DESC: kv_end(q) - 1 - kv; SHIFT: the
planned-time order of the static schedules, see :func:`decode_all`), where dQ tile q
receives contributions from KV tiles [kv_begin(q), kv_end(q)) (``TileGeometry.kv_range``);
RUN: kv - max(kv_begin(q), split_begin), ascending within the row's piece (:mod:`.runs`).  The dQ writer waits
until ``sem[batch, head, q] == rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .contract import (C_BATCH, C_CTA, C_CYC_BASE, C_CYC_LEN, C_CYC_OFF, C_HEAD, C_HEAD_KV, C_KV,  # noqa: F401
                       C_LIN_BASE, C_LIN_DIR, C_N_STEPS, C_ROLE, C_SEG_BEGIN, C_SEG_END, C_UNIT,
                       COLUMNS, DISPATCH_DYNAMIC, DISPATCH_STATIC, H_BATCH, H_BLOCK_M, H_BLOCK_N, H_MASK,
                       H_DISPATCH, H_HEADS, H_HEADS_KV, H_MAGIC, H_N_KV, H_N_Q, H_NUM_COLS, H_NUM_CTAS,
                       H_NUM_STEPS, H_NUM_TASKS, H_OFFSETS_LEN, H_PAIRS_HI, H_RANK_KIND, H_RECT_BEGIN,
                       H_CYC_STRIDE_LOG2, H_SCHEDULE, H_SEQLEN_K, H_SEQLEN_Q, H_UNITS_PER_HEAD, H_VERSION, H_WINDOW_LEFT,
                       H_WINDOW_RIGHT,
                       HEADER_FIELDS, HEADER_LEN, MAGIC, MASK_CAUSAL, MASK_CODES, MASK_FULL, MASK_LOCAL,
                       METADATA_VERSION, NUM_COLS, RANK_ASC, RANK_DESC,
                       RANK_SHIFT, RANK_SPLIT, RANK_RUN, ROLE_HI, ROLE_LO, C_SPLIT, C_SPLIT_BEGIN, C_RECT, H_NUM_SPLITS,
                       H_DKV_ORDERED, H_DKV_CHAINED, H_HEAD_SECTION, C_CHAIN_BEFORE, C_CHAIN_AFTER,
                       DKV_UNCHAINED, DKV_CHAINED_ADD, DKV_CHAINED_WHOLE, H_GROUP_INTERLEAVE_LOG2)
from .geometry import TileGeometry


def tile_geometry_of(header) -> TileGeometry:
    """The block geometry a schedule header describes (C++: ``tile_geometry_of``)."""
    return TileGeometry(int(header[H_SEQLEN_Q]), int(header[H_SEQLEN_K]), int(header[H_BLOCK_M]),
                        int(header[H_BLOCK_N]), int(header[H_WINDOW_LEFT]), int(header[H_WINDOW_RIGHT]))


def planned_unit(hidx, p, units: int, section: int = 0, num_heads: int = 0):
    """The place in the launch order of unit p of head index hidx in a static shift schedule.
    Section 0: head by head, u = hidx * units + p. Section s > 0 (header ``head_section``): the
    num_heads heads in sections of s (the last may be smaller); a section's units come unit by unit,
    its heads side by side, so that S CTAs hold about S / s units of each of its heads at once."""
    if section <= 0:
        return hidx * units + p
    first = (hidx // section) * section           # the section's first head
    size = np.minimum(section, num_heads - first)  # heads in the section
    return first * units + p * size + (hidx - first)


def planned_wave(hidx, p, units: int, num_sms: int, section: int = 0, num_heads: int = 0):
    """The wave of unit p of head index hidx in a static shift schedule: unit u
    (:func:`planned_unit`) runs on CTA u % S in wave u // S. With the step's time within its unit
    (:func:`planned_t0` + step) it is the planned time those schedules rank dQ adds by (the SHIFT
    and SPLIT rank kinds), and the potential :func:`.validate.check_metadata` certifies deadlock
    freedom with."""
    return planned_unit(hidx, p, units, section, num_heads) // num_sms


def planned_t0(g, role, p):
    """Planned time of a row's first step within its unit: a hi tile runs after its lo tile p."""
    return np.where(role == 1, g.task_len[p], 0)


def _decode(header, col, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, rank) of each step ``step[i]``; ``col(c)`` gives column c of each step's task row (int64
    arrays; a function, so that only the columns a rank rule reads are gathered per step).

    Every branch is evaluated for every element and the results selected, so
    the divisors of branches an element does not take are made safe first.
    """
    tiles = tile_geometry_of(header)
    # ---- which Q tile (grouped rows: a virtual tile of the group, whose KV range is its Q tile's)
    lg = int(header[H_GROUP_INTERLEAVE_LOG2])
    cyc_len = col(C_CYC_LEN)
    safe_len = np.where(cyc_len > 0, cyc_len, 1)
    q = np.where(step < cyc_len, col(C_CYC_BASE) + (col(C_CYC_OFF) + step) % safe_len,
                 col(C_LIN_BASE) + col(C_LIN_DIR) * (step - cyc_len))
    kv = col(C_KV)
    # ---- dQ tile q receives contributions from KV tiles [kv_begin, kv_end)
    kv_begin, kv_end = (np.broadcast_to(x, q.shape) for x in tiles.kv_range(q >> lg))
    # ---- rank in the accumulation order of dQ tile q
    kind = int(header[H_RANK_KIND])
    if kind == RANK_ASC:
        return q, kv - kv_begin
    if kind == RANK_DESC:
        return q, kv_end - 1 - kv
    if kind == RANK_RUN:  # ascending within the task's piece, which starts at its split_begin
        return q, kv - np.maximum(kv_begin, col(C_SPLIT_BEGIN))
    # RANK_SHIFT: units (KV tile p, optionally paired with hi tile n_kv-1-p) run in
    # waves; units [seg_begin, seg_end) of this head share this task's wave.
    # RANK_SPLIT: the same rule within the task's dQ split, which has a rectangle of
    # its own (the row's rect) and counts only its own KV tiles, from split_begin
    # (its segment is the wave's units that belong to the split).
    n_kv = tiles.n_kv
    pa = col(C_SEG_BEGIN)
    pb = col(C_SEG_END)
    seg = pb - pa
    pairs_hi = int(header[H_PAIRS_HI])
    split = kind == RANK_SPLIT
    rect = col(C_RECT) if split else int(header[H_RECT_BEGIN])
    width = np.maximum((tiles.n_q << lg) - rect, 1)  # rect == n_q: no rectangle, its branch is never taken

    def units_before(x):
        # contributions to q from units [0, x): lo tiles kv_begin <= p < kv_end, and hi
        # tiles n_kv-1-p (p < min(x, pairs_hi)) below kv_end.
        lo = np.minimum(kv_end, x)
        lo = np.where(kv_begin > 0, np.maximum(0, lo - kv_begin), lo)
        return lo + np.maximum(0, kv_end - n_kv + np.minimum(x, pairs_hi))

    # contributions to q of earlier waves (of the split's units, with splits)
    base = units_before(pa) - (units_before(col(C_SPLIT_BEGIN)) if split else 0)
    # hi tile: after every lo tile of the segment; hi tiles ascending
    local_hi = seg + kv - (n_kv - np.minimum(pb, pairs_hi))
    # above the rectangle: lo tiles in descending order
    local_up = np.minimum(kv_end, pb) - 1 - kv
    # cyclic leg over the rectangle: order by step, ties by segment slot. Slot j
    # reaches rectangle tile qq at step (qq - k j) mod width (k = 2^cyc_stride_log2;
    # k > 1 only where a segment has at most width / k slots, so reps = 0 then):
    # lt counts the slots that reach it before this step, unwrapped and wrapped.
    # (C++ shifts by the log2: no division by a run-time value in the dQ writer.)
    sh = int(header[H_CYC_STRIDE_LOG2])
    k = 1 << sh
    qq = q - rect
    slot = kv - pa
    reps = seg // width
    rem = seg % width
    lt = (np.maximum(0, np.minimum((qq >> sh) + 1, rem) - (np.maximum(qq - step + k, 0) >> sh))
          + np.maximum(0, rem - (((width + qq - step) >> sh) + 1)))
    local_cyc = step * reps + lt + np.maximum(slot, 0) // width
    local = np.where(col(C_ROLE) == ROLE_HI, local_hi, np.where(q < rect, local_up, local_cyc))
    return q, base + local


def decode_step(header, row, step: int) -> tuple[int, int]:
    """(q_tile, rank) of step ``step`` of task ``row`` (Python ints)."""
    T = np.asarray(row, dtype=np.int64).reshape(1, NUM_COLS)
    q, rank = _decode(header, lambda c: T[:, c], np.array([step], dtype=np.int64))
    return int(q[0]), int(rank[0])


def decode_all(header: np.ndarray, tasks: np.ndarray):
    """Every step of every row: (row, step, q, rank) int64 arrays in row-major step order."""
    t = np.asarray(tasks, dtype=np.int64).reshape(-1, NUM_COLS)
    n_steps = t[:, C_N_STEPS]
    total = int(n_steps.sum())
    row = np.repeat(np.arange(t.shape[0], dtype=np.int64), n_steps)
    starts = np.cumsum(n_steps) - n_steps
    step = np.arange(total, dtype=np.int64) - starts[row]
    q, rank = _decode(header, lambda c: t[:, c][row], step)
    return row, step, q, rank


def buffer_len(header) -> int:
    """Entries of the flat buffer that starts with ``header`` (C++: ``buffer_len``)."""
    return HEADER_LEN + int(header[H_OFFSETS_LEN]) + int(header[H_NUM_TASKS]) * int(header[H_NUM_COLS])


@dataclass(frozen=True, eq=False)
class ScheduleMeta:
    """Header, CTA offsets and task table of one schedule (all int32, read-only)."""

    header: np.ndarray
    offsets: np.ndarray
    tasks: np.ndarray

    def __post_init__(self):
        for a in (self.header, self.offsets, self.tasks):
            a.setflags(write=False)

    # ---------------------------------------------------------------- export
    def as_int32_array(self) -> np.ndarray:
        """One flat int32 buffer: header | cta_offsets | tasks (row-major)."""
        return np.concatenate([self.header, self.offsets, self.tasks.reshape(-1)]).astype(np.int32)

    def to_numpy(self) -> dict[str, np.ndarray]:
        return {"header": self.header, "cta_offsets": self.offsets, "tasks": self.tasks}

    @classmethod
    def from_int32_array(cls, flat: np.ndarray) -> "ScheduleMeta":
        flat = np.asarray(flat, dtype=np.int32)
        header = flat[:HEADER_LEN].copy()
        if int(header[H_MAGIC]) != MAGIC or int(header[H_VERSION]) != METADATA_VERSION:
            raise ValueError("not a dash_fa3 schedule buffer (bad magic/version)")
        n_off = int(header[H_OFFSETS_LEN])
        ncols = int(header[H_NUM_COLS])
        ntasks = int(header[H_NUM_TASKS])
        offsets = flat[HEADER_LEN:HEADER_LEN + n_off].copy()
        tasks = flat[HEADER_LEN + n_off:HEADER_LEN + n_off + ntasks * ncols].reshape(ntasks, ncols).copy()
        return cls(header, offsets, tasks)

    # ------------------------------------------------------------ accessors
    def field(self, name: str) -> int:
        return int(self.header[HEADER_FIELDS.index(name)])

    @property
    def num_tasks(self) -> int:
        return int(self.header[H_NUM_TASKS])

    @property
    def dynamic(self) -> bool:
        return int(self.header[H_DISPATCH]) == DISPATCH_DYNAMIC

    @property
    def nbytes(self) -> int:
        return 4 * (self.header.size + self.offsets.size + self.tasks.size)

    def decode_step(self, row: int, step: int) -> tuple[int, int]:
        return decode_step(self.header.tolist(), self.tasks[row].tolist(), step)

    def decode_all(self):
        return decode_all(self.header, self.tasks)

    def cta_rows(self, cta: int) -> range:
        """Rows a static CTA runs, in order."""
        if self.dynamic:
            raise ValueError("dynamic schedules have no static CTA rows; CTAs claim rows in order")
        return range(int(self.offsets[cta]), int(self.offsets[cta + 1]))

    def header_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in zip(HEADER_FIELDS, self.header)}


def grouped_view(meta: ScheduleMeta, g):
    """``(meta, g)`` as the rank rules and the checks read them: for a grouped schedule (header
    ``group_interleave_log2`` > 0, :mod:`.grouped`), the table of its grouped view (one head per
    KV head, each row an MHA task over its group's Q tiles, unchained) and that view's geometry
    (:meth:`.Geometry.grouped`); otherwise both unchanged. ``g`` may be the call's geometry or
    already the grouped view. Raises ValueError where the header and ``g`` disagree."""
    lg = int(meta.header[H_GROUP_INTERLEAVE_LOG2])
    if lg == 0:
        if g.q_interleave > 1:
            raise ValueError("a grouped geometry with metadata that is not grouped (group_interleave_log2 = 0)")
        return meta, g
    gv = g.grouped()
    if lg < 0 or (1 << lg) != gv.q_interleave:
        raise ValueError(f"metadata group_interleave_log2 = {lg}, but the call's group is {gv.q_interleave}")
    header, tasks = meta.header.copy(), meta.tasks.copy()
    if int(header[H_DKV_CHAINED]) != DKV_CHAINED_WHOLE or int(header[H_DKV_ORDERED]) != 0:
        raise ValueError("a grouped schedule's rows are whole groups: header dkv_chained must be WHOLE, "
                         "dkv_ordered 0")
    if np.any(tasks[:, C_CHAIN_BEFORE] != 0) or np.any(tasks[:, C_CHAIN_AFTER] != 0):
        raise ValueError("a grouped schedule's rows are not chained")
    if np.any(tasks[:, C_HEAD].astype(np.int64) != tasks[:, C_HEAD_KV].astype(np.int64) << lg):
        raise ValueError("a grouped row's head must be its group's first query head (head_kv * group)")
    header[H_HEADS] = header[H_HEADS_KV]
    header[H_DKV_CHAINED] = DKV_UNCHAINED
    tasks[:, C_HEAD] = tasks[:, C_HEAD_KV]
    return ScheduleMeta(header, meta.offsets.copy(), tasks), gv


def from_grouped_view(meta: ScheduleMeta, g, schedule: int) -> ScheduleMeta:
    """The kernel's metadata of a schedule built on the grouped view of ``g`` (``meta``, whose header
    has ``group_interleave_log2``): header ``schedule`` (an index into SCHEDULES), the call's heads,
    rows named by their group's first query head, and, under GQA, ``dkv_chained`` = WHOLE (each row
    holds its whole group's dK/dV and stores them in 16 bits)."""
    header, tasks = meta.header.copy(), meta.tasks.copy()
    lg = int(header[H_GROUP_INTERLEAVE_LOG2])
    if (1 << lg) != g.group or g.q_interleave != 1:
        raise ValueError(f"metadata of a grouped view of {1 << lg} query heads per KV head for a call with "
                         f"{g.heads} / {g.heads_kv}")
    header[H_SCHEDULE] = schedule
    header[H_HEADS], header[H_HEADS_KV] = g.heads, g.heads_kv
    header[H_DKV_CHAINED] = DKV_CHAINED_WHOLE if lg > 0 else DKV_UNCHAINED
    tasks[:, C_HEAD] = tasks[:, C_HEAD_KV].astype(np.int64) << lg
    return ScheduleMeta(header, meta.offsets.copy(), tasks)


def restrict_heads(meta: ScheduleMeta, kv_lo: int, kv_hi: int) -> ScheduleMeta:
    """The metadata of a call that holds only KV heads [kv_lo, kv_hi) (and their query heads) of
    the problem ``meta`` was built for: those heads' rows, renumbered from 0, in the same order.

    Every kept step decodes to the same (Q tile, rank) as in ``meta`` (the rank rules read the row
    and the per-head tile geometry only), so each head gets the dQ add order it has in the whole
    call; this is what lets head-parallel context parallelism reproduce the shift orders, which
    place a head's units by its index. Safe: a head's dQ tiles wait only on its own rows, a
    group's dK/dV turns (header dkv_ordered) only on its KV head's rows, which are kept or dropped
    together, and the kept rows keep their order on every CTA (static) or in the queue (dynamic),
    so the wait-for graph is a subgraph of the validated one."""
    h = meta.header.copy()
    heads, heads_kv = int(h[H_HEADS]), int(h[H_HEADS_KV])
    if not 0 <= kv_lo < kv_hi <= heads_kv:
        raise ValueError(f"KV heads [{kv_lo}, {kv_hi}) are not within the schedule's {heads_kv}")
    group = heads // heads_kv
    keep = (meta.tasks[:, C_HEAD_KV] >= kv_lo) & (meta.tasks[:, C_HEAD_KV] < kv_hi)
    tasks = meta.tasks[keep].copy()
    tasks[:, C_HEAD] -= kv_lo * group
    tasks[:, C_HEAD_KV] -= kv_lo
    h[H_HEADS], h[H_HEADS_KV] = (kv_hi - kv_lo) * group, kv_hi - kv_lo
    h[H_NUM_TASKS] = tasks.shape[0]
    h[H_NUM_STEPS] = int(tasks[:, C_N_STEPS].astype(np.int64).sum())
    offsets = meta.offsets
    if int(h[H_DISPATCH]) == DISPATCH_STATIC:
        # per CTA, its kept rows; CTAs left without rows are dropped (the others renumbered)
        kept_before = np.concatenate([[0], np.cumsum(keep)])
        bounds = kept_before[meta.offsets.astype(np.int64)]
        busy = np.flatnonzero(np.diff(bounds) > 0)
        tasks[:, C_CTA] = np.searchsorted(busy, tasks[:, C_CTA])
        offsets = np.concatenate([[0], np.cumsum(np.diff(bounds)[busy])]).astype(np.int32)
        h[H_NUM_CTAS] = busy.size
        h[H_OFFSETS_LEN] = busy.size + 1
    else:
        h[H_NUM_CTAS] = min(int(h[H_NUM_CTAS]), tasks.shape[0])
    return ScheduleMeta(h, offsets.copy(), tasks)
