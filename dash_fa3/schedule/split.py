"""``split`` and ``interleave``: the deterministic schedules for few queries and many keys (seqlen_q << seqlen_k).

Why a schedule of its own. Every KV tile adds one partial dQ into each Q tile
it meets, in a fixed order. With n_q Q tiles and n_kv >> n_q KV tiles the KV
tiles of a head run side by side, and in one accumulator each Q tile would
take n_kv ordered adds, n_kv / n_q of them in every step: the adds, each a
hand-off of about one step, set the pace instead of the tensor cores.

So the KV tiles of a head are cut into *splits* of consecutive tiles, each
with an fp32 dQ accumulator and semaphores of its own; the postprocess sums
the splits' accumulators in ascending split order (fixed: the result does not
depend on timing). Within a split the KV tiles run as ``shift`` runs a square
problem: the split's *rectangle* is the Q tiles [R, n_q) that all its tiles
meet (R, the row's ``rect``, is the q_begin of its last tile); tile i of the
split's part of a wave starts its cyclic leg over the rectangle i tiles on,
so in every step its tiles add into distinct Q tiles, then walks its own Q
tiles below R ascending. A split holds at most as many tiles as its rectangle
is wide, so no two of its adds ever fall on one Q tile in one step.

Ranks are the order of planned time, as for the static schedules: unit u =
head_index * n_kv + kv runs on CTA u % S in wave u // S; within (split, Q
tile) the adds run by (wave, step), ties by slot in the rectangle, by
descending KV tile below it (a later tile reaches a lower Q tile first). The
decode is the SHIFT rule applied to the split (``RANK_SPLIT``,
:func:`.metadata._decode`).

The cost: ``num_splits`` fp32 dQ accumulators instead of one, about as many
bytes as a bf16 K of all query heads, written by the main kernel (the
deterministic first add stores) and summed by the postprocess.

``interleave`` is the same rule over another launch order. ``split`` numbers
the units head by head, so the S CTAs of a wave hold up to S KV tiles of one
head, which need as many splits. ``interleave`` takes the heads in sections
(:func:`.geometry.head_section`: as many as keep their Q, dO and dQ accumulator within
.geometry.L2_BUDGET) and a section's units KV tile by KV tile, its heads side by side
(header ``head_section``, :func:`.metadata.planned_unit`): a wave then holds
about S / section tiles of each head, which start their cyclic legs apart as
above, and a split needs to end only where its rectangle gets narrower than
that (:func:`split_layout`'s ``per_wave``). Fewer splits, fewer accumulator
bytes; the ranks and their decode are the same (a head's tiles in a wave are
still consecutive, the earlier waves hold the ones before). Splits need every KV tile's Q range to end at n_q (full and
causal masks); under other windows the schedule is one split without a
rectangle (:func:`split_layout`).
"""

from __future__ import annotations

import numpy as np

from . import metadata as M
from .geometry import Geometry, head_section
from .schedules import EXTRA_BUILDERS, Schedule, _header, _i32, _ranks_by_key

NAME = "split"
INTERLEAVE = "interleave"
#: A split's tiles start their cyclic legs 2^STRIDE_LOG2 tiles apart, and it holds at most
#: width >> STRIDE_LOG2 tiles: a dQ tile's consecutive adds come that many steps apart. A
#: stride of 2 gives each hand-off two steps but doubles the splits, whose accumulators then
#: cost more than the waits they save (benchmarks/bench_rect.py on an H100: docs/journal).
STRIDE_LOG2 = 0


