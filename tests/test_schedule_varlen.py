"""Backward schedules over packed documents (dash_fa3/schedule/varlen.py), on the CPU:
every document's tasks exactly once with its own schedule's rows, the documents' ranks
decoded with their own geometry form each dQ tile's full order, and the merged static
schedule runs to completion under the kernel's wait rule (a step waits until its dQ
tile's counter equals its rank): no deadlock."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, bwd_block_sizes
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.varlen import VARLEN_SCHEDULES, resolve_varlen_schedule, varlen_metadata

MASKS = [("full", -1, -1), ("causal", -1, 0), ("local", 100, 37)]


def doc_lengths(seed, same_qk):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    lq = rng.choice([0, 1, 63, 64, 129, 300, 700, 1000], size=n)
    lk = lq.copy() if same_qk else rng.choice([0, 1, 77, 300, 900], size=n)
    return tuple((int(a), int(b)) for a, b in zip(lq, lk))


def build(name, lengths, mask, hdim=128, heads=4, heads_kv=2, num_sms=13):
    kind, left, right = mask
    bm, bn = bwd_block_sizes(hdim)
    return varlen_metadata(name, lengths, max_seqlen_q=max(lq for lq, _ in lengths),
                           max_seqlen_k=max(lk for _, lk in lengths), heads=heads, heads_kv=heads_kv, block_m=bm,
                           block_n=bn, mask=kind, window_left=left, window_right=right, num_sms=num_sms)


def doc_header(meta, lq, lk):
    """The header of one document's geometry (the kernel takes it from cu_seqlens)."""
    h = meta.header.astype(np.int64).copy()
    h[M.H_BATCH], h[M.H_SEQLEN_Q], h[M.H_SEQLEN_K] = 1, lq, lk
    return h


def steps_by_row(meta, lengths):
    """Per task row of the merged table: the (q, rank) of each step, decoded with its document's geometry."""
    out = []
    for row in meta.tasks.astype(np.int64):
        b = int(row[M.C_BATCH])
        lq, lk = lengths[b]
        h = doc_header(meta, lq, lk)
        n = int(row[M.C_N_STEPS])
        out.append([M.decode_step(h.tolist(), row.tolist(), s) for s in range(n)])
    return out


@pytest.mark.parametrize("name", VARLEN_SCHEDULES)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m[0])
@pytest.mark.parametrize("seed", range(6))
def test_merged_schedule_covers_every_document_and_never_deadlocks(name, mask, seed):
    lengths = doc_lengths(seed, same_qk=seed % 2 == 0)
    if all(lk == 0 for _, lk in lengths):
        lengths = lengths + ((64, 64),)
    meta = build(name, lengths, mask)
    heads, bm, bn = 4, *bwd_block_sizes(128)
    tasks = meta.tasks.astype(np.int64)
    kind, left, right = mask
    # Every document with keys has a task per (q head, KV tile); none with an out-of-range tile.
    for b, (lq, lk) in enumerate(lengths):
        mine = tasks[tasks[:, M.C_BATCH] == b]
        n_kv = -(-lk // bn)
        assert sorted(map(tuple, mine[:, [M.C_HEAD, M.C_KV]])) == [(h, j) for h in range(heads) for j in range(n_kv)]
        if lq == 0:
            assert (mine[:, M.C_N_STEPS] == 0).all()
    # Ranks: per (document, head, Q tile), the steps' ranks are 0..n-1, n its KV tiles.
    steps = steps_by_row(meta, lengths)
    seen = {}
    for row, st in zip(tasks, steps):
        for q, rank in st:
            seen.setdefault((int(row[M.C_BATCH]), int(row[M.C_HEAD]), q), []).append(rank)
    for (b, h, q), ranks in seen.items():
        lq, lk = lengths[b]
        g = Geometry(batch=1, heads=heads, heads_kv=2, seqlen_q=lq, seqlen_k=lk, block_m=bm, block_n=bn,
                     mask=kind, window_left=left, window_right=right).tiles
        begin, end = g.kv_range(q)
        assert sorted(ranks) == list(range(end - begin))
    # Run the CTAs' lists under the wait rule, one step at a time, round robin.
    offsets = meta.offsets.astype(np.int64)
    pos = [[int(offsets[c]), 0] for c in range(len(offsets) - 1)]  # (row, step)
    counter = {}
    progress = True
    while progress:
        progress = False
        for c, (row, step) in enumerate(pos):
            while row < offsets[c + 1]:
                st = steps[row]
                if step == len(st):
                    row, step = row + 1, 0
                    continue
                q, rank = st[step]
                key = (int(tasks[row, M.C_BATCH]), int(tasks[row, M.C_HEAD]), q)
                if counter.get(key, 0) != rank:
                    break
                counter[key] = rank + 1
                step += 1
                progress = True
            pos[c] = [row, step]
    assert all(row == offsets[c + 1] for c, (row, _) in enumerate(pos)), "the merged schedule deadlocks"


def test_longest_document_first_and_header():
    lengths = ((100, 100), (2000, 2000), (0, 300), (5, 0))
    meta = build("spt", lengths, MASKS[1])
    h = meta.header_dict()
    assert h["batch"] == 4 and h["seqlen_q"] == 2000 and h["seqlen_k"] == 2000 and h["dispatch"] == M.DISPATCH_STATIC
    assert h["num_tasks"] == meta.tasks.shape[0] and h["offsets_len"] == h["num_ctas"] + 1
    # The first task of every CTA belongs to the longest document.
    firsts = meta.tasks[meta.offsets[:-1], M.C_BATCH]
    assert (firsts == 1).all()


def test_schedule_names():
    assert resolve_varlen_schedule("auto", True) == "spt" and resolve_varlen_schedule("auto", False) == "lpt"
    for name in ("shift", "symmetric_shift"):
        with pytest.raises(ValueError, match="does not run on packed documents"):
            resolve_varlen_schedule(name, True)
    with pytest.raises(ValueError, match="unknown schedule"):
        resolve_varlen_schedule("nope", True)
    with pytest.raises(ValueError, match="smaller than the longest document"):
        varlen_metadata("fa3", ((10, 10),), max_seqlen_q=5, max_seqlen_k=10, heads=1, heads_kv=1, block_m=64,
                        block_n=128, mask="full", window_left=-1, window_right=-1, num_sms=4)
