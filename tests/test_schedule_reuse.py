"""The model's L2 working set (model.reuse, model.calibration.working_set_bytes): reuse distances
over a run's accesses and the median the HBM floor of predict_ms is decided by."""

from types import SimpleNamespace

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, get_schedule
from dash_fa3.schedule.model.calibration import working_set_bytes
from dash_fa3.schedule.model.reuse import median_reuse_bytes, reuse_distances


def _brute(key, time, nbytes):
    """{access: bytes of the accesses strictly between it and its key's previous access}."""
    n = len(key)
    out = {}
    for i in range(n):
        prev = [j for j in range(n) if key[j] == key[i] and (time[j], j) < (time[i], i)]
        if prev:
            p = max(prev, key=lambda j: (time[j], j))
            out[i] = sum(int(nbytes[j]) for j in range(n) if time[p] < time[j] < time[i])
    return out


def test_reuse_distances_against_a_direct_count():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        key, time = rng.integers(0, 5, n), rng.integers(0, 12, n).astype(float)   # ties on purpose
        nbytes = rng.integers(1, 9, n)
        access, dist = reuse_distances(key, time, nbytes)
        assert dict(zip(access.tolist(), dist.tolist())) == _brute(key, time, nbytes)


def test_median_reuse_bytes_by_hand():
    # a b a b c a: a's reuses see b (2 bytes) and then b, c (2 + 5); b's sees a (1)
    key, time, nbytes = [0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5], [1, 2, 1, 2, 5, 1]
    access, dist = reuse_distances(key, time, nbytes)
    assert dict(zip(access.tolist(), dist.tolist())) == {2: 2, 3: 1, 5: 7}
    # needs (distance + own bytes): a 3, b 3, a 8; weighted by their bytes 1, 2, 1: median 3
    assert median_reuse_bytes(key, time, nbytes) == 3
    # weighted toward the last reuse of a: its 8 bytes
    assert median_reuse_bytes(key, time, nbytes, weight=[1, 1, 1, 1, 1, 10]) == 8
    assert median_reuse_bytes([0, 1, 2], [0, 1, 2], 4) == 0   # nothing read twice


def _run(s, start):
    """A run of ``s`` with the given step starts, each add issued half a step later."""
    start = np.asarray(start, dtype=float)
    return SimpleNamespace(step_start=start, step_reduce_start=start + 0.5)


@pytest.mark.parametrize("n_q", [8, 16])
def test_working_set_of_a_sweep_by_hand(n_q):
    """One head, two KV tiles (fa3: task t over Q tiles 0..n_q-1 ascending). Per Q tile, u = block_m
    x headdim elements: Q and dO 4u bytes, the fp32 accumulator 4u; a miss moves 4u and 8u.

    Two CTAs one step apart (step j of task t at t + j): Q tile j is read again one step later with
    two adds in between (8u), its accumulator one step later with two Q reads in between: 12u
    with its own 4u, whatever n_q (the tiles at the ends need 8u and weigh little). One CTA
    running both tasks (step j of task t at n_q t + j) reads everything else of the head in
    between: all of it, n_q x 8u, what counting every tile of the head gives."""
    g = Geometry.from_shape(batch=1, heads=1, seqlen_q=64 * n_q, seqlen_k=256, headdim=128, causal=False)
    s = get_schedule("fa3", g, 2)
    assert s.task_kv.tolist() == [0, 1] and s.step_q.tolist() == list(range(n_q)) * 2
    u = g.block_m * 128
    j = np.tile(np.arange(n_q), 2)
    t = np.repeat([0, 1], n_q)
    assert working_set_bytes(s, 128, _run(s, t + j)) == 12 * u
    assert working_set_bytes(s, 128, _run(s, n_q * t + j)) == n_q * 8 * u


def test_working_set_is_simulated_when_not_given():
    g = Geometry.from_shape(batch=2, heads=4, seqlen_q=1024, headdim=128, causal=True)
    s = get_schedule("lpt", g, 16)
    from dash_fa3.schedule.model.calibration import H100
    from dash_fa3.schedule.model.simulate import simulate
    sim = simulate(s, H100.cost_model(128, g), num_sms=132)
    assert working_set_bytes(s, 128) == working_set_bytes(s, 128, sim) > 0
