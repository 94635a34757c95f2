"""Context parallelism through the Megatron-Core adapter on the Hopper kernels, with two CP ranks
sharing one GPU (spawned processes; this file is also the worker).

Each rank sets Megatron up with ``initialize_model_parallel(context_parallel_size=P)`` over a gloo
group (NCCL refuses two ranks on one device; dash_fa3 moves the tensors through its shared
transport, as the ranks sharing a GPU in tests/test_gpu_distributed.py do), shards q, k, v, the
output gradient and the causal mask with Megatron's own ``get_batch_on_this_cp_rank`` and runs
``DashFA3DotProductAttention`` (bf16, GQA, ``config.deterministic_mode``) forward and backward,
twice. The output and the input gradients are gathered back into global token order. Then:

* the two passes at CP = 2 give the same bits;
* CP = 2 gives the bits of CP = 1 (the adapter's CP path over a group of one rank);
* the output and gradients are within 2x a plain PyTorch bf16 attention's error of the fp64
  reference.

Needs a Hopper GPU, the built extension (its hdim 128 bf16 causal kernels) and megatron-core 0.19
(Python >= 3.12); skips with the reason otherwise."""

import math
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core", minversion="0.19",
                    reason="megatron-core 0.19 is not installed (pip install megatron-core==0.19.2; Python >= 3.12)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_train_utils as cpu  # noqa: E402
import test_gpu_distributed as TG  # noqa: E402

pytestmark = pytest.mark.gpu

HERE = os.path.abspath(__file__)
# In test_gpu_distributed's case format: (causal, batch, heads, heads_kv, headdim, dtype, seqlen, layout);
# zigzag is Megatron's load balancing. 16384 tokens are two superblocks of the deterministic default
# (superblocks.SUPERBLOCK), so both ranks compute and their dK/dV partials meet in its sum tree, and
# the plain bf16 baseline's score matrices still fit the GPU.
CASE = (True, 1, 8, 2, 128, "bf16", 16384, "zigzag")
CP_SIZES = (1, 2)
WHAT = ("out", "dq", "dk", "dv")


def _worker(argv):
    rank, P, job, outdir = cpu.init_worker(argv)
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megatron_utils import transformer_config

    from dash_fa3.integrations import megatron as dm

    causal, b, h, hk, d, _, n, _ = CASE
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=P)
    cp_group = parallel_state.get_context_parallel_group()
    config = transformer_config(hidden_size=h * d, num_attention_heads=h, num_query_groups=hk, kv_channels=d,
                                bf16=True, context_parallel_size=P, deterministic_mode=True)
    attn = dm.DashFA3DotProductAttention(config, 1, AttnMaskType.causal if causal else AttnMaskType.no_mask, "self")
    assert (attn.cp_group is cp_group) == (P > 1)
    attn.cp_group = cp_group   # at CP = 1 too: the CP path over a group of one rank
    q, k, v, dout = (t.cuda() for t in TG.make_inputs(job["seed"], CASE))   # (batch, seq, heads, dim)
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1)[None, None]
    batch = get_batch_on_this_cp_rank({"q": q, "k": k, "v": v, "dout": dout, "attention_mask": mask,
                                       "cu_seqlens": None}, is_hybrid_cp=False, cp_group=cp_group)
    local = n // P
    passes = []
    for _ in range(2):
        # Megatron's core attention takes (seq, batch, heads, dim) and returns (seq, batch, heads * dim)
        ql, kl, vl = (batch[key].transpose(0, 1).contiguous().requires_grad_() for key in ("q", "k", "v"))
        out = attn(ql, kl, vl, batch["attention_mask"])
        out.backward(batch["dout"].transpose(0, 1).reshape(local, b, h * d))
        passes.append([cpu.gather_tokens(x.detach().cpu(), 0, cp_group, n) for x in (out, ql.grad, kl.grad, vl.grad)])
    torch.cuda.synchronize()
    if rank == 0:
        torch.save(passes, os.path.join(outdir, "passes.pt"))
    parallel_state.destroy_model_parallel()
    cpu.finish_worker(rank, outdir, {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(seed, {CP size: the two passes' [out, dq, dk, dv] in global token order, Megatron's shapes})."""
    from attn_utils import require_built

    from dash_fa3 import variants

    v = variants.Variant(CASE[4], CASE[5], "causal" if CASE[0] else "full")
    require_built(v, "fwd")
    require_built(v, "bwd")
    seed = int.from_bytes(os.urandom(4), "little")
    passes = {}
    with pytest.MonkeyPatch.context() as mp:
        for var, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                         ("NVSHMEM_DISABLE_NVLS", "1")):
            if var not in os.environ:   # NVLink multicast stays off on the shared GPU hosts
                mp.setenv(var, val)
        # symmetric memory maps the other processes' buffers on the same device only if told to
        mp.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
        mp.setenv("DASH_FA3_CP_TRANSPORT", "shared")
        for P in CP_SIZES:
            out = tmp_path_factory.mktemp(f"mcore_gpu_cp{P}")
            cpu.launch(HERE, P, {"seed": seed, "timeout_s": 120}, out, sys.executable, wait_s=600)
            passes[P] = torch.load(out / "passes.pt")
    return seed, passes


def _differ(what, a, b, seed, where):
    return f"{what}: {where} in {(a != b).sum().item()} of {a.numel()} elements (seed {seed})"


def test_deterministic_cp2_repeats_bitwise(runs):
    seed, passes = runs
    first, second = passes[2]
    for what, a, b in zip(WHAT, first, second):
        assert torch.equal(a, b), _differ(what, a, b, seed, "the second CP = 2 pass differs from the first")


def test_deterministic_cp2_is_bitwise_cp1(runs):
    seed, passes = runs
    for what, a, b in zip(WHAT, passes[2][0], passes[1][0]):
        assert torch.equal(a, b), _differ(what, a, b, seed, "CP = 2 differs from CP = 1")


def test_cp2_is_within_twice_plain_bf16_error_of_fp64(runs):
    from attn_utils import assert_close_to_ref, attention_lowp

    from dash_fa3 import reference

    seed, passes = runs
    causal, b, h, _, d, _, n, _ = CASE
    q, k, v, dout = (t.cuda() for t in TG.make_inputs(seed, CASE))
    scale = 1.0 / math.sqrt(d)
    # Megatron's (seq, batch, ...) back to (batch, seq, heads, dim)
    out, dq, dk, dv = (x.cuda().view(n, b, -1, d).transpose(0, 1) for x in passes[2][0])
    ref_out, _ = reference.attention_ref(q, k, v, scale, causal, torch.float64)
    ref_grads = reference.attention_bwd_ref(dout, q, k, v, ref_out, scale, causal, torch.float64)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    lowp_out, _ = attention_lowp(qq, kk, vv, scale, causal)
    lowp_grads = torch.autograd.grad(lowp_out, (qq, kk, vv), dout)
    for what, ours, lowp, ref in zip(WHAT, (out, dq, dk, dv), (lowp_out.detach(), *lowp_grads),
                                     (ref_out, *ref_grads)):
        assert ours.dtype == q.dtype
        assert_close_to_ref(f"Megatron CP = 2 {what} (seed {seed})", ours, lowp, ref)


if __name__ == "__main__":
    _worker(sys.argv[1:])
