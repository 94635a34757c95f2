"""Context parallelism through the TorchTitan adapter: a tiny Llama 3 trained on CPU (gloo, spawned
processes; this file is also the worker) with CP = 1, 2, 3 and 4.

Each run shards the tokens, labels and positions with TorchTitan's own
``prepare_context_parallel_input`` (the default "headtail" load balancer) and hands the model's
``DashFA3Attention`` modules the CP mesh with ``apply_cp``; CP = 1 is the plain single-device
adapter. ``deterministic`` is left at None, so it follows ``torch.use_deterministic_algorithms``
(what TorchTitan's ``debug.deterministic`` sets). Gradients are reduced in global block order
(``cp_train_utils.BlockOrderedGrads``), so the runs' bits differ only where a token's activations
or gradients do: deterministic, the losses, gradient norms and final weights are bitwise those of
CP = 1; non-deterministic, equal to rounding.

Skips without torchtitan 0.3 whose Llama 3 imports (CI's newest-torch leg has it)."""

import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan==0.3.0)")
try:
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock
except ImportError as exc:
    pytest.skip(f"torchtitan's Llama 3 does not import here (torch {torch.__version__}): {exc}",
                allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_train_utils as cpu  # noqa: E402

pytestmark = pytest.mark.distributed

VOCAB, SEQLEN, STEPS, LR = 97, 1024, 3, 0.5
CP_SIZES = (1, 2, 4)


def tiny_llama(seed):
    """2 layers, 4 query and 4 KV heads of dim 64 (n_kv_heads >= CP for the deterministic default)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    def normal(std):
        return {"weight": lambda w: torch.nn.init.normal_(w, std=std), "bias": torch.nn.init.zeros_}

    dim, heads, head_dim = 128, 4, 64
    blocks = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim),
            ffn_norm=RMSNorm.Config(normalized_shape=dim),
            attention=make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=heads, head_dim=head_dim,
                                      wqkv_param_init=normal(0.08), wo_param_init=normal(0.08),
                                      inner_attention=ScaledDotProductAttention.Config(),
                                      rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=SEQLEN, theta=10000.0)),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=256, w1_param_init=normal(0.05),
                                         w2w3_param_init=normal(0.05)),
        )
        for _ in range(2)
    ]
    config = Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=blocks,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=normal(1.0)),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=normal(0.05)),
    )
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


# ------------------------------------------------------------------------------------------ worker

def _worker(argv):
    rank, P, job, outdir = cpu.init_worker(argv)
    seqlen = job["seqlen"]
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    from dash_fa3.integrations import torchtitan as dtt

    torch.use_deterministic_algorithms(job["deterministic"])
    model = dtt.apply(tiny_llama(job["seed"]))
    params32 = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    g = torch.Generator().manual_seed(job["seed"] + 1)
    seq = torch.randint(0, VOCAB, (1, seqlen + 1), generator=g)
    inputs, labels = seq[:, :-1], seq[:, 1:]
    extra = {"positions": torch.arange(seqlen)[None]}
    if job["cp_path"]:   # at P = 1 too: the CP path over a mesh of one rank
        mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
        inputs, labels, extra = prepare_context_parallel_input(inputs, labels, extra, mesh, torch.device("cpu"),
                                                               load_balancer_type="headtail")
        dtt.apply_cp(model, mesh)
        kinds = {type(m).__name__ for m in model.modules() if getattr(m, "cp_group", None) is not None}
        assert kinds == {"DashFA3Attention"}, kinds

    def step():
        logits = model(inputs, positions=extra["positions"])
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                 reduction="none").view(labels.shape)

    losses, norms = cpu.train(model, params32, step, STEPS, LR, dist.group.WORLD, seqlen,
                              token_dims=lambda module: (1, 1))
    if rank == 0:
        torch.save(params32, os.path.join(outdir, "params.pt"))
    cpu.finish_worker(rank, outdir, {"losses": losses, "norms": norms})


# ------------------------------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(P, deterministic, cp_path=True, seqlen=SEQLEN):
        key = (P, deterministic, cp_path, seqlen)
        if key not in cache:
            mode = ("det" if deterministic else "nondet") + ("" if cp_path else "_plain") + f"_{seqlen}"
            out = tmp_path_factory.mktemp(f"tt_cp{P}_{mode}")
            res = cpu.launch(os.path.abspath(__file__), P, {"seed": 5, "deterministic": deterministic,
                                                            "cp_path": cp_path, "seqlen": seqlen,
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
    assert not torch.equal(ref_params[0], tiny_llama(5).tok_embeddings.weight.detach())   # the weights moved


def test_deterministic_training_at_cp3_is_bitwise_cp1(runs):
    """An odd CP size, uneven KV heads per rank (2 of 4 on one), at 768 tokens (a multiple of 2*3*128)."""
    (ref, ref_params), (got, got_params) = runs(1, True, seqlen=768), runs(3, True, seqlen=768)
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert all(torch.equal(a, b) for a, b in zip(got_params, ref_params))


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


def test_refusals_under_context_parallelism(tmp_path):
    """apply_cp before apply, and packed documents under CP, are one-line errors."""
    from torchtitan.models.common import VarlenMetadata

    from dash_fa3.integrations import torchtitan as dtt

    with pytest.raises(dtt.UnsupportedAttention, match="call apply\\(model\\) before apply_cp"):
        dtt.apply_cp(tiny_llama(1), object())
    with pytest.raises(TypeError, match="CP mesh dimension"):
        dtt.apply_cp(dtt.apply(tiny_llama(1)), object())
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = dtt.apply_cp(dtt.apply(tiny_llama(1)), dist.group.WORLD).layers["0"].attention.inner_attention
        assert module.cp_group is not None
        q = torch.zeros(1, 256, 4, 64, dtype=torch.bfloat16)
        cu = torch.tensor([0, 100, 256], dtype=torch.int32)
        packed = VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=156, max_k=156)
        with pytest.raises(dtt.UnsupportedAttention, match="packed in rows with context parallelism"):
            module(q, q, q, attention_masks=packed)
    finally:
        if owned:
            dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
