"""Misuse and faults of context parallelism on CPU (gloo), in spawned processes: each ends in a
clear error on every rank within the group's timeout, never a wrong answer or a hang.

* ranks that disagree on dtype, local length, heads, ``causal``, scale, layout, algorithm or mode:
  the same one-line ValueError on every rank, naming the field and the ranks;
* a rank's own bad argument (``causal="no"``): its TypeError, the same on every rank;
* ``shard(layout="zigzag")`` attended with the default layout, and an output unsharded with another
  layout: a ValueError naming both layouts;
* a killed rank, a stalled rank (in the attention's messages and before its first call): every other
  rank raises CommunicationError (CommunicationTimeout when it stalls) within about one timeout;
* a repeated call does not check again (no collective beyond the attention's own);
* ``shard``/``unshard`` take a NumPy integer ``seq_dim`` (and mesh dim) as the int (issue 53), and
  refuse a bool one.

Select with ``-m distributed``; each launch is bounded (``test_distributed.launch``).
"""

import os
import signal
import sys
import time

import pytest
import torch

import test_distributed as TD

pytestmark = pytest.mark.distributed

HERE = os.path.abspath(__file__)
TIMEOUT_S = 3
CFG = (True, 1, 4, 2, 16, "bf16")   # causal, batch, heads, heads_kv, headdim, dtype


def _inputs(D, group, n, dtype=torch.bfloat16, heads=4, heads_kv=2, layout=None, clone=True):
    q, k, v, _ = TD.make_inputs(3, n, CFG)
    k = k[:, :, :heads_kv]
    v = v[:, :, :heads_kv]
    q = q[:, :, :heads]
    out = [D.shard(x.to(dtype), group, layout=layout) for x in (q, k, v)]
    return [x.detach().clone() if clone else x for x in out]


