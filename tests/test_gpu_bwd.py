"""The Hopper backward kernel: gradients vs the fp32 reference, bitwise determinism,
schedules agreeing (GPU)."""

import math
import os
import random
import subprocess
import sys

import pytest
import torch

from attn_utils import assert_bitwise_repeatable, assert_close_to_ref, attention_lowp, make_inputs, require_built
from conftest import poison_cuda_allocator
import dash_fa3
from dash_fa3 import _ext, reference, variants
from dash_fa3.schedule import SCHEDULES, Geometry, resolve_call, resolve_schedule_name, schedules_for

pytestmark = pytest.mark.gpu

# The full and causal kernels; the local (window) ones: tests/test_gpu_window.py.
BWD_VARIANTS = [v for v in variants.ALL_VARIANTS if v.has_bwd and not v.local]
SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv
    (2, 256, 256, 4, 4),
    (1, 1000, 1000, 2, 2),  # ragged last tiles
    (1, 700, 1200, 4, 2),   # seqlen_q < seqlen_k, GQA
    (2, 1100, 333, 2, 1),   # seqlen_q > seqlen_k (causal: empty rows), MQA
    (1, 1, 77, 3, 3),
]


def defined_for(v, schedule):
    """Whether ``schedule`` is defined for v's backward tiles (under GQA with a power-of-two group):
    not the chaining runs and groups at head dim 192, whose kernel has no chains."""
    return schedule in schedules_for(Geometry.from_shape(batch=1, heads=2, heads_kv=1, seqlen_q=1, headdim=v.hdim))


def grads(q, k, v, dout, causal, scale=None, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    poison_cuda_allocator(1 << 28)
    out = dash_fa3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def lowp_grads(q, k, v, dout, causal, scale):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = attention_lowp(q, k, v, scale, causal)
    return torch.autograd.grad(out, (q, k, v), dout)


def check_case(v, shape, seed, schedule, deterministic):
    q, k, vv, dout = make_inputs(v, shape, seed)
    scale = 1.0 / math.sqrt(v.hdim) * (0.75 + 0.25 * (seed % 3))
    out, dq, dk, dv = grads(q, k, vv, dout, v.causal, scale, deterministic=deterministic, schedule=schedule)
    ref = reference.attention_bwd_ref(dout, q, k, vv, out, scale, v.causal)
    lowp = lowp_grads(q, k, vv, dout, v.causal, scale)
    for name, ours, want, base in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, lowp):
        assert ours.shape == want.shape and ours.dtype == q.dtype
        assert_close_to_ref(name, ours, base, want)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v", BWD_VARIANTS, ids=lambda v: v.name)
def test_gradients_match_reference(v, shape):
    require_built(v, "bwd")
    check_case(v, shape, seed=sum(shape), schedule="auto", deterministic=True)
    check_case(v, shape, seed=sum(shape) + 1, schedule="auto", deterministic=False)


# 128: the row split; 192, 256 and MLA's (192, v 128): the head-dim split
# (csrc/kernels/bwd/bwd_traits.h).
HDIM_PAIRS = [(128, 128), (192, 192), (256, 256), (192, 128)]
SPLIT_HDIM_PAIRS = [p for p in HDIM_PAIRS if p[0] > 128]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hdims", HDIM_PAIRS, ids=lambda p: variants.Variant(p[0], "bf16", "full", p[1]).hdims)
def test_every_schedule_is_correct(hdims, schedule, causal):
    v = variants.Variant(hdims[0], "bf16", "causal" if causal else "full", hdims[1])
    require_built(v, "bwd")
    if not defined_for(v, schedule):  # refused before the backward launches
        with pytest.raises(ValueError, match="does not run"):
            check_case(v, (2, 1000, 1000, 4, 2), seed=3, schedule=schedule, deterministic=True)
        return
    check_case(v, (2, 1000, 1000, 4, 2), seed=3, schedule=schedule, deterministic=True)


