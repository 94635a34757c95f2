"""The schedules: pure functions of (geometry, number of persistent CTAs).

A schedule fixes (a) which tasks each CTA runs and in what order, (b) the order
in which each task visits its Q tiles, (c) the rank of every (kv, q)
contribution in the accumulation order of dQ tile q.  GQA adds nothing: each q
head's task stores its own fp32 dK/dV partials and the postprocess sums a
group's heads in a fixed order, so no task waits for another over dK/dV.

The explicit orders (b) and (c) are built here from the schedule's *meaning*
(rotations, reversed ranges; ranks by sorting contributions on their planned
time).  The compact metadata the kernel reads (:mod:`.metadata`) is built next
to them, and validation checks that decoding the metadata with the device
arithmetic reproduces (b) and (c) exactly.

Dynamic schedules (``fa3``, ``spt``, ``descending``, ``lpt``): tasks sit in one
global queue; a CTA that becomes free claims the next row from an atomic counter.
Static schedules (``shift``, ``symmetric_shift``): *units* (one KV tile, or a
pair of KV tiles j and n-1-j) are dealt round-robin, unit u to CTA u % S in wave
u // S; CTA i runs its rows in order.
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from . import metadata as M
from .contract import MASK_CODES, SCHEDULES
from .geometry import Geometry, _cdiv, head_section
from .metadata import planned_t0, planned_wave
from .validate import validate as _validate

SCHEDULE_NAMES: tuple[str, ...] = SCHEDULES + ("auto",)
DYNAMIC_SCHEDULES = ("fa3", "spt", "descending", "lpt", "sections")
#: Queue schedules whose dQ adds run in descending kv order (RANK_DESC), their queues kv descending.
DESCENDING_RANK = ("spt", "sections")
STATIC_SCHEDULES = ("shift", "symmetric_shift")
#: Builders of schedules defined in their own module (:mod:`.split`), which registers
#: itself here on import (the package imports it): name -> (build, build_metadata).
EXTRA_BUILDERS: dict = {}
#: Registered with the builders: schedules defined for some calls only, with their test of a Geometry
#: (:mod:`.grouped`: power-of-two groups; :mod:`.groups`, :mod:`.runs`: chains), and those that are queues too.
APPLIES: dict = {}
EXTRA_QUEUES: set = set()


def is_queue(name: str) -> bool:
    """Whether schedule ``name`` is a queue that CTAs claim from (dynamic dispatch unless lowered)."""
    return name in DYNAMIC_SCHEDULES or name in EXTRA_QUEUES


def schedules_for(g: Geometry) -> tuple[str, ...]:
    """The concrete schedules defined for ``g`` (every one but those whose :data:`APPLIES` test fails)."""
    return tuple(n for n in SCHEDULES if n not in APPLIES or APPLIES[n](g))


def _concrete(name: str) -> str:
    """``name``, checked to be a concrete schedule (``auto`` resolves above the contract:
    :func:`.policy.resolve_schedule_name`)."""
    if name == "auto":
        raise ValueError("'auto' is resolved by dash_fa3.schedule.resolve_schedule_name before the contract's "
                         "entry points; the ones of dash_fa3.schedule accept it")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULE_NAMES}")
    return name


class Schedule:
    """A built schedule.  Arrays are read-only; identity is (name, geometry, num_sms).

    Task arrays are in task-table order (see :mod:`.metadata`); step arrays list
    every step of every task, task by task.
    """

    def __init__(self, *, name, geometry, num_sms, dispatch, num_ctas, task_batch, task_head,
                 task_kv, task_cta, task_unit, step_offsets, step_q, step_rank,
                 step_wave, step_time, meta):
        self.name = name
        self.geometry = geometry
        self.num_sms = num_sms
        self.dispatch = dispatch
        self.num_ctas = num_ctas
        self.task_batch = task_batch
        self.task_head = task_head
        self.task_kv = task_kv
        self.task_cta = task_cta
        self.task_unit = task_unit
        self.step_offsets = step_offsets
        self.step_q = step_q
        self.step_rank = step_rank
        self.step_wave = step_wave
        self.step_time = step_time
        self.meta = meta
        for v in vars(self).values():
            if isinstance(v, np.ndarray):
                v.setflags(write=False)
        self._validation = None
        self._cache = {}

    # identity
    @property
    def key(self):
        return (self.name, self.geometry, self.num_sms)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Schedule) and self.key == other.key

    def __repr__(self):
        return (f"Schedule({self.name!r}, {self.geometry.describe()}, sms={self.num_sms}, "
                f"{self.dispatch}, tasks={self.num_tasks}, steps={self.num_steps})")

    # sizes
    @property
    def dynamic(self) -> bool:
        return self.dispatch == "dynamic"

    @property
    def num_tasks(self) -> int:
        return int(self.task_kv.size)

    @property
    def num_steps(self) -> int:
        return int(self.step_q.size)

    @property
    def task_steps(self) -> np.ndarray:
        return np.diff(self.step_offsets)

    @property
    def step_task(self) -> np.ndarray:
        if "step_task" not in self._cache:
            a = np.repeat(np.arange(self.num_tasks, dtype=np.int64), self.task_steps)
            a.setflags(write=False)
            self._cache["step_task"] = a
        return self._cache["step_task"]

    @property
    def step_index(self) -> np.ndarray:
        """Step number within its task."""
        if "step_index" not in self._cache:
            a = np.arange(self.num_steps, dtype=np.int64) - self.step_offsets[self.step_task]
            a.setflags(write=False)
            self._cache["step_index"] = a
        return self._cache["step_index"]

    @property
    def task_head_index(self) -> np.ndarray:
        """batch * heads + head: which dQ tensor a task writes."""
        return self.task_batch * self.geometry.heads + self.task_head

    @property
    def num_splits(self) -> int:
        """dQ splits: fp32 accumulators, each with its own add order (1 but for ``split``)."""
        return int(self.meta.header[M.H_NUM_SPLITS])

    @property
    def task_split(self) -> np.ndarray:
        """The dQ split each task adds into (task-table order, as the other task arrays)."""
        return self.meta.tasks[:, M.C_SPLIT].astype(np.int64)

    @property
    def step_dq_tile(self) -> np.ndarray:
        """Global dQ tile id (split, batch, head, q) of each step."""
        if "step_dq" not in self._cache:
            hidx = self.task_head_index + self.task_split * self.geometry.num_heads_total
            a = hidx[self.step_task] * self.geometry.n_q + self.step_q
            a.setflags(write=False)
            self._cache["step_dq"] = a
        return self._cache["step_dq"]

    @property
    def step_predecessor(self) -> np.ndarray:
        """The step ranked just before each step in its dQ tile's order (-1: first)."""
        if "step_pred" not in self._cache:
            a = accumulation_predecessors(self.step_dq_tile, self.step_rank)
            a.setflags(write=False)
            self._cache["step_pred"] = a
        return self._cache["step_pred"]

    # the three things a schedule fixes
    def cta_tasks(self, cta: int) -> np.ndarray:
        """(a) task indices CTA ``cta`` runs, in order (static schedules only)."""
        if self.dynamic:
            raise ValueError(f"{self.name} is dispatched dynamically: CTAs claim tasks in queue order")
        return np.arange(int(self.meta.offsets[cta]), int(self.meta.offsets[cta + 1]))

    def visiting_order(self, task: int) -> np.ndarray:
        """(b) Q tiles task ``task`` visits, in order."""
        return self.step_q[self.step_offsets[task]:self.step_offsets[task + 1]]

    def ranks(self, task: int) -> np.ndarray:
        """(c) rank of each of the task's contributions in its dQ tile's order."""
        return self.step_rank[self.step_offsets[task]:self.step_offsets[task + 1]]

    def accumulation_order(self, batch: int, head: int, q: int) -> np.ndarray:
        """(c) KV tiles adding into dQ tile (batch, head, q), in rank order."""
        gid = (batch * self.geometry.heads + head) * self.geometry.n_q + q
        sel = np.flatnonzero(self.step_dq_tile == gid)
        kv = self.task_kv[self.step_task[sel]]
        return kv[np.argsort(self.step_rank[sel], kind="stable")]

    def find_task(self, batch: int, head: int, kv: int) -> int:
        hit = np.flatnonzero((self.task_batch == batch) & (self.task_head == head) & (self.task_kv == kv))
        if hit.size != 1:
            raise KeyError((batch, head, kv))
        return int(hit[0])

    def validate(self):
        """Run every check once (cached); raise ScheduleError if one fails."""
        if self._validation is None:
            self._validation = _validate(self)
        return self._validation