def _record(call):
    try:
        call()
        return None
    except Exception as e:   # the test inspects what each rank raised
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def _job_misuse(D, group, rank, P, job, outdir):
    """Every case runs on every rank; rank 1 departs from rank 0 where the case says so."""
    n = job["seqlen"]
    odd = rank == 1
    q, k, v = _inputs(D, group, n)
    cp = D.context_parallel_attn
    cases = {
        "dtype": lambda: cp(*_inputs(D, group, n, torch.float16 if odd else torch.bfloat16), group, causal=True),
        "causal": lambda: cp(q, k, v, group, causal=not odd),
        "causal_not_bool": lambda: cp(q, k, v, group, causal="no" if odd else True),
        "scale": lambda: cp(q, k, v, group, causal=True, softmax_scale=0.5 if odd else None),
        "layout": lambda: cp(q, k, v, group, causal=True, layout="zigzag" if odd else "contiguous"),
        "algorithm": lambda: cp(q, k, v, group, deterministic=True, algorithm="folds" if odd else "heads"),
        "deterministic": lambda: cp(q, k, v, group, deterministic=odd),
        "heads": lambda: cp(*_inputs(D, group, n, heads=2 if odd else 4), group),
        "length": lambda: cp(*(x[:, :x.shape[1] // 2] if odd else x for x in (q, k, v)), group, causal=True),
        "zigzag_shard": lambda: cp(*_inputs(D, group, n, layout="zigzag", clone=False), group, causal=True),
        "zigzag_clone": lambda: cp(*_inputs(D, group, 2 * n, layout="zigzag"), group, causal=True),
        "unshard_layout": lambda: D.unshard(cp(q, k, v, group, causal=True), group, layout="zigzag"),
    }
    out = {name: _record(call) for name, call in cases.items()}
    # the group is still usable, and a repeated call does not check again
    import torch.distributed as dist

    gathers = [0]
    plain = dist.all_gather

    def counting(*a, **kw):
        gathers[0] += 1
        return plain(*a, **kw)

    first = cp(q, k, v, group, causal=True)
    dist.all_gather = counting
    again = cp(q, k, v, group, causal=True)
    dist.all_gather = plain
    out["repeat"] = {"equal": torch.equal(first, again), "gathers": gathers[0]}
    return out


def _job_fault(D, group, rank, P, job, outdir):
    """Rank job['bad'] is killed or stalls in its forward compute (``at``: "compute"), or before it
    calls at all (``at``: "call"); the others record how they fail."""
    from dash_fa3.distributed import heads

    algorithm, deterministic = {"heads": ("heads", True), "runs": ("runs", False)}[job["algorithm"]]
    q, k, v = _inputs(D, group, job["seqlen"])
    D.context_parallel_attn(q, k, v, group, causal=True, deterministic=deterministic, algorithm=algorithm)

    def misbehave():
        if job["fault"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(job["stall_s"])

    if rank == job["bad"]:
        if job["at"] == "call":
            misbehave()
        else:
            import dash_fa3.distributed.runs as runs
            owner, attr = (heads, "_fwd_compute") if algorithm == "heads" else (runs.ops, "fwd")
            healthy = getattr(owner, attr)

            def faulty(*a, **kw):
                misbehave()
                return healthy(*a, **kw)

            setattr(owner, attr, faulty)
    t0 = time.monotonic()
    r = _record(lambda: D.context_parallel_attn(q, k, v, group, causal=True, deterministic=deterministic,
                                                algorithm=algorithm))
    return {"raised": r, "elapsed": time.monotonic() - t0}


def _job_numpy_ints(D, group, rank, P, job, outdir):
    """shard/unshard with NumPy integer dims against the same calls with Python ints."""
    import numpy as np
    from torch.distributed.device_mesh import init_device_mesh

    n = job["seqlen"]
    x = torch.randn(2, 3, n, 4, generator=torch.Generator().manual_seed(53))   # tokens on dim 2
    out = {}
    for seq_dim in (np.int64(2), np.int32(-2), np.uint8(2)):
        for layout in TD.LAYOUTS:
            want = D.shard(x, group, seq_dim=int(seq_dim), layout=layout)
            got = D.shard(x, group, seq_dim=seq_dim, layout=layout)
            back = D.unshard(got, group, seq_dim=seq_dim, layout=layout)
            out[f"{seq_dim!r}-{layout}"] = (list(got.shape) == [2, 3, n // P, 4] and torch.equal(got, want)
                                            and torch.equal(back, D.unshard(want, group, seq_dim=2, layout=layout))
                                            and torch.equal(back, x))
    mesh = init_device_mesh("cpu", (P,))
    out["mesh_dim"] = torch.equal(D.shard(x, (mesh, np.int64(0)), seq_dim=2), D.shard(x, group, seq_dim=2))
    out["bool_shard"] = _record(lambda: D.shard(x, group, seq_dim=True))
    out["bool_unshard"] = _record(lambda: D.unshard(x, group, seq_dim=np.True_))
    return out


JOBS = {"misuse": _job_misuse, "fault": _job_fault, "numpy_ints": _job_numpy_ints}


def test_misuse_is_the_same_clear_error_on_every_rank(tmp_path):
    n = 2 * 2 * 128 * 2
    results, _ = TD.launch(2, {"kind": "misuse", "seqlen": n, "timeout_s": 60}, tmp_path, wait_s=240, script=HERE)
    want = {"dtype": ("ValueError", "dtype torch.bfloat16 on rank 0, torch.float16 on rank 1"),
            "causal": ("ValueError", "causal True on rank 0, False on rank 1"),
            "causal_not_bool": ("TypeError", "on rank 1: causal must be a bool, got 'no'"),
            "scale": ("ValueError", "softmax_scale 0.25 on rank 0, 0.5 on rank 1"),
            "layout": ("ValueError", "layout 'contiguous' on rank 0, 'zigzag' on rank 1"),
            "algorithm": ("ValueError", "algorithm 'heads' on rank 0, 'folds' on rank 1"),
            "deterministic": ("ValueError", "deterministic False on rank 0, True on rank 1"),
            "heads": ("ValueError", "heads 4 on rank 0, 2 on rank 1"),
            "length": ("ValueError", f"local length {n // 2} on rank 0, {n // 4} on rank 1"),
            "zigzag_shard": ("ValueError", "layout='zigzag'"),
            "zigzag_clone": ("ValueError", "layout='zigzag'"),
            "unshard_layout": ("ValueError", "layout='contiguous'")}
    for name, (kind, text) in want.items():
        got = [results[r][name] for r in range(2)]
        assert got[0] is not None, f"{name}: no error"
        assert got[0] == got[1], f"{name}: the ranks raised differently: {got}"
        assert got[0]["type"] == kind and text in got[0]["message"], f"{name}: {got[0]}"
        assert "\n" not in got[0]["message"], got[0]
    for r in range(2):
        assert results[r]["repeat"] == {"equal": True, "gathers": 0}, results[r]["repeat"]


def test_numpy_integer_dims_are_the_ints(tmp_path):
    P = 2
    results, _ = TD.launch(P, {"kind": "numpy_ints", "seqlen": 2 * P * 128, "timeout_s": 60}, tmp_path,
                           wait_s=240, script=HERE)
    for r in range(P):
        res = results[r]
        for key in ("bool_shard", "bool_unshard"):
            raised = res.pop(key)
            assert raised is not None and raised["type"] == "ValueError" and "seq_dim=" in raised["message"], raised
        assert len(res) == 3 * 2 + 1 and all(res.values()), (r, res)


@pytest.mark.parametrize("algorithm,fault,at", [("heads", "kill", "compute"), ("runs", "kill", "compute"),
                                                ("runs", "stall", "compute"), ("heads", "stall", "call")])
def test_killed_or_stalled_rank_fails_the_others_within_the_timeout(tmp_path, algorithm, fault, at):
    P, bad = 2, 1
    job = {"kind": "fault", "algorithm": algorithm, "fault": fault, "at": at, "bad": bad, "seqlen": 2 * P * 128 * 2,
           "timeout_s": TIMEOUT_S, "stall_s": 60}
    t0 = time.monotonic()
    results, _ = TD.launch(P, job, tmp_path, wait_s=60, expect_dead=(bad,), script=HERE)
    for r in range(P):
        if r == bad:
            continue
        res = results[r]
        raised = res["raised"]
        assert raised is not None, f"rank {r} finished although rank {bad} failed"
        assert "CommunicationError" in raised["mro"], raised
        if fault == "stall":
            assert "CommunicationTimeout" in raised["mro"] and f"timeout ({TIMEOUT_S} s)" in raised["message"], raised
        assert res["elapsed"] < 2 * TIMEOUT_S + 3, f"rank {r} took {res['elapsed']:.1f} s to fail"
    assert time.monotonic() - t0 < 50


if __name__ == "__main__":
    TD._worker(sys.argv[1:], JOBS)