# The non-deterministic `auto` may pick any schedule (policy.nd_pick): each one's task order runs
# without the dQ turns, its GQA dK/dV through the accumulators or whole-group stores.
ND_SHAPES = [(2, 1000, 1000, 4, 2), (2, 640, 640, 4, 4), (1, 384, 2500, 4, 1)]


def nd_cases():
    for v in BWD_VARIANTS:
        if v.hdim not in (64, 128) or v.dtype != "bf16":
            continue
        for shape in ND_SHAPES:
            g = Geometry.from_shape(batch=shape[0], seqlen_q=shape[1], seqlen_k=shape[2], heads=shape[3],
                                    heads_kv=shape[4], headdim=v.hdim, causal=v.causal)
            for schedule in schedules_for(g):
                yield pytest.param(v, shape, schedule, id=f"{v.name}-{'x'.join(map(str, shape))}-{schedule}")


@pytest.mark.parametrize("v, shape, schedule", list(nd_cases()))
def test_every_schedule_is_correct_non_deterministic(v, shape, schedule):
    require_built(v, "bwd")
    check_case(v, shape, seed=sum(shape) + 5, schedule=schedule, deterministic=False)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("hdims", SPLIT_HDIM_PAIRS,
                         ids=lambda p: variants.Variant(p[0], "bf16", "full", p[1]).hdims)
def test_head_dim_split_is_bitwise_for_every_schedule(hdims, schedule):
    v = variants.Variant(hdims[0], "bf16", "causal", hdims[1])
    require_built(v, "bwd")
    if not defined_for(v, schedule):
        pytest.skip(f"{schedule} is not defined at head dim {v.hdim} (test_every_schedule_is_correct: refused)")
    q, k, vv, dout = make_inputs(v, (2, 1536, 1536, 4, 2), 5)
    assert_bitwise_repeatable(lambda: grads(q, k, vv, dout, True, deterministic=True, schedule=schedule)[1:], 19)


@pytest.mark.parametrize("v", BWD_VARIANTS, ids=lambda v: v.name)
def test_random_shapes(v):
    require_built(v, "bwd")
    rng = random.Random(v.name)
    for i in range(3):
        hkv = rng.choice([1, 2])
        schedule = rng.choice([s for s in SCHEDULES if defined_for(v, s)])
        # grouped_* need power-of-two groups
        group = rng.choice([1, 2, 4] if schedule.startswith("grouped_") else [1, 2, 3])
        shape = (rng.randint(1, 2), rng.randint(1, 900), rng.randint(1, 900), hkv * group, hkv)
        check_case(v, shape, seed=i, schedule=schedule, deterministic=bool(i % 2))


def test_schedules_agree_within_rounding():
    v = variants.Variant(128, "bf16", "causal")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, (2, 1536, 1536, 4, 2), 11)
    results = {s: grads(q, k, vv, dout, True, deterministic=True, schedule=s)[1:] for s in SCHEDULES}
    base = results["fa3"]
    for s, gs in results.items():
        for a, b in zip(gs, base):
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert rel < 2e-3, (s, rel)


# Few queries, many keys (the split and runs schedules' shapes): bottom-right causal and full, GQA and MHA,
# several dQ splits, ragged tiles.
RECT_SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv
    (2, 512, 4096, 4, 2),
    (1, 300, 5000, 2, 2),
    (3, 128, 2100, 4, 1),
]


@pytest.mark.parametrize("schedule", ["split", "interleave", "sections", "runs", "groups", "grouped_sections",
                                      "grouped_shift", "grouped_split"])
