"""Context parallelism through the Megatron-Core adapter: a tiny GPT trained on CPU (gloo, spawned
processes; this file is also the worker) with context_parallel_size = 1, 2, 3 and 4.

Each run sets Megatron up with ``initialize_model_parallel(context_parallel_size=P)``, builds the
GPT from ``get_gpt_layer_dash_fa3_spec`` and shards tokens, labels, positions and the causal mask
with Megatron's own ``get_batch_on_this_cp_rank``; ``config.deterministic_mode`` selects the
deterministic algorithm. Gradients are reduced in global block order
(``cp_train_utils.BlockOrderedGrads``), so the runs' bits differ only where a token's activations
or gradients do: deterministic, the losses, gradient norms and final weights are bitwise those of
CP = 1; non-deterministic, equal to rounding.

Skips without megatron-core 0.19 (Python >= 3.12; CI's newest-torch leg has it)."""

import contextlib
import os
import re
import sys

import pytest
import torch

pytest.importorskip("megatron.core", minversion="0.19",
                    reason="megatron-core 0.19 is not installed (pip install megatron-core==0.19.2; Python >= 3.12)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_train_utils as cpu  # noqa: E402

pytestmark = pytest.mark.distributed

VOCAB, SEQLEN, STEPS, LR = 97, 1024, 3, 0.5
CP_SIZES = (1, 2, 4)


class _CpuBuffer:
    def get_tensor(self, shape, dtype, name, **kwargs):
        return torch.empty(shape, dtype=dtype)


def megatron_on_cpu():
    """Megatron's CUDA-only global buffer and RNG-tracker fork pointed at the CPU (nothing uses
    them for randomness here: every dropout is 0)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.get_global_memory_buffer = lambda: _CpuBuffer()
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def tiny_gpt(P, deterministic, seed, cp_comm_type=None):
    """2 layers, 4 query and 4 KV heads of dim 64, learned absolute positions (Megatron's rotary
    embeddings are CUDA-only)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron_utils import transformer_config

    from dash_fa3.integrations import megatron as dm

    config = transformer_config(num_attention_heads=4, num_query_groups=4, kv_channels=64, bf16=True,
                                context_parallel_size=P, deterministic_mode=deterministic, cp_comm_type=cp_comm_type)
    spec = dm.get_gpt_layer_dash_fa3_spec(normalization="RMSNorm", deterministic=deterministic)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQLEN,
                    position_embedding_type="learned_absolute")


# ------------------------------------------------------------------------------------------ worker

def _worker(argv):
    rank, P, job, outdir = cpu.init_worker(argv)
    seqlen = job["seqlen"]
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.utils import get_batch_on_this_cp_rank

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=P)
    megatron_on_cpu()
    cp_group = parallel_state.get_context_parallel_group()
    model = tiny_gpt(P, job["deterministic"], job["seed"], job["cp_comm_type"])
    kinds = {type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers}
    assert kinds == {"DashFA3DotProductAttention"}, kinds
    assert all((layer.self_attention.core_attention.cp_group is not None) == (P > 1) for layer in model.decoder.layers)
    if job["cp_path"]:   # at P = 1 too: the CP path over a group of one rank
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.cp_group = cp_group
    params32 = [p.detach().clone() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(job["seed"] + 1)
    seq = torch.randint(0, VOCAB, (1, seqlen + 1), generator=g)
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(seqlen)[None],
             "attention_mask": torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)[None, None],
             "cu_seqlens": None}
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)

    def step():
        logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                                                 reduction="none").view(batch["labels"].shape)

    def token_dims(module):
        # Embeddings take (batch, seq) ids; everything after them runs (seq, batch, hidden).
        return (1, 1) if isinstance(module, (VocabParallelEmbedding, torch.nn.Embedding)) else (0, 0)

    losses, norms = cpu.train(model, params32, step, STEPS, LR, cp_group, seqlen, token_dims)
    if rank == 0:
        torch.save(params32, os.path.join(outdir, "params.pt"))
    parallel_state.destroy_model_parallel()
    cpu.finish_worker(rank, outdir, {"losses": losses, "norms": norms})


# ------------------------------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(P, deterministic, cp_path=True, seqlen=SEQLEN, cp_comm_type=None):
        key = (P, deterministic, cp_path, seqlen, cp_comm_type)
        if key not in cache:
            mode = (("det" if deterministic else "nondet") + ("" if cp_path else "_plain") + f"_{seqlen}"
                    + ("" if cp_comm_type is None else f"_{cp_comm_type}"))
            out = tmp_path_factory.mktemp(f"mcore_cp{P}_{mode}")
            res = cpu.launch(os.path.abspath(__file__), P, {"seed": 7, "deterministic": deterministic,
                                                            "cp_path": cp_path, "seqlen": seqlen,
                                                            "cp_comm_type": cp_comm_type,
                                                            "timeout_s": 120}, out, sys.executable)
            assert all(res[r] == res[0] for r in res), res   # every rank reports the same global numbers
            cache[key] = (res[0], torch.load(out / "params.pt"))
        return cache[key]

    return get


@pytest.mark.parametrize("P", CP_SIZES[1:])
def test_deterministic_training_is_bitwise_the_same_for_every_cp_size(runs, P):
    (ref, ref_params), (got, got_params) = runs(1, True), runs(P, True)
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert ref["losses"][-1] < ref["losses"][0]   # it trains
    assert all(torch.equal(a, b) for a, b in zip(got_params, ref_params))


