"""The kernel's pipeline in the simulator (CostModel.pipeline == "writer"):
per CTA, the MMA warps run the steps back to back and hand each partial dQ to
a dQ-writer warp through one of two shared-memory buffers; the writer waits
for the semaphore and adds.  Small cases checked by hand."""

import math

import numpy as np
import pytest

from dash_fa3.schedule import SCHEDULES, CostModel, Geometry, critical_path, get_schedule, simulate
from dash_fa3.schedule.lowering import lower_to_static


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


def test_full_fa3_chain_waits_land_on_the_writer():
    """fa3, full mask, n = 4 KV tiles = 4 SMs, one head, c = 1, r = 0.5.
    Every task visits Q tiles 0..3 from t = 0; KV tile k's add into tile q waits
    for KV tile k-1's: its writer starts it at q + 1 + 0.5 k.  The MMA warps
    never wait (the lag of 1.5 at most is below two buffers of 1 each), so
    every CTA's computes end at 4 and the last add (k = 3, q = 3) completes at
    4 + 1.5 + 0.5 = 6, where the paper's serial model needs
    m n (c + r) + (n - 1) r = 7.5."""
    s = get_schedule("fa3", Geometry.model(4, 1, "full"), 4)
    sim = simulate(s, CostModel(1.0, 0.5))
    assert close(sim.makespan, 6.0)
    assert sim.buffer_stalls == 0 and sim.buffer_stall_time == 0.0
    # 3 waiting KV tiles x 4 Q tiles; waits 0.5, 1, 1.5 per add of KV tile 1, 2, 3
    assert sim.waits == 12 and close(sim.wait_time, 4 * (0.5 + 1.0 + 1.5))
    kv = s.task_kv[s.step_task]
    assert np.allclose(sim.step_reduce_start, s.step_q + 1 + 0.5 * kv)
    assert np.allclose(sim.step_handoff, s.step_q + 1)      # the MMA warps never stalled
    assert np.allclose(sim.task_end, 4.0)                   # epilogue 0 after the last hand-off
    serial = simulate(s, CostModel(1.0, 0.5, pipeline="serial"))
    assert close(serial.makespan, 7.5)


def test_slow_writer_exhausts_the_buffers():
    """Same shape, r = 1: KV tile 3's adds start at q + 4, its buffers free at
    q + 5, so its MMA stalls from its third step on (a hand-off needs the
    buffer of two steps before)."""
    s = get_schedule("fa3", Geometry.model(4, 1, "full"), 4)
    sim = simulate(s, CostModel(1.0, 1.0))
    kv = s.task_kv[s.step_task]
    stalled = sim.step_handoff - sim.step_compute_end > 1e-9
    assert stalled.any() and not stalled[kv == 0].any()
    # a hand-off waits only for its buffer: the add two steps before on the CTA has read it
    for k in range(s.num_steps):
        if stalled[k]:
            assert s.step_index[k] >= 2 and close(sim.step_handoff[k], sim.step_end[k - 2])
    assert close(critical_path(s, CostModel(1.0, 1.0)).length, sim.makespan)


@pytest.mark.parametrize("n,m", [(4, 2), (8, 3), (6, 4)])
def test_two_buffers_no_stall_when_the_writer_keeps_up(n, m):
    """Collision-free shift on a full mask: a contribution's predecessor ran
    one step earlier on another SM, so with r + latency <= c no add waits and
    the MMA warps never stall: makespan = m n c + r (the last add)."""
    s = get_schedule("shift", Geometry.model(n, m, "full"), n)
    for r, lat in [(0.5, 0.5), (1.0, 0.0), (0.2, 0.3)]:
        sim = simulate(s, CostModel(1.0, r, latency=lat))
        assert sim.waits == 0 and sim.buffer_stalls == 0
        assert close(sim.makespan, m * n * 1.0 + r)
    # r + latency > c: adds wait, and with r > 2c the writers cannot keep up
    slow = simulate(s, CostModel(1.0, 2.5))
    assert slow.buffer_stalls > 0 and slow.makespan > m * n + 2.5