def split_layout(g: Geometry, per_wave: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(split, split_begin, rect) of every KV tile of a head.

    Greedy from KV tile 0: a split takes the next tile while it then holds at
    most as many tiles as its rectangle [q_begin of that tile, n_q) is wide.
    ``per_wave`` (``interleave``): at most that many tiles of a head run in one
    wave, so a split whose rectangle is at least that wide may hold any number.
    Under full and causal masks q_begin does not fall with the KV tile, so the
    rectangle of a split is that of its last tile. Where a window ends some KV
    tiles' Q ranges before the last Q tile there is no such rectangle: one
    split, no rectangle (rect = n_q), every tile walks its Q range ascending,
    which is ``shift`` under a window."""
    n_kv, n_q = g.n_kv, g.n_q
    split = np.zeros(n_kv, dtype=np.int64)
    begin = np.zeros(n_kv, dtype=np.int64)
    if not np.all(g.q_end == n_q) or np.any(np.diff(g.q_begin) < 0):
        return split, begin, np.full(n_kv, n_q, dtype=np.int64)
    qb = g.q_begin.astype(np.int64)
    s, start = 0, 0
    for kv in range(n_kv):
        size = kv - start + 1
        width = max((n_q - int(qb[kv])) >> STRIDE_LOG2, 1)
        wide = size > width and (per_wave is None or per_wave > width)
        # Tiles of one q_begin walk their Q tiles below the rectangle in step with each other:
        # a split holds tiles of one q_begin (no such walk) or of distinct ones.
        mixed = size > 2 and (qb[kv] == qb[kv - 1]) != (qb[kv - 1] == qb[kv - 2])
        if wide or mixed:
            s, start = s + 1, kv
        split[kv], begin[kv] = s, start
    last = np.concatenate([np.flatnonzero(np.diff(split)), [n_kv - 1]])  # last tile of each split
    rect = g.q_begin[last][split].astype(np.int64)
    return split, begin, rect


def _per_wave(H: int, section: int, num_sms: int) -> int:
    """The most KV tiles of one head in one wave of ``num_sms`` units: a head of a section of
    size k has every k-th unit of the section."""
    smallest = H - (-(-H // section) - 1) * section
    return -(-num_sms // smallest)


def _tasks(g: Geometry, num_sms: int, section: int = 0):
    """The rows (task-table order: by CTA, units ascending) and what the planned times derive from.
    ``section`` 0: the units head by head (``split``); else heads in sections of that many, a
    section's units KV tile by KV tile (``interleave``, :func:`.metadata.planned_unit`)."""
    n = g.n_kv
    H = g.num_heads_total
    S = num_sms
    split, begin, rect = split_layout(g, _per_wave(H, section, S) if section else None)
    U = H * n
    u = np.arange(U, dtype=np.int64)  # place in the launch order
    if section:
        first = (u // (section * n)) * section
        size = np.minimum(section, H - first)
        r = u - first * n
        u_head, kv_all = first + r % size, r // size
    else:
        first, size = u // n, np.ones(U, dtype=np.int64)
        u_head, kv_all = first, u % n
    assert np.array_equal(M.planned_unit(u_head, kv_all, n, section, H), u)
    u_cta, u_wave = u % S, u // S
    # the head's units in the unit's wave (its KV tiles kv with first*n + kv*size + (head - first) in
    # [wave*S, (wave+1)*S)), cut to its split
    off = first * n + (u_head - first)
    split_end = np.searchsorted(split, split, side="right")  # one past the split's last tile
    lo = np.clip(-((off - u_wave * S) // size), 0, n)
    hi = np.clip(-((off - (u_wave + 1) * S) // size), 0, n)
    pa = np.maximum(lo, begin[kv_all])
    pb = np.minimum(hi, split_end[kv_all])
    order = np.lexsort((u, u_cta))
    kv = kv_all[order]
    hidx = u_head[order]
    pa, pb, wave, cta = pa[order], pb[order], u_wave[order], u_cta[order]
    r = rect[kv]
    width = g.n_q - r
    slot = kv - pa
    cyc_off = (slot << STRIDE_LOG2) % np.maximum(width, 1)
    lens = g.task_len[kv]
    T = kv.size
    num_ctas = min(S, U)
    rows = np.zeros((T, M.NUM_COLS), dtype=np.int64)
    rows[:, M.C_BATCH], rows[:, M.C_HEAD], rows[:, M.C_KV] = hidx // g.heads, hidx % g.heads, kv
    rows[:, M.C_N_STEPS] = lens
    rows[:, M.C_CYC_LEN] = width
    rows[:, M.C_CYC_BASE] = r
    rows[:, M.C_CYC_OFF] = cyc_off
    rows[:, M.C_LIN_BASE] = g.q_begin[kv]
    rows[:, M.C_LIN_DIR] = 1
    rows[:, M.C_ROLE] = M.ROLE_LO
    rows[:, M.C_SEG_BEGIN], rows[:, M.C_SEG_END] = pa, pb
    rows[:, M.C_HEAD_KV] = (hidx % g.heads) // g.group
    rows[:, M.C_CTA] = cta
    rows[:, M.C_UNIT] = kv
    rows[:, M.C_SPLIT] = split[kv]
    rows[:, M.C_SPLIT_BEGIN] = begin[kv]
    rows[:, M.C_RECT] = r
    cta_offsets = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=num_ctas))])
    header = _header(INTERLEAVE if section else NAME, g, num_ctas, T, M.DISPATCH_STATIC, M.RANK_SPLIT, g.n_q, n, 0,
                     int(lens.sum()), num_ctas + 1, cyc_stride_log2=STRIDE_LOG2,
                     num_splits=int(split[-1]) + 1 if n else 1, head_section=section)
    meta = M.ScheduleMeta(header, _i32(cta_offsets), _i32(rows))
    return meta, hidx, kv, split[kv], r, slot, cyc_off, cta, wave, num_ctas


def _section(name: str, g: Geometry, num_sms: int) -> int:
    return head_section(g) if name == INTERLEAVE else 0


def build_metadata(name: str, g: Geometry, num_sms: int) -> M.ScheduleMeta:
    """The kernel's input of ``split`` or ``interleave`` from its rows alone (unvalidated)."""
    return _tasks(g, num_sms, _section(name, g, num_sms))[0]


def build(name: str, g: Geometry, num_sms: int) -> Schedule:
    """The ``split`` or ``interleave`` schedule with its visiting orders and planned-time ranks built
    from their definition (the module docstring); validation compares the decode with them."""
    meta, hidx, kv, spl, r, slot, cyc_off, cta, wave, num_ctas = _tasks(g, num_sms, _section(name, g, num_sms))
    T = kv.size
    parts, cache = [], {}
    for i in range(T):
        key = (int(kv[i]), int(cyc_off[i]))
        seq = cache.get(key)
        if seq is None:
            rect_leg = np.roll(np.arange(r[i], g.n_q, dtype=np.int64), -key[1])
            below = np.arange(g.q_begin[kv[i]], min(int(r[i]), int(g.q_end[kv[i]])), dtype=np.int64)
            seq = np.concatenate([rect_leg, below])
            cache[key] = seq
        parts.append(seq)
    step_q = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    lens = g.task_len[kv]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    step_task = np.repeat(np.arange(T, dtype=np.int64), lens)
    t = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[step_task]
    in_rect = step_q >= r[step_task]
    tie = np.where(in_rect, slot[step_task], -kv[step_task])
    gid = (spl[step_task] * g.num_heads_total + hidx[step_task]) * g.n_q + step_q
    rank = _ranks_by_key(gid, wave[step_task], t, tie)
    return Schedule(name=name, geometry=g, num_sms=num_sms, dispatch="static", num_ctas=num_ctas,
                    task_batch=hidx // g.heads, task_head=hidx % g.heads, task_kv=kv, task_cta=cta,
                    task_unit=kv, step_offsets=offsets, step_q=step_q, step_rank=rank,
                    step_wave=wave[step_task], step_time=t, meta=meta)


EXTRA_BUILDERS[NAME] = (build, build_metadata)
EXTRA_BUILDERS[INTERLEAVE] = (build, build_metadata)
