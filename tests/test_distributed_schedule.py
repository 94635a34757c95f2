"""The fold schedules as data (dash_fa3.distributed.folds) and the layouts they rest on: balance,
validation of broken schedules, rank programs, the alpha-beta model and the plan CLI. No processes."""

import json

import numpy as np
import pytest

from dash_fa3.distributed import cli
from dash_fa3.distributed import folds as S
from dash_fa3.distributed import layout as L
from dash_fa3.distributed.model import CPCostModel


def fold_loads(s):
    """Per-rank block GEMMs of a schedule (3 + 4 per backward pair, no sharing)."""
    g = np.array([S.GEMMS[k] for k in S.FOLD_KINDS])[s.works[:, 0]]
    return np.bincount(s.works[:, 2], weights=(s.works[:, 5] - s.works[:, 4]) * g, minlength=s.num_ranks)


# ------------------------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_layouts_own_every_block_once(P):
    nb = 2 * P * 3
    for layout in L.LAYOUTS:
        owner = L.block_owners(layout, P, nb)
        assert sorted(np.concatenate([L.local_blocks(layout, P, nb, r) for r in range(P)]).tolist()) == list(range(nb))
        assert np.bincount(owner, minlength=P).tolist() == [nb // P] * P
    z = L.block_owners("zigzag", P, nb).reshape(2 * P, 3)[:, 0]
    assert z.tolist() == list(range(P)) + list(range(P))[::-1]


def test_check_seqlen_says_which_lengths_work():
    assert L.check_seqlen(6144, 3) == 48
    with pytest.raises(ValueError,
                       match=r"multiple of 2\*P\*128 = 768: 768, 1536, 2304, \.\.\. \(nearest: 4608 or 5376\)"):
        L.check_seqlen(5000, 3)
    for bad in (0, -768, 768.0, True):
        with pytest.raises(ValueError):
            L.check_seqlen(bad, 3)
    with pytest.raises(ValueError, match="number of ranks"):
        L.check_seqlen(768, 0)


# ------------------------------------------------------------------------------------------- builds

@pytest.mark.parametrize("fanout", [None, 1, 2])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
def test_built_schedules_validate(P, fanout):
    n = 2 * P * L.G * 2
    for layout in L.LAYOUTS:
        for assignment in S.ASSIGNMENTS:
            for causal in (True, False):
                for pass_ in S.PASSES:
                    s = S.build(P, n, causal=causal, pass_=pass_, layout=layout, assignment=assignment, fanout=fanout)
                    rep = S.validate(s)
                    assert rep.num_works == len(s.works) and rep.num_steps == s.num_steps


@pytest.mark.parametrize("P", [2, 3, 4, 5, 7, 8])
def test_helper_worker_balances_causal_work(P):
    n = 2 * P * L.G * 8
    for pass_ in S.PASSES:
        hw = fold_loads(S.build(P, n, causal=True, pass_=pass_))
        none = fold_loads(S.build(P, n, causal=True, pass_=pass_, assignment="owner"))
        zig = fold_loads(S.build(P, n, causal=True, pass_=pass_, layout="zigzag"))
        assert hw.sum() == none.sum() == zig.sum()
        assert hw.max() / hw.mean() < 1.03, (pass_, hw)
        assert zig.max() / zig.mean() < 1.1, (pass_, zig)
        if pass_ == "fwd":   # rank P-1 has about (2P-1)/P times the mean without balancing
            assert none.max() / none.mean() > 1.4


def test_helper_worker_moves_whole_folds_and_returns_results():
    s = S.build(4, 4096, causal=True, pass_="fwd")
    moved = [w for w in s.work_list() if w.rank != s.owner[w.block]]
    assert moved, "helper-worker moved no fold"
    returned = {(b, t.src, t.dst) for t in s.transfer_list() if t.kind == "o" for b in range(t.lo, t.hi)}
    for w in moved:
        assert (w.block, w.rank, int(s.owner[w.block])) in returned
    # odd P: the middle rank neither helps nor is helped
    s = S.build(5, 5 * 2560, causal=True, pass_="fwd")
    mid = {int(b) for b in L.local_blocks("contiguous", 5, s.num_blocks, 2)}
    assert all(w.rank == 2 for w in s.work_list() if w.block in mid)
    assert not any(w.rank == 2 for w in s.work_list() if w.block not in mid)


def test_full_mask_needs_no_balancing():
    a = S.build(4, 4096, causal=False, pass_="bwd")
    b = S.build(4, 4096, causal=False, pass_="bwd", assignment="owner")
    assert np.array_equal(a.works, b.works)


def test_no_all_gather_when_causal_needs_less():
    """Contiguous causal: rank r receives K/V of the blocks before its own, nothing after."""
    P = 4
    s = S.build(P, 4096, causal=True, pass_="fwd", assignment="owner", fanout=None)
    nb = s.num_blocks
    for r in range(P):
        got = {b for t in s.transfer_list() if t.dst == r and t.kind == "kv" for b in range(t.lo, t.hi)}
        assert got == set(range(r * nb // P))


# ------------------------------------------------------------------------------- broken schedules

def base(pass_="fwd", P=4, causal=True, **kw):
    return S.build(P, 2 * P * L.G * 2, causal=causal, pass_=pass_, **kw)


def reject(s, match):
    with pytest.raises(S.DistScheduleError, match=match):
        S.validate(s)


def test_rejects_missing_pair():
    s = base()
    w = s.work_list()
    i = next(i for i, x in enumerate(w) if x.hi - x.lo > 1)
    w[i] = w[i]._replace(hi=w[i].hi - 1)
    reject(s.with_records(works=w), "misses kv block")
    w = s.work_list()
    del w[0]
    reject(s.with_records(works=w), r"misses kv|no work computes")


def test_rejects_duplicate_pair():
    s = base("bwd")
    w = s.work_list()
    x = next(x for x in w if x.kind == "bwd_dkv")
    w.append(x._replace(step=s.num_steps + 1))
    reject(s.with_records(works=w), "twice")


def test_rejects_descending_fold():
    s = base(P=2, fanout=None)
    w = s.work_list()
    i, j = (i for i, x in enumerate(w) if x.block == s.num_blocks - 1 and x.kind == "fwd_q")
    w[i], w[j] = w[i]._replace(step=w[j].step), w[j]._replace(step=w[i].step)
    reject(s.with_records(works=w), "ascending order")


def test_rejects_masked_pair_and_split_fold():
    s = base()
    w = s.work_list()
    i = next(i for i, x in enumerate(w) if x.hi == x.block + 1)
    w[i] = w[i]._replace(hi=w[i].hi + 1)
    reject(s.with_records(works=w), "causal mask excludes")
    w = s.work_list()
    i = next(i for i, x in enumerate(w) if sum(y.block == x.block for y in w) > 1)
    w[i] = w[i]._replace(rank=(w[i].rank + 1) % s.num_ranks)
    reject(s.with_records(works=w), "split over ranks")


def test_rejects_transfer_from_a_rank_without_the_data():
    s = base(fanout=None)
    t = s.transfer_list()
    i = next(i for i, x in enumerate(t) if x.kind == "q")
    # a rank that neither owns this q block nor receives it (else it could legally relay it)
    other = next(r for r in range(s.num_ranks) if r != s.owner[t[i].lo]
                 and not any(y.dst == r and y.kind == "q" and y.lo <= t[i].lo < y.hi for y in t))
    t[i] = t[i]._replace(src=other)
    reject(s.with_records(transfers=t), f"rank {other} lacks q")


def test_rejects_work_without_its_inputs_and_lost_results():
    s = base(fanout=None)
    t = s.transfer_list()
    reject(s.with_records(transfers=[x for x in t if x.kind != "kv"]), "lacks kv of")
    reject(s.with_records(transfers=[x for x in t if x.kind != "o"]), "never reaches its owner")
    # a result can travel only after the step that finishes it
    last = {}
    for w in s.work_list():
        last[w.block] = max(last.get(w.block, 0), w.step)
    i = next(i for i, x in enumerate(t) if x.kind == "o")
    t[i] = t[i]._replace(step=last[t[i].lo])
    reject(s.with_records(transfers=t), "lacks o")


def test_rejects_cyclic_relay_and_redundant_transfer():
    s = base(P=4, fanout=None)
    t = s.transfer_list()
    # ranks 1 and 2 each wait for the other to forward rank 3's q block: neither ever can
    t += [S.Transfer("q", 12, 13, 1, 2, 0), S.Transfer("q", 12, 13, 2, 1, 0)]
    reject(s.with_records(transfers=t), "cyclic wait at step 0")
    t = s.transfer_list() + [S.Transfer("kv", 0, 1, 0, 1, 2)]   # rank 1 got it at step 0
    reject(s.with_records(transfers=t), "already holds")


def test_rejects_out_of_range_and_wrong_kinds():
    s = base()
    w = s.work_list()
    w[0] = w[0]._replace(rank=s.num_ranks)
    reject(s.with_records(works=w), "out of range")
    reject(s.with_records(transfers=s.transfer_list() + [S.Transfer("dq", 0, 1, 0, 1, 0)]), "kind must be")
    reject(s.with_records(transfers=s.transfer_list() + [S.Transfer("q", 0, 1, 0, 0, 0)]), "own rank")


def test_relays_form_waves_within_a_step():
    s, rep = S.get_schedule(8, 2048, True, "fwd", "contiguous", None, 1)
    assert rep.max_wave >= 1
    t = s.transfer_list()
    for i, x in enumerate(t):
        if rep.waves[i] > 0:   # a later wave forwards what an earlier wave of the step delivered
            feeders = [j for j, y in enumerate(t) if y.dst == x.src and y.kind == x.kind and y.step == x.step
                       and y.lo <= x.lo and x.hi <= y.hi]
            assert feeders and all(rep.waves[j] < rep.waves[i] for j in feeders)


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("P", [3, 8])
def test_rank_programs_agree_on_every_message(P, layout):
    """Sender and receiver post the same message (step, wave, packing), including ranks whose
    first message of a step is in a later wave."""
    for pass_ in S.PASSES:
        s, rep = S.get_schedule(P, 2 * P * L.G * 2, True, pass_, layout)
        progs = [S.rank_program(s, rep, r) for r in range(P)]
        sent, received = {}, {}
        for r, prog in enumerate(progs):
            for st in prog:
                for v, (sends, recvs) in enumerate(st.waves):
                    for m in sends:
                        assert (m.step, m.wave) == (st.step, v)
                        sent[(r, m.peer, m.step, m.wave)] = m.transfers
                    for m in recvs:
                        assert (m.step, m.wave) == (st.step, v)
                        received[(m.peer, r, m.step, m.wave)] = m.transfers
        assert sent == received and len(sent) == rep.num_messages


# -------------------------------------------------------------------------------------- simulator

@pytest.mark.parametrize("schedule", list(S.PRESETS))
def test_efficiency_at_most_one(schedule):
    for P in (1, 2, 4, 8):
        for n in (2 * P * L.G * 16, 65536):
            for causal in (True, False):
                r = S.simulate(P, n, causal=causal, schedule=schedule)
                assert 0 < r.efficiency <= 1.0 + 1e-9
                assert r.fwd.time >= r.fwd.compute.max() and r.bwd.time >= r.bwd.compute.max()


def test_one_rank_is_the_single_gpu_kernel():
    r = S.simulate(1, 65536, causal=True, schedule="helper_worker", cost=CPCostModel(launch_us=0))
    assert r.efficiency == pytest.approx(1.0)
    assert r.bwd.gemms == r.bwd.gemms_single   # one rank shares S/P/dS between its two folds


@pytest.mark.parametrize("P", [2, 4, 8])
def test_balancing_pays_for_causal(P):
    hw = S.simulate(P, 131072, causal=True, schedule="helper_worker")
    zz = S.simulate(P, 131072, causal=True, schedule="zigzag")
    nb = S.simulate(P, 131072, causal=True, schedule="no_balance")
    assert hw.time_ms < nb.time_ms and zz.time_ms < nb.time_ms
    assert abs(hw.time_ms - zz.time_ms) / hw.time_ms < 0.1
    # the price of row-complete folds: backward GEMMs grow towards 7/5 of one GPU's
    assert 1.15 < hw.bwd.gemms / hw.bwd.gemms_single < 1.4


def test_slower_links_cost_time():
    fast = S.simulate(8, 65536, cost=CPCostModel(beta_gbs=400))
    slow = S.simulate(8, 65536, cost=CPCostModel(beta_gbs=25))
    late = S.simulate(8, 65536, cost=CPCostModel(alpha_us=500))
    assert slow.time_ms > fast.time_ms and late.time_ms > fast.time_ms


def test_model_scales_to_64_ranks_and_1m_tokens():
    r = S.simulate(64, 1 << 20, causal=True, schedule="helper_worker")
    assert 0 < r.efficiency < 1 and r.num_ranks == 64


# ------------------------------------------------------------------------------------------- CLI

def test_cli_table_and_json(capsys):
    assert cli.main(["plan", "--algorithm", "folds", "--P", "2,4", "--seqlen", "64k", "--schedule", "all"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in S.PRESETS) and "efficiency" in out
    assert cli.main(["plan", "--algorithm", "folds", "--P", "2", "--seqlen", "4096", "--full", "--json",
                     "--heads", "8/2"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {r["variant"] for r in rows} == {"helper_worker", "zigzag"}
    assert all(r["causal"] is False and 0 < r["efficiency"] <= 1 for r in rows)


def test_cli_models_every_algorithm_with_its_own_cost_defaults(capsys):
    """One CLI for the four plans; a cost left unset takes each algorithm's default, so the rows
    equal the algorithms' own simulate()."""
    assert cli.main(["plan", "--P", "2", "--seqlen", "64k", "--layout", "contiguous", "--schedule",
                     "helper_worker", "--json"]) == 0
    rows = {r["algorithm"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"heads", "runs", "folds", "superblocks"}
    from dash_fa3.distributed import heads, runs, superblocks
    assert rows["superblocks"]["efficiency"] == superblocks.simulate(2, 65536).efficiency
    assert rows["heads"]["efficiency"] == heads.simulate(2, 65536).efficiency
    assert rows["runs"]["efficiency"] == runs.simulate(2, 65536).efficiency
    assert rows["folds"]["efficiency"] == S.simulate(2, 65536).efficiency
    # an explicit parameter applies to every algorithm
    assert cli.main(["plan", "--P", "2", "--seqlen", "64k", "--algorithm", "heads", "--layout", "contiguous",
                     "--beta-gbs", "10", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["efficiency"] == heads.simulate(2, 65536, beta_gbs=10.0).efficiency < rows["heads"]["efficiency"]


@pytest.mark.parametrize("argv,match", [
    (["--P", "0"], "positive ints"),
    (["--P", "3", "--seqlen", "1000"], "multiple of 2"),
    (["--schedule", "ring"], "unknown schedule"),
    (["--algorithm", "ring"], "unknown algorithm"),
    (["--P", "128"], "P <= 64"),
    (["--heads", "3/2"], "multiple of heads_kv"),
    (["--heads", "0"], "positive ints"),
    (["--heads", "100000"], "at most 1024 heads"),
    (["--algorithm", "heads", "--P", "8", "--heads", "16/4"], "heads_kv >= P"),
    (["--seqlen", "100m"], "at most 4194304 tokens"),
    (["--seqlen", "99999999999999999999"], "positive ints"),
    (["--algorithm", "folds", "--P", "64", "--seqlen", "2m"], "P x tokens"),
    (["--headdim", "80"], "head dim 80 is not supported"),
    (["--beta-gbs", "0"], "> 0"),
    (["--beta-gbs", "nan"], "finite"),
    (["--fwd-tflops", "inf"], "finite"),
    (["--alpha-us", "-1"], ">= 0"),
    (["--diag", "inf"], "finite"),
    (["--hbm-gbs", "x"], "expected a number"),
    (["--fanout", "-1"], "between 0 and 64"),
    (["--diag", "2"], "<= 1"),
    (["--bogus"], "unrecognized"),
])
def test_cli_rejects_bad_arguments_in_one_line(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err, err


def test_cli_needs_its_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2 and "plan" in capsys.readouterr().err


def test_cost_model_refuses_non_finite_and_negative_parameters():
    for field, bad in (("beta_gbs", 0.0), ("beta_gbs", float("nan")), ("alpha_us", -1.0), ("diag", float("inf")),
                       ("fwd_tflops", True)):
        with pytest.raises(ValueError, match=field):
            CPCostModel(**{field: bad})
