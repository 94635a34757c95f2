"""How window calls reach the kernels, checked on the CPU: the CUDA implementations of
dash_fa3::fwd_general / bwd_general call the C++ dispatch (a stand-in here) with the
window, and the backward's schedule is built for the local mask kind and that window."""

import numpy as np
import pytest
import torch

from dash_fa3 import ops, variants
from dash_fa3.schedule import metadata as M
from dash_fa3.schedule.contract import SCHEDULES


class FakeOps:
    """Stands in for torch.ops.dash_fa3_C: records the calls."""

    def __init__(self):
        self.calls = []

    def fwd_window(self, *args):
        self.calls.append(("fwd_window", args))
        q = args[0]
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    @property
    def bwd(self):
        outer = self

        class _Bwd:
            def default(self, *args):
                outer.calls.append(("bwd", args))
                return args[1], args[2], args[3]

        return _Bwd()


@pytest.fixture
def fake_ext(monkeypatch):
    fake = FakeOps()
    built = tuple(v.name for v in variants.ALL_VARIANTS if v.has_bwd)
    monkeypatch.setattr(ops._ext, "ops", lambda: fake)
    monkeypatch.setattr(ops._ext, "built_variants", lambda direction, packed=False, softcap=False: built)
    monkeypatch.setattr(ops._ext, "num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ops._bwd_plan.cache_clear()
    yield fake
    ops._bwd_plan.cache_clear()


def qkv(b=2, sq=300, sk=500, h=4, hkv=2, d=128):
    q = torch.zeros(b, sq, h, d, dtype=torch.bfloat16)
    k = torch.zeros(b, sk, hkv, d, dtype=torch.bfloat16)
    return q, k, k.clone()


def test_fwd_general_cuda_runs_the_window_kernel(fake_ext):
    q, k, v = qkv()
    ops._fwd_general_cuda(q, k, v, None, None, 0, 0, 0.125, 64, 0, 0.0, 3)
    name, args = fake_ext.calls[-1]
    assert name == "fwd_window" and args[3:] == (0.125, 64, 0, 0.0, 3)


@pytest.mark.parametrize("window", [(64, 0), (0, 0), (100, -1), (-1, 50), (30, 20)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_general_cuda_builds_a_local_schedule(fake_ext, window, deterministic):
    q, k, v = qkv()
    out = torch.zeros_like(q)
    lse = torch.zeros(2, 4, 300)
    ops._bwd_general_cuda(out, q, k, v, out, lse, None, None, 0, 0, 0.125, *window, 0.0, deterministic, "auto", 0)
    name, args = fake_ext.calls[-1]
    assert name == "bwd"
    flat, header, scale, left, right, softcap, det = args[6:13]
    assert (scale, left, right, softcap, det) == (0.125, *window, 0.0, deterministic)
    h = header.numpy()
    assert h[M.H_MASK] == M.MASK_LOCAL and (h[M.H_WINDOW_LEFT], h[M.H_WINDOW_RIGHT]) == window
    assert (h[M.H_SEQLEN_Q], h[M.H_SEQLEN_K], h[M.H_BLOCK_M], h[M.H_BLOCK_N]) == (300, 500, 64, 128)
    assert np.array_equal(flat.numpy(), h)
    assert SCHEDULES[h[M.H_SCHEDULE]] == ("spt" if deterministic else "lpt")


def test_plain_bwd_passes_the_fixed_windows(fake_ext):
    q, k, v = qkv()
    out = torch.zeros_like(q)
    for causal, window in ((True, (-1, 0)), (False, (-1, -1))):
        ops._bwd_cuda(out, q, k, v, out, torch.zeros(2, 4, 300), 0.125, causal, True, "fa3", 0)
        args = fake_ext.calls[-1][1]
        assert (args[9], args[10]) == window
        h = args[7].numpy()
        assert h[M.H_MASK] == (M.MASK_CAUSAL if causal else M.MASK_FULL)


@pytest.mark.parametrize("hdim,tiles", [(192, (64, 96)), (256, (64, 64))])
def test_wide_head_dims_take_their_tiles(fake_ext, hdim, tiles):
    # 192: three MMA warpgroups with 96-row KV tiles; 256: the two-warpgroup head-dim split.
    q, k, v = qkv(d=hdim)
    out = torch.zeros_like(q)
    ops._bwd_cuda(out, q, k, v, out, torch.zeros(2, 4, 300), 0.125, True, True, "auto", 0)
    name, args = fake_ext.calls[-1]
    h = args[7].numpy()
    assert name == "bwd" and (h[M.H_BLOCK_M], h[M.H_BLOCK_N], h[M.H_MASK]) == (*tiles, M.MASK_CAUSAL)
    assert SCHEDULES[h[M.H_SCHEDULE]] == "spt"


def test_a_backward_variant_missing_from_the_build_is_an_error(fake_ext, monkeypatch):
    # No reference fallback on the GPU: the error says what was built and how to build the rest.
    monkeypatch.setattr(ops._ext, "built_variants", lambda direction, packed=False, softcap=False: ("hdim128-bf16-causal",))
    q, k, v = qkv(d=256)
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match=r"no backward kernel for hdim256-bf16-causal .*built: "
                                           r"hdim128-bf16-causal.*DASH_FA3_VARIANTS=hdim256"):
        ops._bwd_cuda(out, q, k, v, out, torch.zeros(2, 4, 300), 0.125, True, True, "auto", 0)
    assert fake_ext.calls == []


def test_softcap_runs_the_softcap_kernels(fake_ext, monkeypatch):
    asked = []

    def built(direction, packed=False, softcap=False):
        asked.append((direction, packed, softcap))
        return ("hdim128-bf16-causal",) if softcap else ()

    monkeypatch.setattr(ops._ext, "built_variants", built)
    q, k, v = qkv()
    out = torch.zeros_like(q)
    ops._fwd_general_cuda(q, k, v, None, None, 0, 0, 0.125, -1, 0, 30.0, 0)
    assert fake_ext.calls[-1] == ("fwd_window", (q, k, v, 0.125, -1, 0, 30.0, 0))
    ops._bwd_general_cuda(out, q, k, v, out, torch.zeros(2, 4, 300), None, None, 0, 0, 0.125, -1, 0, 30.0, True,
                          "auto", 0)
    name, args = fake_ext.calls[-1]
    assert name == "bwd" and args[8:13] == (0.125, -1, 0, 30.0, True)
    assert asked == [("bwd", False, True)]


def test_a_softcap_build_missing_is_an_error_naming_the_switch(fake_ext, monkeypatch):
    monkeypatch.setattr(ops._ext, "built_variants",
                        lambda direction, packed=False, softcap=False: () if softcap else ("hdim128-bf16-causal",))
    q, k, v = qkv()
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match=r"no softcap backward kernel for hdim128-bf16-causal .*DASH_FA3_SOFTCAP=1"):
        ops._bwd_general_cuda(out, q, k, v, out, torch.zeros(2, 4, 300), None, None, 0, 0, 0.125, -1, 0, 30.0,
                              True, "auto", 0)
    assert fake_ext.calls == []