def test_nondeterministic_never_waits():
    """No semaphores: a writer moves on once its buffer is read; with read <= c
    the MMA warps never stall and the makespan is the computes plus the last add."""
    for name in SCHEDULES:
        g = Geometry.model(6, 3, "causal")
        s = get_schedule(name, g, 6)
        sim = simulate(s, CostModel(1.0, 3.0, read=1.0, deterministic=False, latency=5.0))
        assert sim.waits == 0 and sim.buffer_stalls == 0
        mma_end = max(np.bincount(sim.task_cta, weights=s.task_steps.astype(float)))
        assert close(sim.makespan, mma_end + 3.0)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_zero_writer_time_keeps_the_serial_order(name, mask):
    """r = 0: the writer timeline obeys the serial model's ordering constraints
    (an add after its compute and after its rank predecessor's, each CTA's
    computes in program order, one at a time), is never later than the serial
    model's (it only drops the SM's wait for the add) and with one buffer of
    an add that completes at once it is the serial model where the next
    compute may overlap a semaphore wait."""
    g = Geometry(2, 3, 3, 500, 500, 64, 128, mask)
    s = lower_to_static(get_schedule(name, g, 5))
    w = simulate(s, CostModel(1.0, 0.0))
    ser = simulate(s, CostModel(1.0, 0.0, pipeline="serial"))
    assert w.makespan <= ser.makespan + 1e-9
    assert np.all(w.step_reduce_start >= w.step_compute_end - 1e-12)
    o = np.lexsort((s.step_rank, s.step_dq_tile))
    same = s.step_dq_tile[o][1:] == s.step_dq_tile[o][:-1]
    assert np.all(w.step_reduce_start[o][1:][same] >= w.step_end[o][:-1][same] - 1e-12)
    for cta in range(s.num_ctas):
        idx = np.flatnonzero(w.step_cta == cta)
        assert np.all(np.diff(w.step_start[idx]) > 0)
        assert np.all(w.step_start[idx][1:] >= w.step_handoff[idx][:-1] - 1e-12)
    # no semaphore wait at all (a collision-free order): both are the plain compute sum
    if name in ("shift", "symmetric_shift") and mask == "full":
        assert close(w.makespan, ser.makespan)


def test_many_buffers_never_stall():
    """Buffers enough for a whole task: the MMA warps never wait, whatever the
    semaphore chain does; the adds trail behind."""
    s = get_schedule("fa3", Geometry.model(8, 2, "causal"), 8)
    sim = simulate(s, CostModel(1.0, 2.0, latency=0.5, buffers=64))
    assert sim.buffer_stalls == 0 and sim.waits > 0
    assert close(critical_path(s, CostModel(1.0, 2.0, latency=0.5, buffers=64)).length, sim.makespan)


def test_latency_applies_to_every_handoff():
    """Writer pipeline: the semaphore lives in global memory, so a hand-off
    between the two writers of one CTA pays the latency too (serial: only
    between SMs).  Two KV tiles of one head, one Q tile, one SM: KV tile 1's
    add waits for KV tile 0's, released at 1 + r, seen latency later."""
    g = Geometry.model(2, 1, "full", n_q=1)
    s = get_schedule("shift", g, 1)   # one CTA runs both tasks, one step each
    sim = simulate(s, CostModel(1.0, 0.5, latency=2.0))
    k1 = int(np.flatnonzero(s.step_rank == 1)[0])
    k0 = int(np.flatnonzero(s.step_rank == 0)[0])
    assert close(sim.step_reduce_start[k1], sim.step_end[k0] + 2.0)
    assert close(sim.makespan, sim.step_end[k0] + 2.0 + 0.5)


def test_masked_compute_prices_diagonal_tiles():
    """hdim 128's 64 x 128 tiles: the two Q tiles on a KV tile's diagonal need
    the mask; masked_compute is their cost, other steps cost compute."""
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=1024, headdim=128, causal=True)
    s = get_schedule("spt", g, 8)
    c, _ = CostModel(1.0, 0.5, masked_compute=1.5).step_costs(s)
    kv = s.task_kv[s.step_task]
    diag = (s.step_q == 2 * kv) | (s.step_q == 2 * kv + 1)
    assert np.all(c[diag] == 1.5) and np.all(c[~diag] == 1.0)
    a = simulate(s, CostModel(1.0, 0.5, masked_compute=1.5)).work
    assert close(a, s.num_steps + 0.5 * diag.sum())


def test_writer_cost_model_checks():
    with pytest.raises(ValueError):
        CostModel(1.0, 0.5, read=0.6)
    with pytest.raises(ValueError):
        CostModel(pipeline="paper")
    with pytest.raises(ValueError):
        CostModel(buffers=0)
    with pytest.raises(ValueError):
        CostModel(deterministic=False, pipeline="serial")


def test_gantt_of_the_writer_pipeline(tmp_path):
    pytest.importorskip("matplotlib")
    from dash_fa3.schedule import plot_gantt
    s = get_schedule("fa3", Geometry.model(6, 2, "full"), 6)
    sim = simulate(s, CostModel(1.0, 1.0, latency=0.2))
    assert sim.buffer_stalls > 0 and sim.waits > 0
    path = tmp_path / "writer.png"
    plot_gantt(s, sim, str(path))
    assert path.stat().st_size > 1000
