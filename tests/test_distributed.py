"""dash_fa3.distributed on CPU with gloo, in spawned processes (this file is also the worker).

* deterministic, algorithm "superblocks" (the default): output and dq/dk/dv bitwise identical for
  P = 1, 2, 3, 4, 8 and both layouts (balanced plans and the near-equal-work fallback), MHA, GQA
  and MQA, and within bounds of fp64 attention; the same through the shared transport;
* deterministic, algorithm "heads": output and dq/dk/dv bitwise those of one
  process's call on the whole tensors (the same per-group compute), for P = 1, 2, 3, 4, 8 and both
  layouts, and within bounds of fp64 attention;
* deterministic, algorithm "folds": output and dq/dk/dv match fp64 attention (dash_fa3.reference)
  and are bitwise identical for P = 1, 2, 3, 4, 8 and both layouts (torch.equal on the unsharded
  tensors);
* a rank that raises, dies or stalls makes every other rank fail with CommunicationError
  (CommunicationTimeout when it stalls) within a bound; nothing hangs;
* checkpoint_block runs the distributed attention once per layer, with the uncheckpointed gradients.

Select with ``-m distributed``. Every process uses one intra-op thread.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.distributed

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
# Global lengths per rank count, each a multiple of 2 * P * 128; P = 1 runs both, so every P is
# compared bit for bit with one rank. Zigzag chunks: 3 blocks at P = 3 (odd), 1 block at P = 8.
LENGTHS = {1: (2048, 2304), 2: (2048,), 3: (2304,), 4: (2048,), 8: (2048,)}
# The non-deterministic mode (the run plan, runs.py, on the CPU reference ops) is checked
# against fp64 at one length per P.
NONDET_LENGTHS = {1: 2048, 2: 2048, 3: 2304, 4: 2048, 8: 2048}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# name: (causal, batch, heads, heads_kv, headdim, dtype)
CONFIGS = {
    "causal_mha_bf16": (True, 1, 2, 2, 32, "bf16"),
    "causal_gqa_fp16_b2": (True, 2, 4, 2, 16, "fp16"),
    "full_mqa_bf16": (False, 1, 3, 1, 16, "bf16"),
    "full_mha_fp32": (False, 1, 1, 1, 32, "fp32"),
}
# The head-parallel algorithm gives each rank whole KV heads: heads_kv >= 8 for P = 8.
HEADS_CONFIGS = {
    "heads_causal_gqa_bf16": (True, 1, 16, 8, 16, "bf16"),
    "heads_full_mha_fp16_b2": (False, 2, 9, 9, 16, "fp16"),
}
LAYOUTS = ("contiguous", "zigzag")
# The superblock algorithm's S in these runs: 8 superblocks of 2048 tokens (balanced for P = 1, 2, 4;
# at P = 8 the 2P * S rule fails and the near-equal-work cut takes over), 9 of 2304 (P = 3: the same).
SUPERBLOCK = 256


# ------------------------------------------------------------------------------------------ worker

def make_inputs(seed, seqlen, cfg):
    """Full q, k, v, dout for one config; the same on every rank and in the test process."""
    causal, b, h, hk, d, dt = cfg
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, seqlen, h, d), (b, seqlen, hk, d), (b, seqlen, hk, d), (b, seqlen, h, d))
    return [torch.randn(s, generator=g).to(DTYPES[dt]) for s in shapes]


def _attention_run(D, group, seed, seqlen, cfg, layout, deterministic=True, algorithm="folds", **kw):
    q, k, v, dout = make_inputs(seed, seqlen, cfg)
    ql, kl, vl = (D.shard(x, group, layout=layout).detach().clone().requires_grad_() for x in (q, k, v))
    out = D.context_parallel_attn(ql, kl, vl, group, causal=cfg[0], layout=layout, deterministic=deterministic,
                                  algorithm=algorithm, **kw)
    out.backward(D.shard(dout, group, layout=layout))
    return [D.unshard(x, group, layout=layout) for x in (out.detach(), ql.grad, kl.grad, vl.grad)]


def _job_attention(D, group, rank, P, job, outdir):
    for n in LENGTHS[P]:
        for name, cfg in CONFIGS.items():
            for layout in LAYOUTS:
                res = _attention_run(D, group, job["seed"], n, cfg, layout)
                if rank == 0:
                    torch.save(res, os.path.join(outdir, f"{name}-{layout}-N{n}-P{P}.pt"))
                res = _attention_run(D, group, job["seed"], n, cfg, layout, algorithm=None, superblock=SUPERBLOCK)
                if rank == 0:
                    torch.save(res, os.path.join(outdir, f"sb-{name}-{layout}-N{n}-P{P}.pt"))
                if n == NONDET_LENGTHS.get(P):
                    res = _attention_run(D, group, job["seed"], n, cfg, layout, deterministic=False, algorithm=None)
                    if rank == 0:
                        torch.save(res, os.path.join(outdir, f"nondet-{name}-{layout}-N{n}-P{P}.pt"))
    for name, cfg in HEADS_CONFIGS.items():
        for layout in LAYOUTS:
            res = _attention_run(D, group, job["seed"], LENGTHS[P][0], cfg, layout, algorithm="heads")
            if rank == 0:
                torch.save(res, os.path.join(outdir, f"{name}-{layout}-N{LENGTHS[P][0]}-P{P}.pt"))
            # the superblock algorithm on these configs too: 8 and 9 KV heads beside CONFIGS' 1 and 2
            for n in LENGTHS[P]:
                res = _attention_run(D, group, job["seed"], n, cfg, layout, algorithm=None, superblock=SUPERBLOCK)
                if rank == 0:
                    torch.save(res, os.path.join(outdir, f"sb-{name}-{layout}-N{n}-P{P}.pt"))
    return {}


def _job_shared(D, group, rank, P, job, outdir):
    """The head-parallel algorithm through the shared transport, heads in job['chunks'] chunks,
    twice per config (the second pass reuses the buffers the first one grew); the superblock
    algorithm through both transports; then once more in a new process group of the same name whose
    ranks are the old ones shifted by one (the old group's buffers must not be reused)."""
    n = LENGTHS[P][0]
    for transport in ("p2p", "shared"):
        os.environ["DASH_FA3_CP_TRANSPORT"] = transport
        for name in ("causal_gqa_fp16_b2", "full_mqa_bf16"):
            for layout in LAYOUTS:
                res = _attention_run(D, group, job["seed"], n, CONFIGS[name], layout, algorithm=None,
                                     superblock=SUPERBLOCK)
                if rank == 0:
                    torch.save(res, os.path.join(outdir, f"sb-{transport}-{name}-{layout}.pt"))
    os.environ["DASH_FA3_CP_TRANSPORT"] = "shared"
    os.environ["DASH_FA3_CP_CHUNKS"] = str(job["chunks"])
    for name, cfg in HEADS_CONFIGS.items():
        for layout in LAYOUTS:
            for rep in range(2):
                res = _attention_run(D, group, job["seed"] + rep, n, cfg, layout, algorithm="heads")
                if rank == 0:
                    torch.save(res, os.path.join(outdir, f"{name}-{layout}-{rep}.pt"))
    import datetime

    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    dist.destroy_process_group()
    rank = (rank + 1) % P   # the same processes, other ranks: stale mappings would reach the wrong peers
    dist.init_process_group("gloo", init_method=f"file://{job['store2']}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=job["timeout_s"]))
    assert dist.group.WORLD.group_name == name
    cfg_name = next(iter(HEADS_CONFIGS))
    res = _attention_run(D, dist.group.WORLD, job["seed"] + 2, n, HEADS_CONFIGS[cfg_name], "contiguous",
                         algorithm="heads")
    if rank == 0:
        torch.save(res, os.path.join(outdir, "again.pt"))
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith("dash_fa3-cp-")] if os.path.isdir("/dev/shm") else []
    return {"leftovers": leftovers}


def _job_fault(D, group, rank, P, job, outdir):
    """Rank job['bad'] misbehaves at its second forward tile (folds) or its forward compute (heads,
    one chunk); the others record how they fail."""
    from dash_fa3.distributed import heads
    from dash_fa3.distributed.folds import backend

    algorithm = job["algorithm"]
    if algorithm == "heads-shared":
        os.environ["DASH_FA3_CP_TRANSPORT"] = "shared"
        algorithm = "heads"
    cfg = CONFIGS["causal_mha_bf16"] if algorithm == "folds" else HEADS_CONFIGS["heads_causal_gqa_bf16"]
    # a healthy call first, so `elapsed` below is communication and compute, not first-call set-up
    _attention_run(D, group, job["seed"], job["seqlen"], cfg, "contiguous", algorithm=algorithm)
    if rank == job["bad"]:
        calls = [0]
        owner, attr = (backend.TorchBlockBackend, "fwd_tile") if algorithm == "folds" else (heads, "_fwd_compute")
        healthy = getattr(owner, attr)
        at = 2 if algorithm == "folds" else 1

        def faulty(*a, **kw):
            calls[0] += 1
            if calls[0] == at:
                if job["fault"] == "raise":
                    raise RuntimeError("injected failure")
                if job["fault"] == "exit":
                    os._exit(17)
                time.sleep(job["stall_s"])
            return healthy(*a, **kw)

        setattr(owner, attr, faulty)
    t0 = time.monotonic()
    try:
        _attention_run(D, group, job["seed"], job["seqlen"], cfg, "contiguous", algorithm=algorithm)
        return {"raised": None, "elapsed": time.monotonic() - t0}
    except Exception as e:   # the test inspects what each rank raised
        if rank == job["bad"]:
            time.sleep(job["stall_s"])   # caught, but the process lives on: the others must time out
        return {"raised": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "elapsed": time.monotonic() - t0}


def _job_checkpoint(D, group, rank, P, job, outdir):
    """A two-layer model around context_parallel_attn, uncheckpointed / plainly checkpointed /
    checkpoint_block; counts distributed attention forwards (heads.forward calls: the
    deterministic default)."""
    from torch.utils.checkpoint import checkpoint

    from dash_fa3 import checkpoint as ck
    from dash_fa3.distributed import heads

    calls = [0]
    fwd = heads.forward

    def counting(*a, **kw):
        calls[0] += 1
        return fwd(*a, **kw)

    heads.forward = counting
    torch.manual_seed(job["seed"])   # same weights on every rank
    dim, heads = 64, 2
    qkv = [torch.nn.Linear(dim, 3 * dim) for _ in range(2)]
    proj = [torch.nn.Linear(dim, dim) for _ in range(2)]
    params = [p for m in qkv + proj for p in m.parameters()]

    def block(x, i):
        b, n, _ = x.shape
        q, k, v = qkv[i](x).view(b, n, 3, heads, dim // heads).unbind(2)
        o = D.context_parallel_attn(q, k, v, group, causal=True, deterministic=True, algorithm="heads")
        return x + proj[i](torch.nn.functional.gelu(o.reshape(b, n, dim)))

    x_full = torch.randn(1, job["seqlen"], dim)
    out = {}
    for mode in ("none", "plain", "selective"):
        for p in params:
            p.grad = None
        x = D.shard(x_full, group).clone().requires_grad_()
        calls[0] = 0
        h = x
        for i in range(2):
            if mode == "none":
                h = block(h, i)
            elif mode == "plain":
                h = checkpoint(block, h, i, use_reentrant=False)
            else:
                h = ck.checkpoint_block(block, h, i)
        h.square().sum().backward()
        out[mode] = calls[0]
        grads = [D.unshard(x.grad, group)] + [p.grad.clone() for p in params]
        if rank == 0:
            torch.save(grads, os.path.join(outdir, f"ckpt-{mode}.pt"))

    # the group as a DeviceMesh gives the same bits; argument errors are clear
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (P,))
    q = torch.randn(1, job["seqlen"] // P, 2, 16)
    a = D.context_parallel_attn(q, q, q, group, causal=True)
    out["mesh_equal"] = torch.equal(a, D.context_parallel_attn(q, q, q, mesh, causal=True))
    errors = {}
    for what, call in (("no_group", lambda: D.context_parallel_attn(q, q, q, None)),
                       ("bad_length", lambda: D.context_parallel_attn(q[:, :100], q[:, :100], q[:, :100], group)),
                       ("bad_heads", lambda: D.context_parallel_attn(q.repeat(1, 1, 3, 1)[:, :, :3], q, q, group)),
                       ("bad_layout", lambda: D.context_parallel_attn(q, q, q, group, layout="ring"))):
        try:
            call()
            errors[what] = None
        except Exception as e:   # recorded for the test to check type and text
            errors[what] = [type(e).__name__, str(e)]
    out["errors"] = errors
    n = job["seqlen"]
    x = torch.arange(2 * n * 3).view(2, n, 3)
    c = n // (2 * P)
    zig = torch.cat([x[:, rank * c:(rank + 1) * c], x[:, (2 * P - 1 - rank) * c:(2 * P - rank) * c]], 1)
    out["roundtrip"] = {layout: torch.equal(D.unshard(D.shard(x, group, layout=layout), group, layout=layout), x)
                        and torch.equal(D.unshard(D.shard(x.mT, group, 2, layout), group, -1, layout), x.mT)
                        for layout in LAYOUTS}
    out["zigzag_shard"] = torch.equal(D.shard(x, group, layout="zigzag"), zig)
    out["contiguous_shard"] = torch.equal(D.shard(x, group), x[:, rank * n // P:(rank + 1) * n // P])
    return out


def _worker(argv, jobs=None):
    """One rank: joins the gloo group of the launch and runs its job (``jobs``: kind -> function;
    this file's jobs by default); a fault job's group is broken, so the process exits without
    tearing it down (that could block)."""
    rank, P, store, jobfile, outdir = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    from dash_fa3 import distributed as D

    with open(jobfile) as f:
        job = json.load(f)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=job["timeout_s"]))
    run = (jobs or {"attention": _job_attention, "shared": _job_shared, "fault": _job_fault,
                    "checkpoint": _job_checkpoint})[job["kind"]]
    result = run(D, dist.group.WORLD, rank, P, job, outdir)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if job["kind"] == "fault":
        os._exit(0)   # the group is broken; tearing it down could block
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ launcher

def launch(P, job, tmp_path, wait_s=240, expect_dead=(), script=HERE):
    """Run ``script`` (this file by default) as P worker processes; return (per-rank JSON results,
    per-rank exit codes). Fails (never hangs) if a rank outlives ``wait_s``; ranks in
    ``expect_dead`` may be killed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    jobfile = tmp_path / "job.json"
    jobfile.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = []
    for r in range(P):
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, script, str(r), str(P), str(tmp_path / "store"), str(jobfile),
                                       str(tmp_path)], stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + wait_s
    codes = {}
    try:
        for r, p in enumerate(procs):
            if r in expect_dead:
                continue
            codes[r] = p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(P))
        pytest.fail(f"ranks still running after {wait_s} s (hang):\n{logs}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for r in range(P):
        path = tmp_path / f"rank{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())
        elif r not in expect_dead:
            log = (tmp_path / f"rank{r}.log").read_text()[-3000:]
            pytest.fail(f"rank {r} wrote no result (exit {codes.get(r)}):\n{log}")
    return results, codes


# ------------------------------------------------------------------------------------------ reference

def reference_chunked(q, k, v, dout, causal, compute=torch.float64, rows=768):
    """Attention and gradients by dash_fa3.reference, in query-row chunks (the full score matrix
    would not fit): a chunk [a, b) with keys [0, b) and the bottom-right causal mask is exactly
    global causal."""
    from dash_fa3 import reference

    n = q.shape[1]
    outs, dqs = [], []
    dk, dv = torch.zeros(k.shape, dtype=compute), torch.zeros(v.shape, dtype=compute)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        kk, vv = (k[:, :b], v[:, :b]) if causal else (k, v)
        o, _ = reference.attention_ref(q[:, a:b], kk, vv, None, causal, compute)
        dq, dkc, dvc = reference.attention_bwd_ref(dout[:, a:b], q[:, a:b], kk, vv, o, None, causal, compute)
        outs.append(o)
        dqs.append(dq)
        dk[:, :kk.shape[1]] += dkc
        dv[:, :vv.shape[1]] += dvc
    return torch.cat(outs, 1), torch.cat(dqs, 1), dk, dv


# Allowed error, as a multiple of the output dtype's unit roundoff times the tensor's largest
# reference magnitude (fp32 results carry the fp32 folds' own rounding, not just the final cast).
TOL_UNITS = {"bf16": 4.0, "fp16": 8.0, "fp32": 64.0}


def check_vs_reference(res, seed, seqlen, cfg, what):
    causal, *_, dt = cfg
    q, k, v, dout = make_inputs(seed, seqlen, cfg)
    ref = reference_chunked(q, k, v, dout, causal)
    unit = torch.finfo(DTYPES[dt]).eps / 2
    for name, got, want in zip(("out", "dq", "dk", "dv"), res, ref):
        assert got.dtype == DTYPES[dt] and got.shape == want.shape, f"{what} {name}: {got.dtype} {tuple(got.shape)}"
        err = (got.double() - want).abs().max().item()
        tol = TOL_UNITS[dt] * unit * want.abs().max().item()
        assert err <= tol, f"{what} {name}: max error {err:.3g} > {tol:.3g} vs fp64 (seed {seed})"


# ------------------------------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def attention_runs(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    out = tmp_path_factory.mktemp("dist_attention")
    for P in LENGTHS:
        launch(P, {"kind": "attention", "seed": seed, "timeout_s": 120}, out / f"P{P}")

    def load(name, layout, n, P):
        return torch.load(out / f"P{P}" / f"{name}-{layout}-N{n}-P{P}.pt")

    return seed, load


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_fp64_reference(attention_runs, name):
    # one run per config suffices: the invariance test shows every P and layout gives these bits
    seed, load = attention_runs
    check_vs_reference(load(name, "zigzag", 2304, 3), seed, 2304, CONFIGS[name], f"{name} P=3 zigzag")


def test_one_block_chunks_match_reference(attention_runs):
    seed, load = attention_runs
    check_vs_reference(load("causal_gqa_fp16_b2", "zigzag", 2048, 8), seed, 2048, CONFIGS["causal_gqa_fp16_b2"],
                       "P=8 zigzag")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bitwise_invariant_to_number_of_ranks(attention_runs, name, layout):
    seed, load = attention_runs
    for P, lengths in LENGTHS.items():
        for n in lengths:
            base = load(name, "contiguous", n, 1)
            for what, a, b in zip(("out", "dq", "dk", "dv"), load(name, layout, n, P), base):
                assert torch.equal(a, b), (f"{name}, {n} tokens: {what} with P={P} ({layout}) differs from P=1 "
                                           f"in {(a != b).sum().item()} elements (seed {seed})")


def test_invariance_is_not_vacuous(attention_runs):
    """Another correct fp32 summation order (the reference's) gives other bits, so equal bits
    across P come from the fixed fold order, not from coarse rounding."""
    seed, load = attention_runs
    cfg = CONFIGS["full_mha_fp32"]
    ours = load("full_mha_fp32", "contiguous", 2048, 1)
    q, k, v, dout = make_inputs(seed, 2048, cfg)
    other = reference_chunked(q, k, v, dout, cfg[0], compute=torch.float32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, other):
        assert a.abs().sum() > 0, name
        assert not torch.equal(a, b.to(a.dtype)), f"{name}: the reference's fp32 order gave the same bits"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_superblocks_bitwise_invariant_to_number_of_ranks(attention_runs, name, layout):
    seed, load = attention_runs
    for P, lengths in LENGTHS.items():
        for n in lengths:
            base = load("sb-" + name, "contiguous", n, 1)
            for what, a, b in zip(("out", "dq", "dk", "dv"), load("sb-" + name, layout, n, P), base):
                assert torch.equal(a, b), (f"superblocks {name}, {n} tokens: {what} with P={P} ({layout}) differs "
                                           f"from P=1 in {(a != b).sum().item()} elements (seed {seed})")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_superblocks_match_fp64_reference(attention_runs, name):
    seed, load = attention_runs
    check_vs_reference(load("sb-" + name, "zigzag", 2304, 3), seed, 2304, CONFIGS[name], f"superblocks {name} P=3")


@pytest.mark.parametrize("name", list(HEADS_CONFIGS))
def test_superblocks_with_many_kv_heads(attention_runs, name):
    """GQA 16/8 and MHA with 9 KV heads (fp16, batch 2): bitwise equal across P and layouts, and
    within the fp64 bounds."""
    seed, load = attention_runs
    for layout in LAYOUTS:
        for P, lengths in LENGTHS.items():
            for n in lengths:
                base = load("sb-" + name, "contiguous", n, 1)
                for what, a, b in zip(("out", "dq", "dk", "dv"), load("sb-" + name, layout, n, P), base):
                    assert torch.equal(a, b), (f"superblocks {name}, {n} tokens: {what} with P={P} ({layout}) "
                                               f"differs from P=1 (seed {seed})")
    check_vs_reference(load("sb-" + name, "zigzag", 2304, 3), seed, 2304, HEADS_CONFIGS[name],
                       f"superblocks {name} P=3")


def test_superblock_tree_is_not_vacuous(attention_runs):
    """The tree's sums are real: the superblock dK/dV differ from the fold algorithm's (one fp32
    chain per key), so equal bits across P come from the fixed tree, not from coarse rounding."""
    _, load = attention_runs
    sb, folded = load("sb-full_mha_fp32", "contiguous", 2048, 1), load("full_mha_fp32", "contiguous", 2048, 1)
    assert not torch.equal(sb[2], folded[2]) and not torch.equal(sb[3], folded[3])


def one_process_heads(seed, seqlen, cfg):
    """What the head-parallel algorithm must reproduce bit for bit: its per-group compute on the
    whole tensors in one process (on a GPU: flash_attn_func)."""
    from dash_fa3.distributed import heads

    causal, _, h, hk, d, _ = cfg
    q, k, v, dout = make_inputs(seed, seqlen, cfg)
    scale = d ** -0.5
    out, lse = heads._fwd_compute(q, k, v, scale, causal)
    return [out, *heads._bwd_compute(dout, q, k, v, out, lse, scale, causal, True, h, hk, 0)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(HEADS_CONFIGS))
def test_heads_bitwise_one_process_for_every_number_of_ranks(attention_runs, name, layout):
    seed, load = attention_runs
    cfg = HEADS_CONFIGS[name]
    want = {n: one_process_heads(seed, n, cfg) for n in {lengths[0] for lengths in LENGTHS.values()}}
    for P, lengths in LENGTHS.items():
        n = lengths[0]
        for what, a, b in zip(("out", "dq", "dk", "dv"), load(name, layout, n, P), want[n]):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name} {what}: {a.dtype} {tuple(a.shape)}"
            assert torch.equal(a, b), (f"{name}, {n} tokens: {what} with P={P} ({layout}) differs from one "
                                       f"process in {(a != b).sum().item()} elements (seed {seed})")


def test_transport_and_chunk_settings_are_checked(monkeypatch):
    from dash_fa3.distributed import heads, transport

    monkeypatch.delenv("DASH_FA3_CP_TRANSPORT", raising=False)
    monkeypatch.delenv("DASH_FA3_CP_CHUNKS", raising=False)
    assert transport.choose() == "p2p" and heads.default_chunks() == heads.CHUNKS
    monkeypatch.setenv("DASH_FA3_CP_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match="DASH_FA3_CP_TRANSPORT='nccl': choose from p2p, shared"):
        transport.choose()
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("DASH_FA3_CP_CHUNKS", bad)
        with pytest.raises(ValueError, match="a positive integer"):
            heads.default_chunks()
    monkeypatch.setenv("DASH_FA3_CP_CHUNKS", "3")
    assert heads.default_chunks() == 3


def test_defaults_by_device_and_heads(monkeypatch):
    """Unset, the transport is p2p off CUDA (shared for a CUDA group on one host: the GPU tests'
    default rows); nd runs the head-parallel algorithm on CUDA when every rank holds whole KV heads,
    the run plan otherwise and on CPU; det always the superblock one unless named."""
    from dash_fa3.distributed import attention, transport

    monkeypatch.delenv("DASH_FA3_CP_TRANSPORT", raising=False)
    assert transport.choose(object(), torch.device("cpu")) == "p2p"
    monkeypatch.setenv("DASH_FA3_CP_TRANSPORT", "shared")
    assert transport.choose(object(), torch.device("cpu")) == "shared"
    r = attention.resolve_algorithm
    assert r(None, False, 8, 2, "cuda") == "heads" and r(None, False, 2, 2, "cuda") == "heads"
    assert r(None, False, 1, 2, "cuda") == "runs" and r(None, False, 8, 2, "cpu") == "runs"
    assert r(None, True, 8, 2, "cuda") == "superblocks" and r(None, True, 1, 2, "cpu") == "superblocks"
    assert r("runs", False, 8, 2, "cuda") == "runs"
    with pytest.raises(ValueError, match="not deterministic"):
        r("runs", True, 8, 2, "cuda")


@pytest.mark.parametrize("P,chunks", [(2, 2), (3, 2)])
def test_heads_shared_transport_bitwise_one_process(tmp_path, P, chunks):
    """DASH_FA3_CP_TRANSPORT=shared (outboxes pulled, inboxes pushed, offsets derived on both sides
    from the plan; on CPU the buffers are shared-memory files): the same bits as one process, also
    on a second call through the same buffers; the buffer files do not outlive their mapping."""
    seed = int.from_bytes(os.urandom(4), "little")
    results, _ = launch(P, {"kind": "shared", "seed": seed, "chunks": chunks, "timeout_s": 120,
                            "store2": str(tmp_path / "store2")}, tmp_path)
    n = LENGTHS[P][0]
    for name, cfg in HEADS_CONFIGS.items():
        for rep in range(2):
            want = one_process_heads(seed + rep, n, cfg)
            for layout in LAYOUTS:
                got = torch.load(tmp_path / f"{name}-{layout}-{rep}.pt")
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    assert torch.equal(a, b), (f"{name} {layout} call {rep}: {what} through the shared transport "
                                               f"(P={P}, {chunks} chunks) differs from one process in "
                                               f"{(a != b).sum().item()} elements (seed {seed})")
    name = next(iter(HEADS_CONFIGS))
    for what, a, b in zip(("out", "dq", "dk", "dv"), torch.load(tmp_path / "again.pt"),
                          one_process_heads(seed + 2, n, HEADS_CONFIGS[name])):
        assert torch.equal(a, b), f"{name} in a new group of the same name: {what} differs (seed {seed})"
    assert all(not r["leftovers"] for r in results.values()), results
    for name in ("causal_gqa_fp16_b2", "full_mqa_bf16"):
        for layout in LAYOUTS:
            a, b = (torch.load(tmp_path / f"sb-{t}-{name}-{layout}.pt") for t in ("p2p", "shared"))
            for what, x, y in zip(("out", "dq", "dk", "dv"), a, b):
                assert torch.equal(x, y), f"superblocks {name} {layout} P={P}: {what} differs between transports"


@pytest.mark.parametrize("name", list(HEADS_CONFIGS))
def test_heads_matches_fp64_reference(attention_runs, name):
    seed, load = attention_runs
    check_vs_reference(load(name, "zigzag", 2304, 3), seed, 2304, HEADS_CONFIGS[name], f"{name} P=3 zigzag")


@pytest.mark.parametrize("P", sorted(NONDET_LENGTHS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_nondeterministic_run_plan_matches_fp64_reference(attention_runs, name, layout, P):
    """deterministic=False: whole runs of query blocks through the single-GPU ops (here their CPU
    reference), helper rows moved to other ranks and back, dK/dV partials summed by the owners."""
    seed, load = attention_runs
    n = NONDET_LENGTHS[P]
    res = load(f"nondet-{name}", layout, n, P)
    check_vs_reference(res, seed, n, CONFIGS[name], f"non-deterministic {name} P={P} {layout}")


@pytest.mark.parametrize("algorithm,fault,P", [("folds", "raise", 2), ("folds", "exit", 2), ("folds", "stall", 3),
                                               ("heads", "raise", 2), ("heads", "stall", 3),
                                               ("heads-shared", "raise", 2), ("heads-shared", "stall", 3)])
def test_failed_rank_makes_the_others_fail(tmp_path, algorithm, fault, P):
    timeout_s, bad = 3, 1
    job = {"kind": "fault", "fault": fault, "bad": bad, "seed": 5, "seqlen": 2 * P * 128 * 2,
           "timeout_s": timeout_s, "stall_s": 60, "algorithm": algorithm}
    t0 = time.monotonic()
    results, codes = launch(P, job, tmp_path, wait_s=60, expect_dead=(bad,))
    wall = time.monotonic() - t0
    for r in range(P):
        if r == bad:
            continue
        res = results[r]
        assert res["raised"] is not None, f"rank {r} finished although rank {bad} failed"
        assert "CommunicationError" in res["mro"], f"rank {r} raised {res['raised']}: {res['message']}"
        if fault == "stall":
            assert "CommunicationTimeout" in res["mro"] and "TimeoutError" in res["mro"], res
        where = {"folds": "step", "heads": "chunk", "heads-shared": "barrier"}[algorithm]
        assert where in res["message"] and "rank" in res["message"], res["message"]
        # a survivor waits at most about one timeout for the rank that broke, plus one for a
        # survivor that broke before it; a live but silent rank costs the full timeout
        assert res["elapsed"] < 2 * timeout_s + 3, f"rank {r} took {res['elapsed']:.1f} s to fail"
        if fault != "exit":
            assert res["elapsed"] > timeout_s - 0.5 and "timeout (3 s)" in res["message"], res
    assert wall < 50


def test_checkpoint_block_skips_distributed_attention_rerun(tmp_path):
    P = 2
    results, _ = launch(P, {"kind": "checkpoint", "seed": 11, "seqlen": 512, "timeout_s": 120}, tmp_path)
    for r in range(P):
        res = results[r]
        assert (res["none"], res["plain"], res["selective"]) == (2, 4, 2), res
        assert res["mesh_equal"] is True
        assert res["roundtrip"] == {layout: True for layout in LAYOUTS}
        assert res["zigzag_shard"] is True and res["contiguous_shard"] is True
        err = res["errors"]
        assert err["no_group"][0] == "TypeError" and "explicit process group" in err["no_group"][1]
        assert err["bad_length"][0] == "ValueError" and "multiple of 2*P*128 = 512" in err["bad_length"][1]
        assert err["bad_heads"][0] == "ValueError" and "multiple of heads_kv" in err["bad_heads"][1]
        assert err["bad_layout"][0] == "ValueError" and "zigzag" in err["bad_layout"][1]
    ref = torch.load(tmp_path / "ckpt-none.pt")
    for mode in ("plain", "selective"):
        for a, b in zip(torch.load(tmp_path / f"ckpt-{mode}.pt"), ref):
            assert torch.equal(a, b), f"{mode} checkpointing changed a gradient"


if __name__ == "__main__":
    _worker(sys.argv[1:])


def test_slot_is_the_largest_message_set_the_pass_makes():
    """heads.slot_bytes runs the pass's own gather and scatter on meta tensors: at P = 2 a rank sends
    its peer its n/2 tokens of the peer's heads of q, k, v (the forward's inputs), more than the
    results (out and the fp32 LSE); at P = 4 with 8 KV heads likewise, per peer."""
    from dash_fa3.distributed import heads

    for P, n, h, hk in ((2, 8192, 8, 8), (4, 16384, 16, 8), (3, 12288, 12, 6)):
        p = heads.plan(P, n, h, hk, "zigzag", 1)
        q = torch.empty((2, n // P, h, 64), dtype=torch.bfloat16, device="meta")
        k = torch.empty((2, n // P, hk, 64), dtype=torch.bfloat16, device="meta")
        lse = torch.empty((2, h, n // P), dtype=torch.float32, device="meta")
        per_peer = 2 * (n // P) * 64 * 2 * (h // P + 2 * hk // P)   # every piece's size is a multiple of 16
        assert heads.slot_bytes(p, [(q, 1, 2, True), (k, 1, 2, False), (k, 1, 2, False)],
                                [(q, 1, 2, True), (lse, 2, 1, True)]) == per_peer
