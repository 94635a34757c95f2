"""``runs``: each CTA owns a run of consecutive tasks, so no dQ add waits on another CTA.

Why. The other deterministic schedules spread the KV tiles of a head over
many CTAs at once and order their dQ adds with semaphores; a hand-off costs
about a step, so where keys far outnumber queries (few Q tiles, many KV tiles)
the adds into a Q tile queue up behind each other (``split`` shortens the
queues, it does not remove them). Here the tasks are cut into as many runs as
there are CTAs, each a contiguous stretch of one fixed sequence with about the
same number of steps, and CTA i runs run i. A head's tasks within one run are
a *piece* with a dQ accumulator of its own (its split): every add into it
comes from the same CTA, in the CTA's program order, so the semaphore of each
add is released by the CTA's own previous add, steps earlier. The postprocess
sums a head's pieces in ascending split order, as for ``split``.

The sequence runs over (batch, KV head, KV tile, query head of the group): a
GQA group's heads of one KV tile follow each other on one CTA, so the kernel's
dK/dV turns (header ``dkv_ordered``) find the previous head's add finished
and the group shares one fp32 accumulator per KV head instead of a slab per
query head. Better still, those heads form a *chain* (columns ``chain_before`` /
``chain_after``, header ``dkv_chained``): K and V stay in shared memory and dK/dV in
registers from one head to the next, and only the chain's last row adds them, once,
in its turn. Where a run boundary cuts through a group, the earlier run takes
the group's higher heads (it reaches them last) and the later run the lower
ones (it starts with them): the turns go in ascending head order, and each CTA
runs its part of the group in ascending order.

Ranks: within a piece, the adds into a dQ tile go by ascending KV tile (the
run's order), from the piece's first KV tile (the row's ``split_begin``):
``RANK_RUN``, rank = kv - max(kv_begin(q), split_begin). A task visits its Q
tiles ascending.

The cost: a head gets as many fp32 dQ accumulators as runs it spans, about
``num_ctas / (batch * heads_kv)`` + 1 where a (batch, KV head) spans several
runs; dQ is small where this schedule is meant to run (few queries).

Not defined for the tiles of a kernel without chains (head dim 192:
:attr:`.Geometry.kernel_chains`).
"""

from __future__ import annotations

import numpy as np

from . import metadata as M
from .geometry import Geometry, require_kernel_chains
from .schedules import APPLIES, EXTRA_BUILDERS, Schedule, _header, _i32, _ranks_by_key, task_claim_cost
from .validate import dkv_order_ok, unchained

NAME = "runs"