@pytest.mark.parametrize("shape", RECT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v", BWD_VARIANTS, ids=lambda v: v.name)
def test_rect_schedules_on_rectangular_problems(v, shape, schedule):
    require_built(v, "bwd")
    if not defined_for(v, schedule):
        pytest.skip(f"{schedule} is not defined at head dim {v.hdim} (test_every_schedule_is_correct: refused)")
    check_case(v, shape, seed=sum(shape), schedule=schedule, deterministic=True)
    # non-deterministic GQA here adds into one dK/dV accumulator per KV head (runs: one add per
    # chain of a group's heads; groups: none, each chain stores its whole group's)
    check_case(v, shape, seed=sum(shape) + 1, schedule=schedule if schedule in ("runs", "groups") else "auto",
               deterministic=False)
    q, k, vv, dout = make_inputs(v, shape, 7)
    assert_bitwise_repeatable(lambda: grads(q, k, vv, dout, v.causal, deterministic=True, schedule=schedule)[1:], 9)


@pytest.mark.parametrize("schedule", ["fa3", "spt", "descending", "symmetric_shift", "split", "interleave", "sections", "runs",
                                      "groups", "grouped_sections", "grouped_shift", "grouped_split"])
def test_deterministic_is_bitwise_over_100_runs_and_streams(schedule):
    v = variants.Variant(128, "bf16", "causal")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, (2, 2048, 2048, 8, 4), 5)
    assert_bitwise_repeatable(lambda: grads(q, k, vv, dout, True, deterministic=True, schedule=schedule)[1:], 99)


