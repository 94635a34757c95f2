"""The Megatron-Core adapter through the Hopper kernels: a tiny GPT on the GPU
against Megatron's own local-spec model, and the deterministic mode's bits.

Needs a Hopper GPU, the built extension and megatron-core 0.19 (Python >= 3.12);
skips with the reason otherwise. Megatron is set up as for one GPU: a gloo
process group of world size 1, ``initialize_model_parallel(1, 1)`` and its CUDA
RNG tracker seeded."""


import pytest
import torch

pytest.importorskip("megatron.core", minversion="0.19",
                    reason="megatron-core 0.19 is not installed (pip install megatron-core==0.19.2; Python >= 3.12)")


from dash_fa3.integrations import megatron as dm  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from attn_utils import assert_model_close_to_reference  # noqa: E402
from megatron_utils import three_gpts, transformer_config, world_of_one  # noqa: E402

pytestmark = pytest.mark.gpu

# Our error may be at most this multiple of Megatron's own bf16 model's error
# (both against its fp32 model), plus a small floor.
ERR_FACTOR = 2.0
ERR_FLOOR = 2e-3
VOCAB, SEQLEN = 1000, 512


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    if not torch.cuda.is_available():
        pytest.skip("GPU test: no CUDA device")
    with world_of_one():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        yield


# A wider model than the CPU tests' (8 query heads), still GQA with 2 groups.
SIZES = dict(hidden_size=512, num_attention_heads=8, ffn_hidden_size=1024)


def gpt(cfg, spec, seed):
    torch.manual_seed(seed)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQLEN,
                    position_embedding_type="rope")


def test_gpt_on_the_kernels_matches_megatron():
    seed = 3
    ref, eager, ours = three_gpts(gpt, seed, **SIZES)
    ref, eager, ours = ref.cuda(), eager.cuda().to(torch.bfloat16), ours.cuda().to(torch.bfloat16)
    assert all(isinstance(a, dm.DashFA3DotProductAttention)
               for a in (layer.self_attention.core_attention for layer in ours.decoder.layers))
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randint(0, VOCAB, (2, SEQLEN), device="cuda", generator=g)
    pos = torch.arange(SEQLEN, device="cuda").expand_as(x)
    results = {}
    for name, model in (("ref", ref), ("eager", eager), ("ours", ours)):
        logits = model(x, pos, attention_mask=None)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        results[name] = (logits.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()})
    assert_model_close_to_reference(results, ("self_attention",), "Megatron bf16", ERR_FACTOR, ERR_FLOOR, min_checked=4)


def test_deterministic_mode_gives_the_same_bits():
    """config.deterministic_mode: the core attention's input gradients are bitwise repeatable."""
    cfg = transformer_config(bf16=True, deterministic_mode=True, **SIZES)
    attn = dm.DashFA3DotProductAttention(cfg, layer_number=1, attn_mask_type=dm.AttnMaskType.causal,
                                         attention_type="self")
    g = torch.Generator(device="cuda").manual_seed(7)
    s, b, h, hkv, d = SEQLEN, 2, 8, 2, 64
    q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(s, b, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(s, b, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(s, b, h * d, device="cuda", dtype=torch.bfloat16, generator=g)
    grads = []
    for _ in range(5):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*leaves, attention_mask=None)
        grads.append(torch.autograd.grad(out, leaves, dout))
    for other in grads[1:]:
        for a, b_ in zip(grads[0], other):
            assert torch.equal(a.view(torch.int16), b_.view(torch.int16))