def run_layout(g: Geometry, num_sms: int):
    """The tasks in task-table order and where they go: (batch, head, kv, cta, split, split_begin,
    num_ctas, num_splits) (arrays of int64 but the two counts)."""
    n, group, HK = g.n_kv, g.group, g.heads_kv
    U = g.num_heads_total * n
    i = np.arange(U, dtype=np.int64)
    # the sequence: (batch, KV head, KV tile, query head of the group descending)
    bk, kv, j = i // (n * group), (i // group) % n, i % group
    batch = bk // HK
    head = (bk % HK) * group + (group - 1 - j)
    lens = g.task_len[kv].astype(np.int64)
    cost = task_claim_cost(lens).astype(np.int64)
    total = int(cost.sum())
    want = min(num_sms, U)
    # task i goes to the run its cost's midpoint falls in: runs of about total / want each
    mid2 = 2 * (np.cumsum(cost) - cost) + cost
    cta = np.minimum(mid2 * want // (2 * total), want - 1)
    _, cta = np.unique(cta, return_inverse=True)  # runs left empty by large tasks drop out
    num_ctas = int(cta.max()) + 1
    order = np.lexsort((head, kv, bk, cta))  # each run in sequence order, a group's heads ascending
    batch, head, kv, cta = batch[order], head[order], kv[order], cta[order]
    hidx = batch * g.heads + head
    # a head's pieces (one per run it meets) numbered by run
    piece = np.unique(hidx * num_ctas + cta)
    piece_head = piece // num_ctas
    first = np.searchsorted(piece_head, piece_head)
    piece_split = np.arange(piece.size) - first
    p = np.searchsorted(piece, hidx * num_ctas + cta)
    split = piece_split[p]
    begin = np.full(piece.size, n, dtype=np.int64)
    np.minimum.at(begin, p, kv)
    num_splits = int(split.max()) + 1 if split.size else 1
    return batch, head, kv, cta, split, begin[p], num_ctas, num_splits


def _tasks(g: Geometry, num_sms: int):
    require_kernel_chains(NAME, g)
    batch, head, kv, cta, split, split_begin, num_ctas, num_splits = run_layout(g, num_sms)
    T = kv.size
    lens = g.task_len[kv]
    rows = np.zeros((T, M.NUM_COLS), dtype=np.int64)
    rows[:, M.C_BATCH], rows[:, M.C_HEAD], rows[:, M.C_KV] = batch, head, kv
    rows[:, M.C_N_STEPS] = lens
    rows[:, M.C_CYC_LEN] = 0
    rows[:, M.C_LIN_BASE] = g.q_begin[kv]
    rows[:, M.C_LIN_DIR] = 1
    rows[:, M.C_ROLE] = M.ROLE_LO
    rows[:, M.C_HEAD_KV] = head // g.group
    rows[:, M.C_CTA] = cta
    rows[:, M.C_UNIT] = kv
    rows[:, M.C_SPLIT] = split
    rows[:, M.C_SPLIT_BEGIN] = split_begin
    rows[:, M.C_RECT] = g.n_q
    chained = g.heads != g.heads_kv and g.mask in ("full", "causal") and bool(np.all(lens > 0))
    if chained:
        rows[:, M.C_CHAIN_BEFORE], rows[:, M.C_CHAIN_AFTER] = chains(rows)
    cta_offsets = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=num_ctas))])
    header = _header(NAME, g, num_ctas, T, M.DISPATCH_STATIC, M.RANK_RUN, g.n_q, g.n_kv, 0, int(lens.sum()),
                     num_ctas + 1, num_splits=num_splits)
    # chains add their dK/dV in turns: asked for here, kept where the certificate allows them
    header[M.H_DKV_CHAINED] = header[M.H_DKV_ORDERED] = int(chained)
    meta = M.ScheduleMeta(header, _i32(cta_offsets), _i32(rows))
    if chained and not dkv_order_ok(meta, g, num_sms):
        meta = unchained(meta)
        meta = M.ScheduleMeta(_with(meta.header, M.H_DKV_ORDERED, 0), meta.offsets, meta.tasks)
    return meta, batch * g.heads + head, kv, split, cta, num_ctas


def _with(header: np.ndarray, field: int, value: int) -> np.ndarray:
    h = header.copy()
    h[field] = value
    return h


def chains(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chain_before, chain_after) of task rows in table order: a chain is a maximal stretch of
    consecutive rows of one CTA at one (batch, KV head, KV tile) whose query heads ascend by one."""
    key = rows[:, [M.C_CTA, M.C_BATCH, M.C_HEAD_KV, M.C_KV]]
    link = np.zeros(rows.shape[0], dtype=bool)  # row i continues row i - 1
    link[1:] = (key[1:] == key[:-1]).all(axis=1) & (rows[1:, M.C_HEAD] == rows[:-1, M.C_HEAD] + 1)
    i = np.arange(rows.shape[0], dtype=np.int64)
    start = np.maximum.accumulate(np.where(link, 0, i))
    end = np.minimum.accumulate(np.where(np.append(link[1:], False), rows.shape[0], i)[::-1])[::-1]
    return i - start, end - i


def build_metadata(name: str, g: Geometry, num_sms: int) -> M.ScheduleMeta:
    """The kernel's input of ``runs`` from its rows alone (unvalidated)."""
    return _tasks(g, num_sms)[0]


def build(name: str, g: Geometry, num_sms: int) -> Schedule:
    """The ``runs`` schedule with its visiting orders and ranks from their definition (the module
    docstring): ranks by KV tile within each (piece, Q tile); validation compares the decode."""
    meta, hidx, kv, split, cta, num_ctas = _tasks(g, num_sms)
    T = kv.size
    lens = g.task_len[kv]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    step_task = np.repeat(np.arange(T, dtype=np.int64), lens)
    t = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[step_task]
    step_q = g.q_begin[kv][step_task].astype(np.int64) + t
    gid = (split[step_task] * g.num_heads_total + hidx[step_task]) * g.n_q + step_q
    rank = _ranks_by_key(gid, kv[step_task])
    return Schedule(name=NAME, geometry=g, num_sms=num_sms, dispatch="static", num_ctas=num_ctas,
                    task_batch=hidx // g.heads, task_head=hidx % g.heads, task_kv=kv, task_cta=cta,
                    task_unit=kv, step_offsets=offsets, step_q=step_q, step_rank=rank,
                    step_wave=None, step_time=None, meta=meta)


EXTRA_BUILDERS[NAME] = (build, build_metadata)
APPLIES[NAME] = lambda g: g.kernel_chains
