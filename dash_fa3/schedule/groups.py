"""``groups``: a GQA group's query heads at one KV tile run back to back on one CTA.

Why. Under GQA every query head of a group adds into the same dK/dV rows. The
queue schedules give each (query head, KV tile) a task of its own, and each
task carries its fp32 dK and dV out of the kernel (a slab per query head, or
adds into one accumulator per KV head): 2 x block_n x d x 4 bytes per task.
Where queries are few, a task has few steps and that epilogue takes as long
as they do. Here the group's heads at a KV tile form one *chain* (columns
``chain_before`` / ``chain_after``): K and V load once, dK and dV stay in
registers from one head to the next, and the chain's last row stores them
once, in 16 bits, as an MHA task does (header ``dkv_chained`` =
``DKV_CHAINED_WHOLE``). No fp32 partials, no accumulator to zero, nothing of
dK/dV left for the postprocess.

Order. The chains queue like ``lpt``'s tasks: longest first within sections
of (batch, KV head) pairs whose Q, dO, K and V fit the L2 budget, the section
size the one the claim model balances best. Chains need a static table (a
CTA runs a chain's rows one after another), so the queue is dealt to CTAs
ahead of the launch by that claim model (:func:`.schedules.greedy_assignment`).

dQ adds go by ascending KV tile (``RANK_ASC``), ``fa3``'s ranks: the schedule
is valid in deterministic mode, with ``fa3``'s waits between the KV tiles of
a head, and meant for the non-deterministic one. Without GQA, under a window,
or where a task has no steps, there are no chains: ``lpt``'s queue, dealt
statically. Not defined for the tiles of a kernel without chains (head dim 192:
:attr:`.Geometry.kernel_chains`).
"""

from __future__ import annotations

import numpy as np

from . import metadata as M
from .geometry import Geometry, _cdiv, require_kernel_chains
from .schedules import (APPLIES, EXTRA_BUILDERS, LPT_SECTION_ROWS, Schedule, _header, _i32, _ranks_by_key,
                        claim_loads, greedy_assignment, task_claim_cost)

NAME = "groups"


def chainable(g: Geometry) -> bool:
    """Whether ``groups`` chains the heads of ``g``'s groups: GQA under a full or causal mask, every
    task with steps (a task without steps stores at once: validate._check_chains)."""
    return g.heads != g.heads_kv and g.mask in ("full", "causal") and bool(np.all(g.task_len > 0))


