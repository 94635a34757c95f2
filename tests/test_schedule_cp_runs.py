"""The run plan of the GPU context-parallel path (dash_fa3/distributed/runs.py)."""

import dataclasses

import pytest

from dash_fa3.distributed import runs as cp_runs
from dash_fa3.distributed.layout import G

CASES = [(P, n, causal, layout) for P in (1, 2, 3, 4, 8) for n in (2 * P * G * 4, 2 * P * G * 37)
         for causal in (True, False) for layout in ("contiguous", "zigzag")]


@pytest.mark.parametrize("P,n,causal,layout", CASES)
def test_plan_covers_every_query_block_once_and_balances(P, n, causal, layout):
    p = cp_runs.plan(P, n, causal, layout)
    blocks = sorted(b for runs in p.runs for lo, hi in runs for b in range(lo, hi))
    assert blocks == list(range(p.num_blocks))
    tiles = [p.tiles(r) for r in range(P)]
    total = p.num_blocks * (p.num_blocks + 1) // 2 if causal else p.num_blocks ** 2
    assert sum(tiles) == total
    # the largest rank's work within one block row of the mean (the cut granularity)
    assert max(tiles) - total / P <= p.num_blocks, (tiles, total / P)


@pytest.mark.parametrize("P,n,causal,layout", CASES)
def test_local_runs_come_first_and_need_only_own_blocks(P, n, causal, layout):
    p = cp_runs.plan(P, n, causal, layout)
    for r in range(P):
        flags = [p.run_is_local(r, lo, hi) for lo, hi in p.runs[r]]
        assert flags == sorted(flags, reverse=True), (r, p.runs[r])
        for lo, hi in p.runs[r]:
            if p.run_is_local(r, lo, hi):
                assert all(p.owner[b] == r for b in range(0, p.kv_end(lo, hi)))
                assert all(p.owner[b] == r for b in range(lo, hi))


def test_causal_contiguous_rank0_helps_rank1():
    """Two ranks, causal: the equal-work cut lies at about N/sqrt(2), so rank 0 computes rows of
    rank 1 (helper-worker) and has a local run to start with."""
    p = cp_runs.plan(2, 2 * 2 * G * 64, True, "contiguous")
    nb = p.num_blocks
    (lo0, hi0), (lo1, hi1) = p.runs[0]
    assert (lo0, hi0) == (0, nb // 2) and lo1 == nb // 2 and abs(hi1 / nb - 2 ** -0.5) < 2 / nb
    assert p.runs[1] == ((hi1, nb),)
    assert p.rows_from(0, 1) == [(nb // 2, hi1)] and p.rows_from(1, 0) == []
    assert p.kv_from(1, 0) == [(0, nb // 2)] and p.kv_from(0, 1) == [(nb // 2, hi1)]
    assert p.kv_need(0) == hi1 and p.kv_need(1) == nb


@pytest.mark.parametrize("P,n,causal,layout", CASES)
def test_messages_pair_up(P, n, causal, layout):
    """What a rank receives from a peer is what that peer sends to it: the runtime posts both
    sides from these tables, in the same order."""
    p = cp_runs.plan(P, n, causal, layout)
    for r in range(P):
        for peer in range(P):
            if peer == r:
                continue
            for lo, hi in p.kv_from(r, peer):
                assert all(p.owner[b] == peer for b in range(lo, hi))
                assert hi <= p.kv_need(r)
            for lo, hi in p.rows_from(r, peer):
                assert all(p.owner[b] == peer for b in range(lo, hi))
                assert any(a <= lo and hi <= b for a, b in p.runs[r])


def test_validate_rejects_overlap_and_gaps():
    p = cp_runs.plan(2, 2 * 2 * G * 4, True, "contiguous")
    twice = dataclasses.replace(p, runs=(p.runs[0] + ((0, 1),), p.runs[1]))
    with pytest.raises(ValueError, match="computed 2 times"):
        cp_runs.validate(twice)
    gap = dataclasses.replace(p, runs=(p.runs[0][:1], p.runs[1]))
    with pytest.raises(ValueError, match="computed 0 times"):
        cp_runs.validate(gap)
    with pytest.raises(ValueError, match="empty or outside"):
        cp_runs.validate(dataclasses.replace(p, runs=(((3, 3),), p.runs[1])))


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="multiple of 2\\*P\\*128"):
        cp_runs.plan(2, 1000, True, "contiguous")


def test_simulate_is_balanced_and_below_one():
    sim = cp_runs.simulate(2, 128 * 1024, causal=True)
    assert max(sim.compute_ms) / min(sim.compute_ms) < 1.01
    assert 0.8 < sim.efficiency < 1.0
    # communication matters more at a shorter sequence
    assert cp_runs.simulate(2, 16 * 1024, causal=True).efficiency < sim.efficiency


def test_cli_prints_one_row_per_rank_count(capsys):
    import json

    from dash_fa3.distributed import cli

    assert cli.main(["plan", "--algorithm", "runs", "--P", "2,3,8", "--seqlen", "48k,96k", "--layout", "contiguous",
                     "--heads", "16", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    # 48k and 96k split into whole blocks for P = 2, 3 (64 x 768) and 8 (24 x 2048)
    assert [(r["seqlen"], r["P"]) for r in rows] == [(n, P) for n in (49152, 98304) for P in (2, 3, 8)]
    eff = {(r["seqlen"], r["P"]): r["efficiency"] for r in rows}
    assert all(0.5 < e <= 1.0 for e in eff.values()), rows
    assert all(eff[(98304, P)] >= eff[(49152, P)] for P in (2, 3, 8)), rows   # longer hides more communication
