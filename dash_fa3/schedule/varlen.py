"""Backward schedules over packed documents (varlen, FA3's ``cu_seqlens`` layout).

A packed batch is a batch of documents of unequal lengths. Each document is its
own attention problem (its masks aligned to its own corner), so its schedule is
the schedule of its own geometry (:class:`.Geometry` with batch 1), built and
validated as for a dense call and cached per (name, lengths). The kernel decodes
a task row with the geometry of its document, whose lengths it reads from
``cu_seqlens`` (``csrc/common/seqlen_info.h``).

Merging. The documents' task queues are concatenated, longest document first
(most steps), each document's queue in its own order, and the concatenation is
lowered to static CTA lists as a dense dynamic schedule is (``lowering``: each
task, in queue order, to the CTA that becomes free first). A task only waits on
contributions of its own document that come earlier in that document's queue,
hence earlier in the merged queue, and every CTA runs its tasks in queue order:
the earliest unfinished task can always run, so the merged schedule is
deadlock-free whenever each document's is.

Only the dynamic schedules (``fa3``, ``spt``, ``descending``, ``lpt``) merge this
way: their rank rule (ascending or descending KV tile) needs nothing but the
document's geometry. ``shift`` and ``symmetric_shift`` plan waves over one
geometry (their rank parameters are header fields shared by every row) and are
refused for packed documents. ``auto`` picks ``spt`` deterministically (the
dense rule's choice for causal masks below 32 KV tiles, the common document
length) and ``lpt`` otherwise.

Documents without query rows but with keys get one task per (head, KV tile)
without steps, which stores dK = dV = 0; documents without keys need none
(their dQ rows stay 0 and the forward gave them out 0, LSE -inf).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import metadata as M
from .geometry import Geometry
from .schedules import SCHEDULES, _i32, get_schedule, greedy_assignment, task_claim_cost

VARLEN_SCHEDULES = ("fa3", "spt", "descending", "lpt")


def resolve_varlen_schedule(name: str, deterministic: bool) -> str:
    """``auto`` -> ``spt`` (deterministic) / ``lpt``; other names must merge over documents."""
    if name == "auto":
        return "spt" if deterministic else "lpt"
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {('auto',) + tuple(SCHEDULES)}")
    if name not in VARLEN_SCHEDULES:
        raise ValueError(f"schedule {name!r} plans waves over one geometry and does not run on packed documents; "
                         f"choose one of {('auto',) + VARLEN_SCHEDULES}")
    return name


def _doc_geometry(lq: int, lk: int, heads: int, heads_kv: int, block_m: int, block_n: int, mask: str,
                  window_left: int, window_right: int) -> Geometry:
    return Geometry(batch=1, heads=heads, heads_kv=heads_kv, seqlen_q=lq, seqlen_k=lk, block_m=block_m,
                    block_n=block_n, mask=mask, window_left=window_left, window_right=window_right)


def _zero_rows(heads: int, heads_kv: int, n_kv: int) -> np.ndarray:
    """Task rows without steps for every (head, KV tile) of a document with keys and no queries."""
    rows = np.zeros((heads * n_kv, M.NUM_COLS), dtype=np.int64)
    rows[:, M.C_HEAD] = np.repeat(np.arange(heads), n_kv)
    rows[:, M.C_KV] = np.tile(np.arange(n_kv), heads)
    rows[:, M.C_LIN_DIR] = 1
    rows[:, M.C_HEAD_KV] = rows[:, M.C_HEAD] // (heads // heads_kv)
    rows[:, M.C_CTA] = -1
    rows[:, M.C_UNIT] = rows[:, M.C_KV]
    return rows


@lru_cache(maxsize=4096)
def _doc_queue(name: str, lq: int, lk: int, heads: int, heads_kv: int, block_m: int, block_n: int, mask: str,
               window_left: int, window_right: int, num_sms: int) -> tuple[np.ndarray, np.ndarray]:
    """(task rows in queue order, header) of one document's validated dynamic schedule."""
    if lq == 0:
        n_kv = -(-lk // block_n)
        return _zero_rows(heads, heads_kv, n_kv), None
    s = get_schedule(name, _doc_geometry(lq, lk, heads, heads_kv, block_m, block_n, mask, window_left,
                                          window_right), num_sms)
    assert s.dynamic, f"{name} is not a dynamic schedule"
    return s.meta.tasks.astype(np.int64), s.meta.header


def varlen_metadata(name: str, lengths: tuple[tuple[int, int], ...], *, max_seqlen_q: int, max_seqlen_k: int,
                    heads: int, heads_kv: int, block_m: int, block_n: int, mask: str, window_left: int,
                    window_right: int, num_sms: int) -> M.ScheduleMeta:
    """The static schedule the backward kernel runs over packed documents of (q, k) lengths
    ``lengths`` (``name`` already resolved by :func:`resolve_varlen_schedule`). Its header
    carries the call's ``max_seqlen_q/k``, which the kernel launcher checks."""
    if name not in VARLEN_SCHEDULES:
        raise ValueError(f"{name!r} does not merge over documents (choose one of {VARLEN_SCHEDULES})")
    if not lengths:
        raise ValueError("a packed batch needs at least one document")
    longest_q, longest_k = max(lq for lq, _ in lengths), max(lk for _, lk in lengths)
    if longest_q > max_seqlen_q or longest_k > max_seqlen_k:
        raise ValueError(f"max_seqlen_q / max_seqlen_k = {max_seqlen_q} / {max_seqlen_k} are smaller than the "
                         f"longest document ({longest_q} / {longest_k} tokens)")
    queues, costs, rank_kind, template = [], [], None, None
    for b, (lq, lk) in enumerate(lengths):
        if lk == 0:
            continue  # no keys: no task (dQ stays 0)
        rows, header = _doc_queue(name, lq, lk, heads, heads_kv, block_m, block_n, mask, window_left,
                                  window_right, num_sms)
        rows = rows.copy()
        rows[:, M.C_BATCH] = b
        queues.append((b, rows))
        costs.append(int(rows[:, M.C_N_STEPS].sum()))
        if header is not None:
            template = header if template is None else template
            rank_kind = int(header[M.H_RANK_KIND])
    if not queues:
        raise ValueError("no document has keys: nothing to schedule")
    # Longest document first; ties in batch order (a stable sort).
    order = sorted(range(len(queues)), key=lambda i: -costs[i])
    tasks = np.concatenate([queues[i][1] for i in order])
    T = tasks.shape[0]
    num_ctas = min(num_sms, T)
    # Claimed as lowering claims (task_claim_cost).
    cta = greedy_assignment(task_claim_cost(tasks[:, M.C_N_STEPS]), num_ctas)
    perm = np.lexsort((np.arange(T), cta))  # by CTA, queue order within a CTA
    tasks = tasks[perm]
    tasks[:, M.C_CTA] = cta[perm]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=num_ctas))])

    header = np.zeros(M.HEADER_LEN, dtype=np.int64)
    if template is not None:
        header[:] = template
    else:  # only documents without queries: no rank is ever decoded
        rank_kind = M.RANK_ASC
    header[M.H_MAGIC], header[M.H_VERSION] = M.MAGIC, M.METADATA_VERSION
    header[M.H_SCHEDULE] = SCHEDULES.index(name)
    header[M.H_DISPATCH] = M.DISPATCH_STATIC
    header[M.H_RANK_KIND] = rank_kind
    header[M.H_NUM_CTAS] = num_ctas
    header[M.H_NUM_TASKS] = T
    header[M.H_NUM_COLS] = M.NUM_COLS
    header[M.H_BATCH] = len(lengths)
    header[M.H_HEADS], header[M.H_HEADS_KV] = heads, heads_kv
    header[M.H_SEQLEN_Q], header[M.H_SEQLEN_K] = max_seqlen_q, max_seqlen_k
    header[M.H_BLOCK_M], header[M.H_BLOCK_N] = block_m, block_n
    header[M.H_MASK] = M.MASK_CODES[mask]
    header[M.H_WINDOW_LEFT], header[M.H_WINDOW_RIGHT] = window_left, window_right
    header[M.H_N_Q] = -(-int(header[M.H_SEQLEN_Q]) // block_m)
    header[M.H_N_KV] = -(-int(header[M.H_SEQLEN_K]) // block_n)
    header[M.H_RECT_BEGIN], header[M.H_UNITS_PER_HEAD], header[M.H_PAIRS_HI] = 0, 0, 0
    header[M.H_NUM_STEPS] = int(tasks[:, M.C_N_STEPS].sum())
    header[M.H_OFFSETS_LEN] = num_ctas + 1
    return M.ScheduleMeta(_i32(header), _i32(offsets), _i32(tasks))


@lru_cache(maxsize=256)
def varlen_metadata_cached(name: str, lengths: tuple[tuple[int, int], ...], max_seqlen_q: int, max_seqlen_k: int,
                           heads: int, heads_kv: int, block_m: int, block_n: int, mask: str, window_left: int,
                           window_right: int, num_sms: int) -> M.ScheduleMeta:
    return varlen_metadata(name, lengths, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, heads=heads,
                           heads_kv=heads_kv, block_m=block_m, block_n=block_n, mask=mask,
                           window_left=window_left, window_right=window_right, num_sms=num_sms)