# ---------------------------------------------------------------- helpers
def _ranks_by_key(gid: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """Rank of each element within its gid group, ordered by keys (most significant first)."""
    order = np.lexsort(tuple(reversed(keys)) + (gid,))
    g_sorted = gid[order]
    n = gid.size
    pos = np.arange(n, dtype=np.int64)
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = g_sorted[1:] != g_sorted[:-1]
    group_start = np.maximum.accumulate(np.where(new_group, pos, 0))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = pos - group_start
    return rank


def accumulation_predecessors(dq_tile: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per step, the step whose contribution to the same dQ tile is ranked just
    before it (-1: the tile's first), from per-step dQ tile ids and ranks."""
    order = np.lexsort((rank, dq_tile))
    same = dq_tile[order][1:] == dq_tile[order][:-1]
    pred = np.full(dq_tile.size, -1, dtype=np.int64)
    pred[order[1:][same]] = order[:-1][same]
    return pred


def _header(name, geometry, num_ctas, num_tasks, dispatch, rank_kind, rect, units, pairs_hi,
            num_steps, offsets_len, cyc_stride_log2=0, num_splits=1, head_section=0) -> np.ndarray:
    g = geometry
    h = np.zeros(M.HEADER_LEN, dtype=np.int64)
    h[M.H_MAGIC] = M.MAGIC
    h[M.H_VERSION] = M.METADATA_VERSION
    h[M.H_SCHEDULE] = SCHEDULES.index(name)
    h[M.H_DISPATCH] = dispatch
    h[M.H_RANK_KIND] = rank_kind
    h[M.H_NUM_CTAS] = num_ctas
    h[M.H_NUM_TASKS] = num_tasks
    h[M.H_NUM_COLS] = M.NUM_COLS
    h[M.H_BATCH], h[M.H_HEADS], h[M.H_HEADS_KV] = g.batch, g.heads, g.heads_kv
    h[M.H_SEQLEN_Q], h[M.H_SEQLEN_K] = g.seqlen_q, g.seqlen_k
    h[M.H_BLOCK_M], h[M.H_BLOCK_N] = g.block_m, g.block_n
    h[M.H_MASK] = MASK_CODES[g.mask]
    h[M.H_WINDOW_LEFT], h[M.H_WINDOW_RIGHT] = g.window
    h[M.H_N_Q], h[M.H_N_KV] = g.n_q, g.n_kv
    h[M.H_RECT_BEGIN] = rect
    h[M.H_UNITS_PER_HEAD] = units
    h[M.H_PAIRS_HI] = pairs_hi
    h[M.H_NUM_STEPS] = num_steps
    h[M.H_OFFSETS_LEN] = offsets_len
    h[M.H_CYC_STRIDE_LOG2] = cyc_stride_log2
    h[M.H_NUM_SPLITS] = num_splits
    h[M.H_HEAD_SECTION] = head_section
    h[M.H_GROUP_INTERLEAVE_LOG2] = g.q_interleave.bit_length() - 1
    return _i32(h)


def _i32(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise OverflowError("schedule metadata does not fit in int32")
    return a.astype(np.int32)


def _check_num_sms(num_sms) -> int:
    if isinstance(num_sms, bool) or not isinstance(num_sms, (int, np.integer)) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive integer (the device's SM count), got {num_sms!r}")
    return int(num_sms)


# ---------------------------------------------------------------- dynamic
def greedy_assignment(task_cost: np.ndarray, num_ctas: int) -> np.ndarray:
    """CTA of each task when tasks, in order, go to the CTA that frees first
    (ties to the lowest index): how a queue is claimed under the cost model."""
    free = [(0, cta) for cta in range(num_ctas)]
    cta_of = np.empty(task_cost.size, dtype=np.int64)
    for t, cost in enumerate(task_cost.tolist()):
        when, cta = heapq.heappop(free)
        cta_of[t] = cta
        heapq.heappush(free, (when + cost, cta))
    return cta_of


def task_claim_cost(task_steps: np.ndarray) -> np.ndarray:
    """The cost :func:`greedy_assignment` gives each task of a queue (lowering, lpt
    sections, packed documents): its number of Q-tile steps; a task without steps
    (windows) still stores dK = dV = 0, so it costs one. (A fixed extra cost per
    task balanced no better: docs/journal/bwd-kernel.md.)"""
    return np.maximum(np.asarray(task_steps), 1)


def claim_loads(task_cost: np.ndarray, num_ctas: int) -> np.ndarray:
    """Total cost each CTA ends up with under :func:`greedy_assignment`."""
    return np.bincount(greedy_assignment(task_cost, num_ctas), weights=task_cost, minlength=num_ctas)


# Rows of Q plus K whose Q, dO, K and V fill about 24 MiB at head dim 128 in
# 16-bit: half of an H100's L2. An lpt section holds at most this many.
LPT_SECTION_ROWS = 49152


def lpt_order(g: Geometry, hidx: np.ndarray, kv: np.ndarray, num_sms: int) -> tuple[np.ndarray, int]:
    """The lpt queue: (permutation of the head-major tasks hidx, kv, heads per section).

    Sections of consecutive (batch, head) pairs run one after another; within a
    section, longest task first (ties: head, then kv). The section bounds the
    heads whose Q/dO are read at once: longest-first over ALL heads starts one
    KV tile of every head together, so each Q tile is read from HBM again by
    every KV tile, and many heads measured slower than the head-major spt
    order (docs/journal/auto-rule-history.md).
    The section size is the one, among powers of two and an equal split up to
    the L2 bound, whose queue the greedy claim model balances best (ties: the
    smaller section).

    "Longest" is by the suffix maximum of the task lengths over the KV tiles
    (non-increasing in kv): the lengths themselves under full and causal masks,
    and under a window, whose first tiles may be shorter than later ones, still
    an order in which a lower KV tile of a head is never claimed later, which
    the ascending dQ order needs.
    """
    lens = g.task_len[kv]
    key = np.maximum.accumulate(g.task_len[::-1])[::-1][kv]
    H = g.num_heads_total
    if key.size == 0 or key.min() == key.max():
        return np.arange(key.size), H  # every order is longest-first: keep head-major
    bound = max(1, min(H, LPT_SECTION_ROWS // (g.seqlen_q + g.seqlen_k)))
    sizes = {bound, _cdiv(H, _cdiv(H, bound))}
    sizes.update(1 << i for i in range(bound.bit_length()) if (1 << i) <= bound)
    num_ctas = max(1, min(num_sms, lens.size))
    best = None
    for sec in sorted(sizes):
        order = np.lexsort((kv, hidx, -key, hidx // sec))
        load = claim_loads(task_claim_cost(lens[order]), num_ctas)
        if best is None or load.max() < best[0]:
            best = (load.max(), order, sec)
    return best[1], best[2]


def _build_dynamic(name: str, g: Geometry, num_sms: int) -> Schedule:
    """fa3 / spt / descending / lpt: one global queue.

    fa3:        head-major queue, kv ascending, Q ascending, dQ adds in
                ascending kv order.
    spt:        head-major queue, kv descending (shortest task first under a
                causal mask), Q ascending, dQ adds in descending kv order.
    descending: fa3 with the Q loop reversed: queue kv ascending, Q descending,
                dQ adds in ascending kv order (the paper's "just reverse the
                loop"; see docs/design/schedule.md for why not descending kv).
    lpt:        longest task first within sections of heads (lpt_order),
                Q ascending, dQ adds in ascending kv order. Meant for the
                non-deterministic mode: claiming the long causal tasks first
                levels the CTAs' loads (head-major fa3 leaves each head's long
                tasks behind the previous head's short ones); on a full mask
                it is fa3. Valid deterministically too, with fa3's waits.
    sections:   spt's tasks and ranks, queued section by section
                (geometry.head_section: heads whose Q, dO and dQ accumulator fit
                the L2 budget), a section's tasks KV tile by KV tile (kv
                descending) with its heads side by side. Head-major, a head's
                KV tiles are claimed together and each Q tile takes their adds
                one after another; side by side, about num_ctas / section of
                a head's tiles run at once, one step apart on its Q tiles.
                It is the order of FA3's deterministic causal backward (its
                launch grid's L2 swizzle with SPT), whose full-mask backward
                runs head-major instead.
    The queue order always claims a contribution's rank predecessor earlier
    (lpt: a lower kv tile is never claimed later, see lpt_order).
    Every KV tile has a task; a tile no query sees (windows) gets one
    without steps, which stores its dK = dV = 0.
    """
    hidx, kv, meta = _dynamic_tasks(name, g, num_sms)
    T = kv.size
    batch, head = hidx // g.heads, hidx % g.heads
    lens = g.task_len[kv]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    N = int(offsets[-1])
    step_task = np.repeat(np.arange(T, dtype=np.int64), lens)
    s = np.arange(N, dtype=np.int64) - offsets[step_task]
    qb = g.q_begin[kv]
    qe = g.q_end[kv]
    q = qb[step_task] + s if name != "descending" else (qe[step_task] - 1) - s
    gid = hidx[step_task] * g.n_q + q
    skv = kv[step_task]
    rank = _ranks_by_key(gid, -skv if name in DESCENDING_RANK else skv)
    return Schedule(name=name, geometry=g, num_sms=num_sms, dispatch="dynamic", num_ctas=int(meta.header[M.H_NUM_CTAS]),
                    task_batch=batch, task_head=head, task_kv=kv, task_cta=np.full(T, -1, np.int64),
                    task_unit=kv.copy(), step_offsets=offsets, step_q=q,
                    step_rank=rank, step_wave=None, step_time=None, meta=meta)


def _dynamic_tasks(name: str, g: Geometry, num_sms: int) -> tuple[np.ndarray, np.ndarray, M.ScheduleMeta]:
    """The queue of a dynamic schedule: (head index, KV tile) per task in queue order, and the
    metadata the kernel decodes the orders from (O(tasks): no step is enumerated)."""
    tiles = np.arange(g.n_kv, dtype=np.int64)
    ascending_rank = name not in DESCENDING_RANK
    kv_order = tiles if ascending_rank else tiles[::-1]
    H = g.num_heads_total
    T = H * kv_order.size
    hidx = np.repeat(np.arange(H, dtype=np.int64), kv_order.size)
    kv = np.tile(kv_order, H)
    if name == "lpt":
        order, _ = lpt_order(g, hidx, kv, num_sms)
        hidx, kv = hidx[order], kv[order]
    elif name == "sections":
        sec = head_section(g)
        place = np.tile(np.arange(kv_order.size, dtype=np.int64), H)  # place in the head's own queue
        # A GQA group's heads go one place apart (head i of the group i places behind the first),
        # so a KV tile's dK/dV turns (validate.dkv_order_pays) find the previous head's add done.
        place = place + (hidx % g.heads) % g.group
        order = np.lexsort((hidx, place, hidx // sec))
        hidx, kv = hidx[order], kv[order]
    batch, head = hidx // g.heads, hidx % g.heads
    lens = g.task_len[kv]
    ascending_q = name != "descending"
    qb = g.q_begin[kv]
    qe = g.q_end[kv]
    rows = np.zeros((T, M.NUM_COLS), dtype=np.int64)
    rows[:, M.C_BATCH], rows[:, M.C_HEAD], rows[:, M.C_KV] = batch, head, kv
    rows[:, M.C_N_STEPS] = lens
    rows[:, M.C_LIN_BASE] = qb if ascending_q else qe - 1
    rows[:, M.C_LIN_DIR] = 1 if ascending_q else -1
    rows[:, M.C_HEAD_KV] = head // g.group
    rows[:, M.C_CTA] = -1
    rows[:, M.C_UNIT] = kv
    num_ctas = min(num_sms, T)
    header = _header(name, g, num_ctas, T, M.DISPATCH_DYNAMIC,
                     M.RANK_ASC if ascending_rank else M.RANK_DESC,
                     0, g.n_kv, 0, int(lens.sum()), 0)
    return hidx, kv, M.ScheduleMeta(header, np.zeros(0, dtype=np.int32), _i32(rows))


# ---------------------------------------------------------------- static
def shift_layout(g: Geometry, name: str) -> tuple[int, int, int]:
    """(units_per_head, pairs_hi, rect_begin) of a static schedule.

    ``shift``: every KV tile is its own unit.  ``symmetric_shift`` on a causal
    mask: unit p holds KV tile p ("lo") and, for p < n_kv // 2, KV tile
    n_kv-1-p ("hi").  On a full mask every KV tile has the same length, there is
    nothing to level, and symmetric_shift *is* shift.
    rect_begin R: the Q tiles [R, n_q) are met by every lo tile (the dense
    rectangle); hi tiles meet only Q tiles >= R.  With an odd n_kv the middle
    tile is a lo tile without partner.  A window that ends the Q ranges of
    some KV tiles before n_q (a bounded left side) has no such rectangle:
    R = n_q, and every task walks its Q range ascending.
    """
    n = g.n_kv
    if name == "symmetric_shift" and g.causal and n >= 2:
        pairs_hi = n // 2
        units = n - pairs_hi
        # any R with q_begin[last lo] <= R <= q_begin[first hi] works.  Take the
        # paper's (the first hi tile's q_begin) unless the rectangle would then be
        # narrower than the number of lo tiles (odd n), which forces collisions.
        rect = int(g.q_begin[units])
        if g.n_q - rect < units:
            rect = int(g.q_begin[units - 1])
    else:
        pairs_hi = 0
        units = n
        rect = int(g.q_begin[n - 1]) if np.all(g.q_end == g.n_q) else g.n_q
    return units, pairs_hi, rect


def cyc_stride_log2(width: int, units: int) -> int:
    """log2 of k, the stride between the cyclic legs' starting tiles of consecutive slots.

    Slot i of a segment starts its walk over the rectangle's ``width`` Q tiles at
    R + (k i) % width. With k = 1 (the paper's shift) a rectangle tile takes its
    contributions from consecutive slots on consecutive steps, so each dQ hand-off
    (add, completion, release, the next writer's acquire: about one step of the
    kernel at d = 128, docs/journal/results.md) must fit in one step. Where the
    rectangle has room (width >= 2 units, e.g. 64-row Q tiles against 128-row KV
    tiles) k, the largest power of two <= width // units, spaces consecutive
    contributions k steps apart; with zero hand-off cost both orders take the
    same time. (A power of two: the dQ writer decodes ranks with shifts; a
    division by a run-time k made ptxas spill in its 24-register warps.)
    """
    return max(1, width // max(units, 1)).bit_length() - 1


def _build_static(name: str, g: Geometry, num_sms: int) -> Schedule:
    """shift / symmetric_shift.

    Unit u = (head index, p), u = head_index * units + p, runs on CTA u % S in
    wave u // S.  The units of one head that share a wave form a *segment*
    [pa, pb); slot i = p - pa.

    lo tile p:  first the dense rectangle [R, n_q) as a cyclic shift starting at
                R + (k i) % W (W = n_q - R, k = 2^cyc_stride_log2(W, units)), then its remaining Q tiles [q_begin, R)
                ascending (stage 2, the upper-left part). Without a rectangle
                (R = n_q, windows): its Q range [q_begin, q_end) ascending.
    hi tile:    Q tiles n_q-1 down to its q_begin (stage 2, the folded lower-right
                triangle), right after the lo tile on the same CTA.

    Ranks: every contribution gets a planned time (wave, t) with t its step
    number within the unit; dQ adds happen in planned-time order.  Ties (only
    possible when a segment is wider than the rectangle, or lo tiles share a
    q_begin) break by slot in the rectangle and by descending unit elsewhere.
    Since the planned time strictly increases along every CTA's program, the
    wait-for graph is acyclic by construction; validation checks it anyway.
    Under a window the Q ranges of later KV tiles start no earlier, so within
    a wave a later tile reaches a Q tile first: outside the rectangle the
    ranks run down the KV tiles of the segment (the decode's descending leg).
    A KV tile no query sees (windows) is a unit whose task has no steps.
    """
    st = _static_tasks(name, g, num_sms)
    g_rect, width, kv, p, role = st.rect, st.width, st.kv, st.p, st.role
    T = kv.size
    # (b) explicit visiting orders, built from their definition
    step_q_parts = []
    cache = {}
    for r in range(T):
        key = (int(role[r]), int(kv[r]), int(st.cyc_off[r]))
        seq = cache.get(key)
        if seq is None:
            if role[r] == 0:
                rect_part = np.roll(np.arange(g_rect, g.n_q, dtype=np.int64), -key[2])
                rest = np.arange(g.q_begin[kv[r]], min(g_rect, int(g.q_end[kv[r]])), dtype=np.int64)
                seq = np.concatenate([rect_part, rest])
            else:
                seq = np.arange(g.n_q - 1, g.q_begin[kv[r]] - 1, -1, dtype=np.int64)
            cache[key] = seq
        step_q_parts.append(seq)
    step_q = np.concatenate(step_q_parts) if step_q_parts else np.zeros(0, np.int64)
    lens = g.task_len[kv]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    N = int(offsets[-1])
    step_task = np.repeat(np.arange(T, dtype=np.int64), lens)
    s = np.arange(N, dtype=np.int64) - offsets[step_task]
    # (c) ranks by planned time
    t = st.t0[step_task] + s
    wave = st.wave[step_task]
    in_rect_leg = (role[step_task] == 0) & (s < width)
    tie = np.where(in_rect_leg, st.slot[step_task], -p[step_task])
    gid = st.hidx[step_task] * g.n_q + step_q
    rank = _ranks_by_key(gid, wave, t, tie)
    return Schedule(name=name, geometry=g, num_sms=num_sms, dispatch="static", num_ctas=st.num_ctas,
                    task_batch=st.hidx // g.heads, task_head=st.hidx % g.heads, task_kv=kv, task_cta=st.cta,
                    task_unit=p, step_offsets=offsets, step_q=step_q, step_rank=rank,
                    step_wave=wave, step_time=t, meta=st.meta)


class _StaticTasks(NamedTuple):
    """A static schedule's rows (task-table order) and what its steps' planned times derive from."""
    meta: M.ScheduleMeta
    hidx: np.ndarray     # batch * heads + head
    kv: np.ndarray
    p: np.ndarray        # the unit's lo tile
    role: np.ndarray     # 0: lo tile, 1: hi tile
    slot: np.ndarray     # the unit's place in its segment
    cyc_off: np.ndarray
    cta: np.ndarray
    wave: np.ndarray     # planned time of step s: (wave, t0 + s)
    t0: np.ndarray
    rect: int
    width: int
    num_ctas: int


def _static_tasks(name: str, g: Geometry, num_sms: int) -> _StaticTasks:
    """The rows of a static schedule and the metadata the kernel decodes (O(tasks): no step is
    enumerated)."""
    units, pairs_hi, rect = shift_layout(g, name)
    width = g.n_q - rect
    wmod = max(width, 1)  # cyclic offsets; no cyclic leg when width == 0
    k_log2 = cyc_stride_log2(width, units)
    n = g.n_kv
    H = g.num_heads_total
    U = H * units
    S = num_sms
    u = np.arange(U, dtype=np.int64)
    u_head, u_p = u // units, u % units
    u_cta, u_wave = u % S, planned_wave(u_head, u_p, units, S)
    u_pa = np.maximum(0, u_wave * S - u_head * units)
    u_pb = np.minimum(units, (u_wave + 1) * S - u_head * units)
    u_rows = 1 + (u_p < pairs_hi)
    # table order: grouped by CTA, units in increasing u
    uo = np.lexsort((u, u_cta))
    row_unit = np.repeat(uo, u_rows[uo])
    row_start = np.cumsum(u_rows[uo]) - u_rows[uo]
    role = np.arange(row_unit.size, dtype=np.int64) - np.repeat(row_start, u_rows[uo])
    p = u_p[row_unit]
    kv = np.where(role == 0, p, n - 1 - p)
    hidx = u_head[row_unit]
    batch, head = hidx // g.heads, hidx % g.heads
    pa, pb = u_pa[row_unit], u_pb[row_unit]
    slot = p - pa
    cyc_off = ((slot << k_log2) % wmod).astype(np.int64)  # where a lo tile's cyclic leg starts
    lens = g.task_len[kv]
    T = kv.size
    num_ctas = min(S, U)
    cta = u_cta[row_unit]
    cta_offsets = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=num_ctas))])
    rows = np.zeros((T, M.NUM_COLS), dtype=np.int64)
    rows[:, M.C_BATCH], rows[:, M.C_HEAD], rows[:, M.C_KV] = batch, head, kv
    rows[:, M.C_N_STEPS] = lens
    rows[:, M.C_CYC_LEN] = np.where(role == 0, width, 0)
    rows[:, M.C_CYC_BASE] = np.where(role == 0, rect, 0)
    rows[:, M.C_CYC_OFF] = np.where(role == 0, cyc_off, 0)
    rows[:, M.C_LIN_BASE] = np.where(role == 0, g.q_begin[kv], g.n_q - 1)
    rows[:, M.C_LIN_DIR] = np.where(role == 0, 1, -1)
    rows[:, M.C_ROLE] = role
    rows[:, M.C_SEG_BEGIN], rows[:, M.C_SEG_END] = pa, pb
    rows[:, M.C_HEAD_KV] = head // g.group
    rows[:, M.C_CTA] = cta
    rows[:, M.C_UNIT] = p
    header = _header(name, g, num_ctas, T, M.DISPATCH_STATIC, M.RANK_SHIFT, rect, units, pairs_hi,
                     int(lens.sum()), num_ctas + 1, cyc_stride_log2=k_log2)
    meta = M.ScheduleMeta(header, _i32(cta_offsets), _i32(rows))
    return _StaticTasks(meta, hidx, kv, p, role, slot, cyc_off, cta, u_wave[row_unit], planned_t0(g, role, p),
                        rect, width, num_ctas)


# ---------------------------------------------------------------- entry points
def _checked(name: str, geometry: Geometry, num_sms) -> tuple[str, int]:
    """(the concrete schedule name, the SM count) of a build's arguments, checked."""
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    num_sms = _check_num_sms(num_sms)
    return _concrete(name), num_sms


def build_schedule(name: str, geometry: Geometry, num_sms: int, *, validate: bool = True) -> Schedule:
    """Build schedule ``name`` for ``geometry`` on ``num_sms`` persistent CTAs.

    With ``validate=True`` (default) every check of :func:`.validate.validate`
    runs and a failing schedule raises :class:`ScheduleError`.
    """
    name, num_sms = _checked(name, geometry, num_sms)
    if name in EXTRA_BUILDERS:
        builder = EXTRA_BUILDERS[name][0]
    else:
        builder = _build_dynamic if name in DYNAMIC_SCHEDULES else _build_static
    sched = builder(name, geometry, num_sms)
    if validate:
        sched.validate()
    return sched


def build_metadata(name: str, geometry: Geometry, num_sms: int) -> M.ScheduleMeta:
    """Only the kernel's input of schedule ``name``, from its rows alone (O(tasks) time and
    memory: the same arrays as ``build_schedule(...).meta``, without enumerating a step).
    Unvalidated: the kernel path checks it with :func:`.validate.check_metadata`."""
    name, num_sms = _checked(name, geometry, num_sms)
    if name in DYNAMIC_SCHEDULES:
        return _dynamic_tasks(name, geometry, num_sms)[2]
    if name in EXTRA_BUILDERS:
        return EXTRA_BUILDERS[name][1](name, geometry, num_sms)
    return _static_tasks(name, geometry, num_sms).meta


@lru_cache(maxsize=32)
def _get_schedule_cached(name: str, geometry: Geometry, num_sms: int) -> Schedule:
    return build_schedule(name, geometry, num_sms, validate=True)


@lru_cache(maxsize=1024)
def _get_metadata_cached(name: str, geometry: Geometry, num_sms: int) -> M.ScheduleMeta:
    return _get_schedule_cached(name, geometry, num_sms).meta


def get_schedule(name: str, geometry: Geometry, num_sms: int) -> Schedule:
    """Validated schedule, cached by (name, geometry, num_sms).  ``auto`` resolves first.

    This is what the kernel launcher calls for every backward; a repeated shape
    costs one dictionary lookup.
    """
    num_sms = _check_num_sms(num_sms)
    return _get_schedule_cached(_concrete(name), geometry, num_sms)


def get_metadata(name: str, geometry: Geometry, num_sms: int) -> M.ScheduleMeta:
    """Only the kernel's input of the validated schedule (O(tasks) int32), cached.

    The full :class:`Schedule` keeps O(steps) arrays for inspection and is
    cached for fewer shapes; the launcher should call this.
    """
    num_sms = _check_num_sms(num_sms)
    return _get_metadata_cached(_concrete(name), geometry, num_sms)


def clear_cache() -> None:
    _get_schedule_cached.cache_clear()
    _get_metadata_cached.cache_clear()