def chain_queue(g: Geometry, num_sms: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The queue of chains: (batch x KV head index, KV tile) per chain in queue order, and the
    number of (batch, KV head) pairs per section."""
    n = g.n_kv
    units = g.batch * g.heads_kv
    bk = np.repeat(np.arange(units, dtype=np.int64), n)
    kv = np.tile(np.arange(n, dtype=np.int64), units)
    cost = g.group * task_claim_cost(g.task_len[kv])
    # lpt's key: the suffix maximum of the lengths, so a lower KV tile is never queued later
    key = np.maximum.accumulate(g.task_len[::-1])[::-1][kv]
    if key.size == 0 or key.min() == key.max():
        return bk, kv, units
    bound = max(1, min(units, LPT_SECTION_ROWS // (g.group * g.seqlen_q + g.seqlen_k)))
    sizes = {bound, _cdiv(units, _cdiv(units, bound))}
    sizes.update(1 << i for i in range(bound.bit_length()) if (1 << i) <= bound)
    num_ctas = max(1, min(num_sms, kv.size))
    best = None
    for sec in sorted(sizes):
        order = np.lexsort((kv, bk, -key, bk // sec))
        load = claim_loads(cost[order], num_ctas).max()
        if best is None or load < best[0]:
            best = (load, order, sec)
    return bk[best[1]], kv[best[1]], best[2]


def _tasks(g: Geometry, num_sms: int):
    """(metadata, head index, KV tile, CTA) of the task rows in table order."""
    require_kernel_chains(NAME, g)
    chained = chainable(g)
    if chained:
        cbk, ckv, _ = chain_queue(g, num_sms)
        members = g.group
    else:
        # one "chain" per task: lpt's queue
        from .schedules import lpt_order
        H = g.num_heads_total
        hidx0 = np.repeat(np.arange(H, dtype=np.int64), g.n_kv)
        kv0 = np.tile(np.arange(g.n_kv, dtype=np.int64), H)
        order, _ = lpt_order(g, hidx0, kv0, num_sms)
        cbk, ckv = hidx0[order], kv0[order]
        members = 1
    C = ckv.size
    num_ctas = max(1, min(num_sms, C))
    chain_cta = greedy_assignment(members * task_claim_cost(g.task_len[ckv]), num_ctas)
    by_cta = np.lexsort((np.arange(C), chain_cta))  # each CTA's chains in queue order
    cbk, ckv, chain_cta = cbk[by_cta], ckv[by_cta], chain_cta[by_cta]
    # expand each chain into its rows, the group's heads ascending
    j = np.tile(np.arange(members, dtype=np.int64), C)
    kv = np.repeat(ckv, members)
    cta = np.repeat(chain_cta, members)
    if chained:
        bk = np.repeat(cbk, members)
        batch = bk // g.heads_kv
        head = (bk % g.heads_kv) * g.group + j
    else:
        batch, head = np.repeat(cbk, members) // g.heads, np.repeat(cbk, members) % g.heads
    T = kv.size
    lens = g.task_len[kv]
    rows = np.zeros((T, M.NUM_COLS), dtype=np.int64)
    rows[:, M.C_BATCH], rows[:, M.C_HEAD], rows[:, M.C_KV] = batch, head, kv
    rows[:, M.C_N_STEPS] = lens
    rows[:, M.C_LIN_BASE] = g.q_begin[kv]
    rows[:, M.C_LIN_DIR] = 1
    rows[:, M.C_ROLE] = M.ROLE_LO
    rows[:, M.C_HEAD_KV] = head // g.group
    rows[:, M.C_CTA] = cta
    rows[:, M.C_UNIT] = kv
    if chained:
        rows[:, M.C_CHAIN_BEFORE] = j
        rows[:, M.C_CHAIN_AFTER] = members - 1 - j
    cta_offsets = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=num_ctas))])
    header = _header(NAME, g, num_ctas, T, M.DISPATCH_STATIC, M.RANK_ASC, 0, g.n_kv, 0, int(lens.sum()),
                     num_ctas + 1)
    header[M.H_DKV_CHAINED] = M.DKV_CHAINED_WHOLE if chained else M.DKV_UNCHAINED
    meta = M.ScheduleMeta(header, _i32(cta_offsets), _i32(rows))
    return meta, batch * g.heads + head, kv, cta, num_ctas


def build_metadata(name: str, g: Geometry, num_sms: int) -> M.ScheduleMeta:
    """The kernel's input of ``groups`` from its rows alone (unvalidated)."""
    return _tasks(g, num_sms)[0]


def build(name: str, g: Geometry, num_sms: int) -> Schedule:
    """The ``groups`` schedule with its visiting orders (Q tiles ascending) and ranks (ascending
    KV tile per dQ tile) from their definition; validation compares the decode."""
    meta, hidx, kv, cta, num_ctas = _tasks(g, num_sms)
    T = kv.size
    lens = g.task_len[kv]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    step_task = np.repeat(np.arange(T, dtype=np.int64), lens)
    t = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[step_task]
    step_q = g.q_begin[kv][step_task].astype(np.int64) + t
    rank = _ranks_by_key(hidx[step_task] * g.n_q + step_q, kv[step_task])
    return Schedule(name=NAME, geometry=g, num_sms=num_sms, dispatch="static", num_ctas=num_ctas,
                    task_batch=hidx // g.heads, task_head=hidx % g.heads, task_kv=kv, task_cta=cta,
                    task_unit=kv.copy(), step_offsets=offsets, step_q=step_q, step_rank=rank,
                    step_wave=None, step_time=None, meta=meta)


EXTRA_BUILDERS[NAME] = (build, build_metadata)
APPLIES[NAME] = lambda g: g.kernel_chains
