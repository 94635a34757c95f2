"""The kernel's input: compact per-task metadata, and the one definition of the
integer arithmetic that turns it back into visiting orders and ranks.

This module is the contract with the CUDA backward.  ``decode_step`` below is
the specification; the device code must mirror it operation for operation
(every ``/`` and ``%`` here has non-negative operands, so C's truncating
division gives the same result as Python's floor division).

Layout
------
``as_int32_array()`` returns one flat int32 buffer::

    [ header (HEADER_LEN) | cta_offsets (header[OFFSETS_LEN]) | tasks (num_tasks * NUM_COLS) ]

Header (int32, ``HEADER_LEN`` = 24 entries), by index::

     0 magic          0x44415348 ('DASH')
     1 version        METADATA_VERSION
     2 schedule       index into SCHEDULES (fa3, spt, descending, shift, symmetric_shift, lpt)
     3 dispatch       0 = static (CTA i runs rows [offsets[i], offsets[i+1])),
                      1 = dynamic (CTAs claim rows in order from an atomic counter)
     4 rank_kind      0 = ASC, 1 = DESC, 2 = SHIFT (see decode_step)
     5 num_ctas       persistent CTAs to launch (<= SM count)
     6 num_tasks      rows in the task table
     7 num_cols       NUM_COLS
     8 batch          9 heads       10 heads_kv
    11 seqlen_q      12 seqlen_k    13 block_m    14 block_n
    15 causal         0/1 (bottom-right aligned)
    16 n_q           17 n_kv
    18 rect_begin     R: first Q tile of the dense rectangle (SHIFT kind)
    19 units_per_head CTA units (pairs) per head (SHIFT kind; n_kv otherwise)
    20 pairs_hi       units that carry a second ("hi") KV tile (SHIFT kind)
    21 num_steps      total (task, step) pairs
    22 offsets_len    num_ctas + 1 (static) or 0 (dynamic)
    23 reserved       0

Task table (int32, ``NUM_COLS`` = 16 columns), one row per task, rows in
CTA-claim order (dynamic) or grouped by CTA (static)::

     0 batch        1 head (q head)   2 kv_tile     3 n_steps
     4 cyc_len      5 cyc_base        6 cyc_off     7 lin_base     8 lin_dir (+1/-1)
     9 role (0 = lo/single tile of its unit, 1 = hi tile)
    10 seg_begin   11 seg_end    units [seg_begin, seg_end) of this head run in the
                                 same wave as this task (SHIFT kind)
    12 rank_dkv    position of this q head in the fixed order in which the q heads
                   of a GQA group add into dK/dV of (batch, head_kv, kv_tile)
    13 head_kv     14 cta (static: the CTA that runs the row; dynamic: -1)
    15 unit        the unit (pair) index within the head (informational)

Step ``s`` of a row (0 <= s < n_steps) visits Q tile::

    q = cyc_base + (cyc_off + s) % cyc_len          if s < cyc_len
    q = lin_base + lin_dir * (s - cyc_len)          otherwise

and its contribution to dQ tile (batch, head, q) has the rank given by
``decode_step``.  The dQ writer waits until ``sem[batch, head, q] == rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x44415348
METADATA_VERSION = 1
HEADER_LEN = 24
NUM_COLS = 16

# header indices
H_MAGIC, H_VERSION, H_SCHEDULE, H_DISPATCH, H_RANK_KIND, H_NUM_CTAS, H_NUM_TASKS, H_NUM_COLS = range(8)
H_BATCH, H_HEADS, H_HEADS_KV, H_SEQLEN_Q, H_SEQLEN_K, H_BLOCK_M, H_BLOCK_N, H_CAUSAL = range(8, 16)
H_N_Q, H_N_KV, H_RECT_BEGIN, H_UNITS_PER_HEAD, H_PAIRS_HI, H_NUM_STEPS, H_OFFSETS_LEN, H_RESERVED = range(16, 24)
HEADER_FIELDS = (
    "magic", "version", "schedule", "dispatch", "rank_kind", "num_ctas", "num_tasks", "num_cols",
    "batch", "heads", "heads_kv", "seqlen_q", "seqlen_k", "block_m", "block_n", "causal",
    "n_q", "n_kv", "rect_begin", "units_per_head", "pairs_hi", "num_steps", "offsets_len", "reserved",
)

# task-table columns
(C_BATCH, C_HEAD, C_KV, C_N_STEPS, C_CYC_LEN, C_CYC_BASE, C_CYC_OFF, C_LIN_BASE, C_LIN_DIR,
 C_ROLE, C_SEG_BEGIN, C_SEG_END, C_RANK_DKV, C_HEAD_KV, C_CTA, C_UNIT) = range(NUM_COLS)
COLUMNS = ("batch", "head", "kv_tile", "n_steps", "cyc_len", "cyc_base", "cyc_off", "lin_base",
           "lin_dir", "role", "seg_begin", "seg_end", "rank_dkv", "head_kv", "cta", "unit")

DISPATCH_STATIC, DISPATCH_DYNAMIC = 0, 1
RANK_ASC, RANK_DESC, RANK_SHIFT = 0, 1, 2
ROLE_LO, ROLE_HI = 0, 1


def decode_step(header, row, step: int) -> tuple[int, int]:
    """(q_tile, rank) of step ``step`` of task ``row``.

    THE specification of the device arithmetic: integer ops only, every ``/``
    and ``%`` on non-negative operands.  The CUDA side must mirror it.
    ``header`` and ``row`` are int sequences laid out as documented above.
    """
    # ---- which Q tile
    cyc_len = row[C_CYC_LEN]
    if step < cyc_len:
        q = row[C_CYC_BASE] + (row[C_CYC_OFF] + step) % cyc_len
    else:
        q = row[C_LIN_BASE] + row[C_LIN_DIR] * (step - cyc_len)
    kv = row[C_KV]
    # ---- kv_end(q): dQ tile q receives contributions from KV tiles [0, kv_end)
    n_kv = header[H_N_KV]
    if header[H_CAUSAL]:
        last_row = min((q + 1) * header[H_BLOCK_M], header[H_SEQLEN_Q]) - 1
        reach = last_row + header[H_SEQLEN_K] - header[H_SEQLEN_Q]
        kv_end = 0 if reach < 0 else min(n_kv, reach // header[H_BLOCK_N] + 1)
    else:
        kv_end = n_kv
    # ---- rank in the accumulation order of dQ tile q
    kind = header[H_RANK_KIND]
    if kind == RANK_ASC:
        return q, kv
    if kind == RANK_DESC:
        return q, kv_end - 1 - kv
    # RANK_SHIFT: units (KV tile p, optionally paired with hi tile n_kv-1-p) run in
    # waves; units [seg_begin, seg_end) of this head share this task's wave.
    pa = row[C_SEG_BEGIN]
    pb = row[C_SEG_END]
    seg = pb - pa
    pairs_hi = header[H_PAIRS_HI]
    rect = header[H_RECT_BEGIN]
    # contributions to q from units [0, pa) (earlier waves): lo tiles p < kv_end,
    # and hi tiles n_kv-1-p (p < min(pa, pairs_hi)) below kv_end.
    base = min(kv_end, pa) + max(0, kv_end - n_kv + min(pa, pairs_hi))
    if row[C_ROLE] == ROLE_HI:
        # after every lo tile of the segment; hi tiles ascending
        local = seg + kv - (n_kv - min(pb, pairs_hi))
    elif q < rect:
        # above the rectangle: lo tiles in descending order
        local = min(kv_end, pb) - 1 - kv
    else:
        # cyclic leg over the rectangle: order by step, ties by segment slot
        width = header[H_N_Q] - rect
        qq = q - rect
        slot = kv - pa
        reps = seg // width
        rem = seg % width
        lt = (max(0, min(qq + 1, rem) - max(qq - step + 1, 0))
              + max(0, rem - (width + qq - step + 1)))
        local = step * reps + lt + slot // width
    return q, base + local


def decode_all(header: np.ndarray, tasks: np.ndarray):
    """Vectorized mirror of :func:`decode_step` over every step of every row.

    Returns (row, step, q, rank) int64 arrays in row-major step order.
    """
    h = [int(x) for x in header]
    t = np.asarray(tasks, dtype=np.int64)
    n_steps = t[:, C_N_STEPS]
    total = int(n_steps.sum())
    row = np.repeat(np.arange(t.shape[0], dtype=np.int64), n_steps)
    starts = np.cumsum(n_steps) - n_steps
    step = np.arange(total, dtype=np.int64) - starts[row]
    T = t[row]
    cyc_len = T[:, C_CYC_LEN]
    in_cyc = step < cyc_len
    safe_len = np.where(cyc_len > 0, cyc_len, 1)
    q = np.where(in_cyc, T[:, C_CYC_BASE] + (T[:, C_CYC_OFF] + step) % safe_len,
                 T[:, C_LIN_BASE] + T[:, C_LIN_DIR] * (step - cyc_len))
    kv = T[:, C_KV]
    n_kv = h[H_N_KV]
    if h[H_CAUSAL]:
        last_row = np.minimum((q + 1) * h[H_BLOCK_M], h[H_SEQLEN_Q]) - 1
        reach = last_row + h[H_SEQLEN_K] - h[H_SEQLEN_Q]
        kv_end = np.where(reach < 0, 0, np.minimum(n_kv, np.maximum(reach, 0) // h[H_BLOCK_N] + 1))
    else:
        kv_end = np.full_like(q, n_kv)
    kind = h[H_RANK_KIND]
    if kind == RANK_ASC:
        rank = kv.copy()
    elif kind == RANK_DESC:
        rank = kv_end - 1 - kv
    else:
        pa = T[:, C_SEG_BEGIN]
        pb = T[:, C_SEG_END]
        seg = pb - pa
        pairs_hi = h[H_PAIRS_HI]
        rect = h[H_RECT_BEGIN]
        width = h[H_N_Q] - rect
        base = np.minimum(kv_end, pa) + np.maximum(0, kv_end - n_kv + np.minimum(pa, pairs_hi))
        local_hi = seg + kv - (n_kv - np.minimum(pb, pairs_hi))
        local_up = np.minimum(kv_end, pb) - 1 - kv
        qq = q - rect
        slot = kv - pa
        reps = seg // width
        rem = seg % width
        lt = (np.maximum(0, np.minimum(qq + 1, rem) - np.maximum(qq - step + 1, 0))
              + np.maximum(0, rem - (width + qq - step + 1)))
        local_cyc = step * reps + lt + np.maximum(slot, 0) // width
        local = np.where(T[:, C_ROLE] == ROLE_HI, local_hi, np.where(q < rect, local_up, local_cyc))
        rank = base + local
    return row, step, q, rank


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
