"""The L2 working set of a simulated run, from the reuse distances of its accesses.

An access to a datum that the run read before hits in a least-recently-used cache if the
cache holds every other datum touched since that earlier access: the *reuse distance*, in
bytes. The distance taken here is the bytes of all accesses in between (a datum touched
twice in between counts twice), an upper bound of the distinct bytes that is one prefix sum
and a binary search per access. The working set is the cache size that serves half of the
reads again: the weighted median of (reuse distance + the datum's bytes), each read weighted
by what its miss would move from HBM. An access with no earlier one (the first read of each
datum) misses at any size and is left out.

Why a median of distances and not the bytes of every tile in use at once, or held between
uses at once: a schedule keeps its L2 busy with tiles it reads again soon (the CTAs sweeping
one head's Q range side by side, each tile read by one CTA after another a step apart) and
holds others it reads again only after a long while (the next wave of tasks, the next pass
of a CTA over its own tiles). The first kind costs a stream from HBM on every step once the
cache cannot hold it; the second costs one reload per long gap. Whether a step's data
streams from HBM is whether its typical reuse fits, which the median says; the peak of the
bytes held between uses counts the long gaps too (the grouped view of an MQA shape: every
tile of both waves, over the L2 size, though each is reloaded once per wave). The weights
matter where the kinds of data part ways: in ``runs`` under MQA the CTAs of a batch read
each Q and dO tile one after another, while each CTA's own dQ accumulators wait a whole pass:
most Q and dO reads hit and every accumulator read misses, and a missed accumulator is read
and written back, so the plain median of the reads sits among the hits (25 MiB at
2x1024x16384 32/1) and the weighted one among the misses (131 MiB).

:func:`schedule_working_set` applies this to the backward's steps: the Q and dO tiles
(16-bit) a step's MMA loads, at its start, and the fp32 dQ accumulator tile its add reads
and writes (one per dQ split), at the add's issue. K and V are not counted: a task reads
its KV tile once, into shared memory.
"""

from __future__ import annotations

import numpy as np


def reuse_distances(key, time, nbytes) -> tuple[np.ndarray, np.ndarray]:
    """(access, distance) per access that reads its datum again: its index and the bytes of all
    accesses strictly between it and the datum's previous access (by time). One entry per
    access: the datum's ``key`` (int), the access's ``time`` and the datum's ``nbytes`` (a scalar
    or one per access). Accesses at one instant are not between each other."""
    key = np.asarray(key, dtype=np.int64)
    time = np.asarray(time, dtype=float)
    nb = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), key.shape)
    n = key.size
    by_time = np.argsort(time, kind="stable")
    ts = time[by_time]
    before = np.concatenate([[0], np.cumsum(nb[by_time])])   # bytes of the first i accesses by time
    # the first position of each position's instant, and the one after its last
    idx = np.arange(n, dtype=np.int64)
    new = np.ones(n, dtype=bool)
    new[1:] = ts[1:] != ts[:-1]
    first = np.maximum.accumulate(np.where(new, idx, 0))
    last = np.minimum.accumulate(np.where(np.append(new[1:], True), idx + 1, n)[::-1])[::-1]
    # positions by key, in time order within a key
    kt = key[by_time]
    o = np.argsort(kt, kind="stable")
    same = kt[o][1:] == kt[o][:-1]
    prev, cur = o[:-1][same], o[1:][same]
    return by_time[cur], np.maximum(before[first[cur]] - before[last[prev]], 0)


def median_reuse_bytes(key, time, nbytes, weight=None) -> int:
    """The cache size that serves half of the reuses (module doc): the weighted median of reuse
    distance + the datum's bytes over the accesses of :func:`reuse_distances`, each weighted by
    ``weight`` (a scalar or one per access; None: ``nbytes``); 0 where nothing is read twice."""
    nb = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), np.shape(key))
    w = nb if weight is None else np.broadcast_to(np.asarray(weight, dtype=float), nb.shape)
    access, d = reuse_distances(key, time, nb)
    if not access.size:
        return 0
    need = d + nb[access]
    o = np.argsort(need, kind="stable")
    cw = np.cumsum(w[access][o])
    return int(need[o][np.searchsorted(cw, cw[-1] / 2.0)])


def schedule_working_set(schedule, sim, headdim: int) -> int:
    """Bytes of the L2 working set (:func:`median_reuse_bytes`) of ``schedule`` run as ``sim`` (a
    :class:`.simulate.SimResult` of it, per-step times in schedule step order).

    Q and dO of tile (batch, head, q): read by each step on it at its start, block_m x headdim x
    (2 + 2) bytes. The fp32 dQ accumulator of (batch, head, q, dQ split): read and written by each
    step's add, at its issue, block_m x headdim x 4 bytes. A grouped schedule's steps are those of
    its view (heads: the KV heads, Q tiles: the group's virtual tiles, each one query head's tile),
    so each real tile keeps a key of its own. The dQ split of a step is its task's metadata row's
    (rows and tasks are in one order)."""
    from .. import metadata as M
    g = schedule.geometry
    rows = schedule.meta.tasks
    if rows.shape[0] != schedule.num_tasks:
        raise ValueError(f"{schedule.name}: {rows.shape[0]} metadata rows for {schedule.num_tasks} tasks")
    if not schedule.num_steps:
        return 0
    task = schedule.step_task
    q = np.asarray(schedule.step_q, dtype=np.int64)
    hidx = np.asarray(schedule.task_batch, dtype=np.int64)[task] * g.heads + np.asarray(schedule.task_head)[task]
    tile = hidx * (int(q.max()) + 1) + q
    split = rows[:, M.C_SPLIT].astype(np.int64)[task]
    acc = tile * (int(split.max()) + 1) + split + int(tile.max()) + 1   # after every Q/dO key
    per_tile = g.block_m * headdim
    key = np.concatenate([tile, acc])
    time = np.concatenate([sim.step_start, sim.step_reduce_start])
    nbytes = np.concatenate([np.full(tile.size, per_tile * (2 + 2)), np.full(acc.size, per_tile * 4)])
    # a miss costs what the step moves from HBM: Q and dO read, the accumulator read and written
    weight = np.concatenate([np.full(tile.size, 2 + 2), np.full(acc.size, 4 + 4)])
    return median_reuse_bytes(key, time, nbytes, weight)
