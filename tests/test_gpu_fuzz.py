"""Seeded GPU fuzz of the backward (issue 15): random shapes over both modes and
every schedule, gradients against the fp32 reference, bitwise repeats of the
deterministic mode, and a watchdog.

The cases run in a child process that reports each one as it starts and ends;
a case that does not end within WATCHDOG_S (a semaphore wait that never
returns hangs the GPU, and nothing in-process can interrupt a kernel) kills
the child and fails the test, naming the case. DASH_FA3_FUZZ_CASES sets the
number of cases (default 520: at least 500, and every schedule of the
deterministic mode gets its share).
"""

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
WATCHDOG_S = 120
CASES = int(os.environ.get("DASH_FA3_FUZZ_CASES", "520"))

CHILD = r"""
import json, math, random, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import torch
import dash_fa3
from dash_fa3 import _ext, reference, variants
from dash_fa3.schedule import SCHEDULES, Geometry, schedules_for
from attn_utils import attention_lowp, error_problem, make_inputs
from conftest import poison_cuda_allocator

seed, cases = int(sys.argv[3]), int(sys.argv[4])
built = [v for v in variants.ALL_VARIANTS
         if v.has_bwd and not v.local and v.name in _ext.built_variants("bwd", False, False)]
if not built:
    print(json.dumps({"skip": "no dense full/causal backward kernel in this build"}), flush=True)
    sys.exit(0)
rng = random.Random(seed)


def shape_for(v):
    # Lengths up to 2048 (ragged tiles, seqlen_q != seqlen_k, now and then twice as
    # long: the strided cyclic legs), GQA/MQA, enough heads for waves of static
    # schedules to straddle heads.
    hkv = rng.choice([1, 1, 2, 3, 4])
    h = hkv * rng.choice([1, 1, 2, 4])
    b = rng.choice([1, 1, 2, 3])
    sq = rng.randint(1, 2048)
    r = rng.random()
    sk = sq if r < 0.4 else (max(1, sq // 2) if r < 0.55 else rng.randint(1, 2048))
    while b * h * max(sq, sk) > 24 * 2048:
        b, h = max(1, b - 1), max(hkv, h // 2)
    return b, sq, sk, h, hkv


def grads(q, k, vv, dout, causal, scale, **kw):
    q, k, vv = (t.detach().requires_grad_() for t in (q, k, vv))
    poison_cuda_allocator(1 << 26)
    out = dash_fa3.flash_attn_func(q, k, vv, softmax_scale=scale, causal=causal, **kw)
    return out, torch.autograd.grad(out, (q, k, vv), dout)


names = list(SCHEDULES) + ["auto"]
for i in range(cases):
    v = built[i % len(built)]
    shape = shape_for(v)
    det = i % 4 != 3
    schedule = names[(i // 4) % len(names)] if det else rng.choice(names)
    b, sq, sk, h, hkv = shape
    g = Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=v.hdim, causal=v.causal)
    if schedule != "auto" and schedule not in schedules_for(g):
        schedule = "auto"  # runs and groups: not at head dim 192, whose kernel has no chains
    case = {"i": i, "variant": v.name, "shape": shape, "deterministic": det, "schedule": schedule}
    print(json.dumps({"start": case}), flush=True)
    q, k, vv, dout = make_inputs(v, shape, seed * 100003 + i)
    scale = 1.0 / math.sqrt(v.hdim)
    out, got = grads(q, k, vv, dout, v.causal, scale, deterministic=det, schedule=schedule)
    ref = reference.attention_bwd_ref(dout, q, k, vv, out, scale, v.causal)
    lq, lk, lv = (t.detach().requires_grad_() for t in (q, k, vv))
    lowp = torch.autograd.grad(attention_lowp(lq, lk, lv, scale, v.causal)[0], (lq, lk, lv), dout)
    problems = []
    for name, ours, want, base in zip(("dq", "dk", "dv"), got, ref, lowp):
        problem = error_problem(ours, base, want)
        if problem is not None:
            problems.append(f"{name}: {problem}")
    if det:
        again = grads(q, k, vv, dout, v.causal, scale, deterministic=True, schedule=schedule)[1]
        for name, a, b in zip(("dq", "dk", "dv"), got, again):
            if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                problems.append(f"{name}: a second deterministic run differs in its bits")
    torch.cuda.synchronize()
    print(json.dumps({"end": i, "problems": problems}), flush=True)
print(json.dumps({"done": cases}), flush=True)
"""


def test_fuzz_backward_with_watchdog():
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, os.path.dirname(HERE), HERE, "2026", str(CASES)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
    started, failures, ended, done = None, [], 0, False
    try:
        while True:
            try:
                line = lines.get(timeout=WATCHDOG_S)
            except queue.Empty:
                pytest.fail(f"watchdog: no progress for {WATCHDOG_S} s (deadlock?) in case {started}")
            if line is None:
                break
            msg = json.loads(line)
            if "skip" in msg:
                pytest.skip(msg["skip"])
            if "start" in msg:
                started = msg["start"]
            elif "end" in msg:
                ended += 1
                if msg["problems"]:
                    failures.append((started, msg["problems"]))
            elif "done" in msg:
                done = True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    stderr.seek(0)
    err = stderr.read()
    assert done and proc.returncode == 0, f"child exited with {proc.returncode} after {ended} cases: {err[-3000:]}"
    assert ended == CASES
    assert not failures, f"{len(failures)} of {CASES} cases failed, first: {failures[:3]}"