def test_deterministic_training_at_cp3_is_bitwise_cp1(runs):
    """An odd CP size, uneven KV heads per rank (2 of 4 on one), at 768 tokens (a multiple of 2*3*128)."""
    (ref, ref_params), (got, got_params) = runs(1, True, seqlen=768), runs(3, True, seqlen=768)
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert all(torch.equal(a, b) for a, b in zip(got_params, ref_params))


def test_training_with_a_cp_comm_type_is_bitwise_the_default(runs):
    """config.cp_comm_type names Transformer Engine's exchange; dash_fa3 runs its own over the same
    group whatever it names (among the accepted values), so the bits are CP = 1's."""
    (ref, ref_params), (got, got_params) = runs(1, True), runs(2, True, cp_comm_type="a2a")
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert all(torch.equal(a, b) for a, b in zip(got_params, ref_params))


def test_cp_comm_type_is_checked_at_construction():
    """Megatron hands each layer its entry of config.cp_comm_type. The accepted values construct;
    "a2a+p2p" (hierarchical CP groups) is refused with UnsupportedAttention, an unknown value or a
    non-string with ValueError / TypeError, each naming the value, the layer and what is accepted.
    Through GPTModel (a per-layer list: the layer gets its entry) the refusal comes before any CP
    group is looked up (here a world of one rank with context_parallel_size=2 in the config)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_utils import transformer_config, world_of_one

    from dash_fa3.integrations import megatron as dm

    accepted = re.escape("None, 'p2p', 'all_gather', 'a2a'")
    for value in (None, "p2p", "all_gather", "a2a"):
        dm.DashFA3DotProductAttention(transformer_config(bf16=True), 1, AttnMaskType.causal, "self",
                                      cp_comm_type=value)
    cases = [("a2a+p2p", dm.UnsupportedAttention, re.escape("cp_comm_type='a2a+p2p' (layer 3)") + f".*{accepted}"),
             ("allgather", ValueError, f"unknown cp_comm_type 'allgather' in layer 3.*accepts {accepted}"),
             (["p2p"], TypeError, f"cp_comm_type must be .*{accepted}.*got " + re.escape("['p2p'] in layer 3"))]
    for value, kind, text in cases:
        with pytest.raises(kind, match=text):
            dm.DashFA3DotProductAttention(transformer_config(bf16=True), 3, AttnMaskType.causal, "self",
                                          cp_comm_type=value)
    spec = dm.get_gpt_layer_dash_fa3_spec(normalization="RMSNorm")
    with world_of_one():
        for value, kind, text in (
                (["a2a+p2p", "p2p"], dm.UnsupportedAttention, re.escape("cp_comm_type='a2a+p2p' (layer 1)")),
                ("ring", ValueError, "unknown cp_comm_type 'ring' in layer 1")):
            config = transformer_config(bf16=True, context_parallel_size=2, cp_comm_type=value)
            with pytest.raises(kind, match=text):
                GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQLEN,
                         position_embedding_type="learned_absolute")


@pytest.mark.parametrize("P", CP_SIZES[1:])
def test_nondeterministic_training_agrees_to_rounding(runs, P):
    (ref, ref_params), (got, got_params) = runs(1, True), runs(P, False)
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-3)
    assert got["norms"] == pytest.approx(ref["norms"], rel=2e-2)
    for a, b in zip(got_params, ref_params):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_single_device_adapter_agrees_with_one_rank_context_parallelism(runs):
    """Without CP the adapter calls flash_attn_func. On the GPU that is bitwise the CP path's
    per-head compute; on the CPU the two are different references, equal to rounding."""
    (ref, ref_params), (got, got_params) = runs(1, True), runs(1, True, cp_path=False)
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-3)
    assert got["norms"] == pytest.approx(ref["norms"], rel=2e-2)
    for a, b in zip(got_params, ref_params):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_packed_sequences_with_context_parallelism_are_refused(tmp_path):
    """THD-packed sequences under CP: a one-line error naming them (here with a CP group of one
    rank standing in for Megatron's, so the call needs no peers)."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_utils import transformer_config

    from dash_fa3.integrations import megatron as dm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        attn = dm.DashFA3DotProductAttention(transformer_config(bf16=True), 1, AttnMaskType.causal, "self")
        attn.cp_group = dist.group.WORLD   # what context_parallel_size > 1 sets
        cu = torch.tensor([0, 100, 256], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=156,
                                 max_seqlen_kv=156)
        q = torch.zeros(256, 4, 64, dtype=torch.bfloat16)
        with pytest.raises(dm.UnsupportedAttention, match="packed sequences \\(qkv_format='thd'\\) with context"):
            attn(q, q, q, None, packed_seq_params=params)
    finally:
        dist.destroy_process_group()


def test_cp_causal_mask_must_have_this_ranks_zigzag_rows(monkeypatch):
    """Under CP the causal mask as Megatron's get_batch_on_this_cp_rank shards it is causal; the
    query rows of another layout (contiguous) are not."""
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    from dash_fa3.integrations import megatron as dm

    n, P = 512, 2
    full = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: P)
    for rank in range(P):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        sharded = get_batch_on_this_cp_rank({"attention_mask": full.clone(), "cu_seqlens": None},
                                            is_hybrid_cp=False, cp_group=None)["attention_mask"]
        assert dm._mask_kind(sharded, n // P, n, (rank, P)) == "causal"
        contiguous = full[:, :, rank * n // P:(rank + 1) * n // P].clone()
        assert dm._mask_kind(contiguous, n // P, n, (rank, P)) is None

if __name__ == "__main__":
    _worker(sys.argv[1:])