# Rows of whole groups of 4, 8 and 32 query heads (grouped_*): the kernel reads a step's virtual tile as
# (query head, Q tile) for the loads, the mask and the dQ adds; few and many keys per query, ragged.
@pytest.mark.parametrize("schedule", ["grouped_sections", "grouped_shift", "grouped_split"])
@pytest.mark.parametrize("shape", [(2, 256, 2048, 16, 2), (1, 200, 3000, 32, 1), (4, 640, 640, 16, 4), (2, 1024, 700, 8, 2)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("v", BWD_VARIANTS, ids=lambda v: v.name)
def test_grouped_schedules_on_large_groups(v, shape, schedule):
    require_built(v, "bwd")
    check_case(v, shape, seed=sum(shape), schedule=schedule, deterministic=True)
    check_case(v, shape, seed=sum(shape) + 1, schedule=schedule, deterministic=False)
    q, k, vv, dout = make_inputs(v, shape, 9)
    assert_bitwise_repeatable(lambda: grads(q, k, vv, dout, v.causal, deterministic=True, schedule=schedule)[1:], 5)


@pytest.mark.parametrize("shape", [(2, 512, 2048, 8, 2), (1, 700, 1300, 6, 3), (2, 256, 4096, 16, 2),
                                   (1, 1000, 1000, 4, 1)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_dkv_in_turns_is_the_slabs_bits(shape, causal):
    """Deterministic GQA: with the schedule's header dkv_ordered the query heads of a group add
    their dK/dV into one accumulator per KV head in turns; cleared, each writes its own slab and
    the postprocess sums them. Same additions in the same order: the same bits, for queue and
    static schedules (the flag set here wherever the order is safe, whether or not the policy
    asks for it), and repeatable."""
    from dash_fa3 import ops
    from dash_fa3.schedule import Geometry, bwd_block_sizes
    from dash_fa3.schedule import metadata as M
    from dash_fa3.schedule.validate import dkv_order_ok

    v = variants.Variant(128, "bf16", "causal" if causal else "full")
    b, sq, sk, h, hkv = shape
    right = 0 if causal else -1
    geometry = Geometry(b, h, hkv, sq, sk, *bwd_block_sizes(128), "causal" if causal else "full", -1, right)
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, shape, sum(shape) + causal)
    scale = 1.0 / math.sqrt(v.hdim)
    out, lse = ops.fwd(q, k, vv, scale, causal, 0)
    for schedule in ("auto", "fa3", "symmetric_shift", "split"):  # runs chains a group's heads: its own sums
        flat, header, run, _ = ops._bwd_plan(tuple(q.shape), tuple(k.shape), q.dtype, -1, right, False, True,
                                             schedule, 0, q.device, vv.shape[-1])
        meta = M.ScheduleMeta.from_int32_array(header.numpy())
        assert dkv_order_ok(meta, geometry, torch.cuda.get_device_properties(q.device).multi_processor_count)
        flat, header = flat.clone(), header.clone()
        flat[M.H_DKV_ORDERED] = header[M.H_DKV_ORDERED] = 1
        slab_flat, slab_header = flat.clone(), header.clone()
        slab_flat[M.H_DKV_ORDERED] = 0
        slab_header[M.H_DKV_ORDERED] = 0
        poison_cuda_allocator(1 << 28)
        turns = run(dout, q, k, vv, out, lse, flat, header, scale, -1, right, 0.0, True)
        slabs = run(dout, q, k, vv, out, lse, slab_flat, slab_header, scale, -1, right, 0.0, True)
        for name, x, y in zip(("dq", "dk", "dv"), turns, slabs):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), (schedule, name)
        for _ in range(3):
            again = run(dout, q, k, vv, out, lse, flat, header, scale, -1, right, 0.0, True)
            assert all(torch.equal(x, y) for x, y in zip(again, turns)), schedule


@pytest.mark.parametrize("hdim", [64, 128])
def test_dq_error_at_few_keys_is_rounding_noise(hdim):
    """Causal, bottom-right: 65 queries against 1-3 keys leave one or two nonzero dQ rows.
    The maximum error over so few values is one draw (attn_utils.FEW_VALUES says why the checks
    compare RMS errors there); this test backs that with 40 seeds per shape."""
    import statistics

    from attn_utils import ERR_FACTOR, ERR_FLOOR, error_problem, max_abs_err

    v = variants.Variant(hdim, "bf16", "causal")
    require_built(v, "bwd")
    for sq, sk in ((65, 2), (65, 3), (64, 2), (129, 2), (65, 1)):
        ratios = []
        for seed in range(40):
            q, k, vv, dout = make_inputs(v, (1, sq, sk, 2, 2), 1000 * sq + 10 * sk + seed)
            scale = 1.0 / math.sqrt(hdim)
            out, dq, _, _ = grads(q, k, vv, dout, True, scale, deterministic=False)
            dq_det = grads(q, k, vv, dout, True, scale, deterministic=True)[1]
            # one KV tile, one partial per dQ tile: the modes cannot differ but in the sign of a zero
            # (non-deterministic: added into a zeroed accumulator, +0; deterministic: stored as it is)
            assert torch.equal((dq + 0).view(torch.int16), (dq_det + 0).view(torch.int16)), (sq, sk, seed)
            ref = reference.attention_bwd_ref(dout, q, k, vv, out, scale, True)[0]
            lowp = lowp_grads(q, k, vv, dout, True, scale)[0]
            assert error_problem(dq, lowp, ref) is None, (sq, sk, seed, error_problem(dq, lowp, ref))
            e, e_lowp = max_abs_err(dq, ref), max_abs_err(lowp, ref)
            if sk == 1:
                # P = 1 on the one visible key: dS = dP - D vanishes in exact arithmetic, and both
                # implementations leave only an fp32 residue of it, far below bf16's step
                assert e <= ERR_FLOOR and e_lowp <= ERR_FLOOR, (seed, e, e_lowp)
            else:
                ratios.append(e / e_lowp)
        if ratios:
            # in distribution ours is no worse than the baseline: the rare maxima above
            # ERR_FACTOR are draws, not a bias
            assert statistics.median(ratios) <= 1.0, (sq, sk, statistics.median(ratios))
            assert max(ratios) < 4 * ERR_FACTOR, (sq, sk, max(ratios))


def test_nondeterministic_mode_runs_and_is_close():
    v = variants.Variant(128, "bf16", "full")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, (2, 2048, 2048, 8, 8), 7)
    det = grads(q, k, vv, dout, False, deterministic=True)[1:]
    nondet = grads(q, k, vv, dout, False, deterministic=False)[1:]
    for a, b in zip(nondet, det):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-3


@pytest.mark.parametrize("causal", [False, True])
def test_nondeterministic_auto_at_few_adds_is_the_deterministic_call(causal):
    # 512 x 512 at head dim 128: at most 4 dQ adds per Q tile, where the non-deterministic auto runs
    # the deterministic mode (policy.nd_runs_ordered): the same bits as deterministic=True.
    v = variants.Variant(128, "bf16", "causal" if causal else "full")
    require_built(v, "bwd")
    shape = (8, 512, 512, 4, 4)
    g = Geometry.from_shape(batch=8, seqlen_q=512, seqlen_k=512, heads=4, heads_kv=4, headdim=128, causal=causal)
    assert resolve_call("auto", g, False, headdim=128)[1]
    q, k, vv, dout = make_inputs(v, shape, 21 + causal)
    det = grads(q, k, vv, dout, causal, deterministic=True)
    nondet = grads(q, k, vv, dout, causal, deterministic=False)
    for name, a, b in zip(("out", "dq", "dk", "dv"), nondet, det):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


CHILD = r"""
import hashlib, sys, torch
sys.path.insert(0, sys.argv[1])
import dash_fa3
g = torch.Generator(device="cuda").manual_seed(1234)
mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
q, k, v, do = mk(1, 1500, 4, 128), mk(1, 1500, 2, 128), mk(1, 1500, 2, 128), mk(1, 1500, 4, 128)
q, k, v = (t.requires_grad_() for t in (q, k, v))
out = dash_fa3.flash_attn_func(q, k, v, causal=True, deterministic=True, schedule="spt")
h = hashlib.sha256()
for t in torch.autograd.grad(out, (q, k, v), do):
    h.update(t.float().cpu().numpy().tobytes())
print(h.hexdigest())
"""


def test_deterministic_across_processes():
    require_built(variants.Variant(128, "bf16", "causal"), "bwd")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = {
        subprocess.run([sys.executable, "-c", CHILD, root], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1


@pytest.mark.parametrize("shape", [(1, 1024, 4096, 4, 4), (2, 768, 768, 8, 2), (1, 512, 2048, 8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_dkv_partials_are_the_deterministic_calls_before_rounding(shape, causal):
    """ops.bwd_dkv_fp32 (context parallelism's partials): its dQ is the deterministic call's, bit for
    bit, and its fp32 dK/dV round to that call's dK/dV exactly, for MHA (the fp32 slabs instead of
    the TMA store), GQA and MQA; the fp32 values are not already rounded."""
    from dash_fa3 import ops

    v = variants.Variant(128, "bf16", "causal" if causal else "full")
    require_built(v, "fwd")
    require_built(v, "bwd")
    q, k, vv, dout = make_inputs(v, shape, 17)
    scale = 1.0 / math.sqrt(v.hdim)
    out, lse = ops.fwd(q, k, vv, scale, causal, 0)
    # the schedule bwd_dkv_fp32 runs: auto among those with fp32 dK/dV partials
    g = Geometry.from_shape(batch=shape[0], heads=shape[3], heads_kv=shape[4], seqlen_q=shape[1],
                            seqlen_k=shape[2], headdim=v.hdim, causal=causal)
    name = resolve_schedule_name("auto", g, num_sms=_ext.num_sms(torch.cuda.current_device()), headdim=v.hdim,
                                 dkv_fp32=True)
    dq, dk, dv = ops.bwd(dout, q, k, vv, out, lse, scale, causal, True, name, 0)
    dq32, dk32, dv32 = ops.bwd_dkv_fp32(dout, q, k, vv, out, lse, scale, causal)
    assert dk32.dtype == dv32.dtype == torch.float32 and dk32.shape == k.shape and dv32.shape == vv.shape
    assert torch.equal(dq32, dq)
    assert torch.equal(dk32.to(k.dtype), dk) and torch.equal(dv32.to(vv.dtype), dv)
    assert not torch.equal(dk32, dk.float())
