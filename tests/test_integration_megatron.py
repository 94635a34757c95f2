"""The Megatron-Core adapter on tiny GPT models (CPU: the reference path).

Skips without megatron-core 0.19 (``pip install megatron-core==0.19.2``, which
needs Python >= 3.12). Megatron is set up as it is for one GPU: a gloo process
group of world size 1 and ``initialize_model_parallel(1, 1)``.

Megatron's own ``DotProductAttention``, the reference here, allocates its score
buffer and its default causal mask on CUDA and forks the CUDA RNG tracker around
its dropout; ``megatron_on_cpu`` points those three at the CPU (no dropout runs:
p = 0) so that the reference runs here, and the models get the explicit causal
mask that Megatron's dataloader builds. Rotary embeddings are CUDA-only in
Megatron, so the models use learned absolute positions."""

import contextlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", minversion="0.19",
                    reason="megatron-core 0.19 is not installed (pip install megatron-core==0.19.2; Python >= 3.12)")


import dash_fa3  # noqa: E402
from dash_fa3.integrations import megatron as dm  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from attn_utils import assert_model_close_to_reference  # noqa: E402
from megatron_utils import three_gpts, transformer_config, world_of_one  # noqa: E402

# Our error may be at most this multiple of Megatron's own bf16 model's error
# (both against its fp32 model), plus a small floor.
ERR_FACTOR = 2.0
ERR_FLOOR = 2e-3
VOCAB, SEQLEN = 97, 64


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    with world_of_one():
        yield


class _CpuBuffer:
    def get_tensor(self, shape, dtype, name, **kwargs):
        return torch.empty(shape, dtype=dtype)


@pytest.fixture(autouse=True)
def megatron_on_cpu(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _CpuBuffer())
    monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())


def gpt(config, spec, seed):
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128,
                    position_embedding_type="learned_absolute")


def tiny_models(seed, **overrides):
    """(fp32 Megatron, bf16 Megatron, bf16 dash_fa3) copies of one randomly initialised GPT."""
    ref, eager, ours = three_gpts(gpt, seed, **overrides)
    return ref, eager.to(torch.bfloat16), ours.to(torch.bfloat16)


def causal_mask(seqlen=SEQLEN):
    """Megatron's causal mask (True = masked out), as its dataloader builds it."""
    return torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)[None, None]


def ids(seed, batch=2, seqlen=SEQLEN):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), generator=g)


def positions(x):
    return torch.arange(x.shape[1]).expand_as(x)


class Recorder:
    """Wraps the adapter's flash_attn_func, recording each call's tensors and keywords."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = dm.flash_attn_func

        def wrapped(q, k, v, **kw):
            self.calls.append((q, k, v, kw))
            return real(q, k, v, **kw)

        monkeypatch.setattr(dm, "flash_attn_func", wrapped)


@pytest.fixture
def recorder(monkeypatch):
    return Recorder(monkeypatch)


def core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def test_spec_builds_dash_fa3_core_attention():
    _, _, ours = tiny_models(1)
    for module in core_attentions(ours):
        assert type(module) is dm.DashFA3DotProductAttention
        assert module.attn_mask_type is AttnMaskType.causal and module.softmax_scale == 64 ** -0.5


@pytest.mark.parametrize("groups", [2, 1, 4])  # GQA, MQA, MHA
def test_logits_and_gradients_match_megatron(groups, recorder):
    seed = 10 + groups
    ref, eager, ours = tiny_models(seed, num_query_groups=groups)
    x = ids(seed)
    results = {}
    for name, model in (("ref", ref), ("eager", eager), ("ours", ours)):
        logits = model(x, positions(x), attention_mask=causal_mask())
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        results[name] = (logits.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()})
    assert len(recorder.calls) == 2  # one per layer, all through dash_fa3
    q, k, v, kw = recorder.calls[0]
    assert q.shape == (2, SEQLEN, 4, 64) and k.shape == v.shape == (2, SEQLEN, groups, 64)
    assert kw["causal"] is True and kw["softmax_scale"] == 64 ** -0.5 and kw["deterministic"] is False

    assert_model_close_to_reference(results, ("self_attention", "embedding"), "Megatron bf16", ERR_FACTOR, ERR_FLOOR,
                                    min_checked=5)


def test_layout_without_copies_and_mask_none_is_causal(recorder):
    _, _, ours = tiny_models(20)
    handed = []
    for module in core_attentions(ours):
        module.register_forward_pre_hook(lambda mod, args: handed.append(args[:3]))
    x = ids(20, seqlen=17)
    with torch.no_grad():
        with_mask = ours(x, positions(x), attention_mask=causal_mask(17))
        without = ours(x, positions(x), attention_mask=None)
    torch.testing.assert_close(with_mask, without, atol=0, rtol=0)
    assert len(handed) == len(recorder.calls) == 4
    for theirs, (q, k, v, _) in zip(handed, recorder.calls):
        for t, ours_t in zip(theirs, (q, k, v)):
            # The same memory, (seq, batch, heads, dim) -> (batch, seq, heads, dim): a view, no copy.
            assert ours_t.data_ptr() == t.data_ptr() and torch.equal(ours_t, t.transpose(0, 1))


@pytest.mark.parametrize("mask_type", [AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.causal])
def test_module_against_dot_product_attention(mask_type):
    config = transformer_config(bf16=True, num_attention_heads=6, num_query_groups=2, hidden_size=384)
    theirs = DotProductAttention(config, 1, mask_type, "self")
    ours = dm.DashFA3DotProductAttention(config, 1, mask_type, "self")
    g = torch.Generator().manual_seed(31)
    s, b = 23, 2
    q = torch.randn(s, b, 6, 64, generator=g, dtype=torch.bfloat16)
    k = torch.randn(s, b, 2, 64, generator=g, dtype=torch.bfloat16)
    v = torch.randn(s, b, 2, 64, generator=g, dtype=torch.bfloat16)
    # Megatron's module needs a mask tensor on the CPU (its default causal one is built on CUDA).
    mask = causal_mask(s) if mask_type is AttnMaskType.causal else torch.zeros(1, 1, s, s, dtype=torch.bool)
    want = theirs(q, k, v, mask).float()
    for given in (mask, None):
        out = ours(q, k, v, given)
        assert out.shape == (s, b, 6 * 64) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
        assert (out.float() - want).abs().mean() < 5e-3  # a wrong mask or head mapping would be far off
    # The per-call mask type wins over the module's.
    no_mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
    want_full = DotProductAttention(config, 1, AttnMaskType.no_mask, "self")(q, k, v, no_mask).float()
    full = ours(q, k, v, None, attn_mask_type=AttnMaskType.no_mask).float()
    assert (full - want_full).abs().mean() < 5e-3


def test_deterministic_mode_and_schedule(recorder, monkeypatch):
    x = ids(40, seqlen=9)
    config = transformer_config(bf16=True, deterministic_mode=True)
    model = gpt(config, dm.get_gpt_layer_dash_fa3_spec(normalization="RMSNorm", schedule="spt"), 40).bfloat16()
    with torch.no_grad():
        model(x, positions(x), attention_mask=None)
    assert [(kw["deterministic"], kw["schedule"]) for *_, kw in recorder.calls] == [(True, "spt")] * 2

    recorder.calls.clear()
    model = gpt(transformer_config(bf16=True), dm.get_gpt_layer_dash_fa3_spec(normalization="RMSNorm"), 40).bfloat16()
    was = torch.are_deterministic_algorithms_enabled()
    try:
        with torch.no_grad():
            torch.use_deterministic_algorithms(True)
            model(x, positions(x), attention_mask=None)
            torch.use_deterministic_algorithms(False)
            model(x, positions(x), attention_mask=None)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [kw["deterministic"] for *_, kw in recorder.calls] == [True, True, False, False]

    recorder.calls.clear()
    spec = dm.get_gpt_layer_dash_fa3_spec(normalization="RMSNorm", deterministic=True, schedule="symmetric_shift")
    model = gpt(transformer_config(bf16=True), spec, 40).bfloat16()
    with torch.no_grad():
        model(x, positions(x), attention_mask=None)
    assert [(kw["deterministic"], kw["schedule"]) for *_, kw in recorder.calls] == [(True, "symmetric_shift")] * 2


def test_options_are_checked():
    with pytest.raises(TypeError, match="deterministic"):
        dm.get_gpt_layer_dash_fa3_spec(deterministic="yes")
    with pytest.raises(ValueError, match="unknown schedule"):
        dm.get_gpt_layer_dash_fa3_spec(schedule="fastest")
    with pytest.raises(dm.UnsupportedAttention, match="multi-latent"):
        dm.get_gpt_layer_dash_fa3_spec(multi_latent_attention=True)


def _module(**overrides):
    return dm.DashFA3DotProductAttention(transformer_config(bf16=True, **overrides), 1, AttnMaskType.causal, "self")


def _qkv(s=8):
    q = torch.randn(s, 2, 4, 64, dtype=torch.bfloat16)
    return q, q[:, :, :2].contiguous(), q[:, :, :2].contiguous()


def test_other_masks_are_refused():
    module = _module()
    q, k, v = _qkv()
    padded = causal_mask(8).expand(2, 1, 8, 8).clone()
    padded[1, :, :, :3] = True  # row 1 left-padded
    for mask, match in ((padded, "not the causal mask"), (causal_mask(8).float(), "dtype"),
                        (causal_mask(8)[0], "shape")):
        with pytest.raises(dm.UnsupportedAttention, match=match):
            module(q, k, v, mask)
    with pytest.raises(dm.UnsupportedAttention, match="padded"):
        module(q, k, v, padded, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(dm.UnsupportedAttention, match="arbitrary"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.arbitrary)
    module(q, k, v, torch.zeros(1, 1, 8, 8, dtype=torch.bool))  # an all-False mask masks nothing: runs


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.no_mask])
def test_packed_thd_sequences_per_document(mask_type):
    # THD: (tokens, heads, dim) packed documents, each attending within itself, against per-document
    # Megatron DotProductAttention.
    config = transformer_config(bf16=True, num_attention_heads=6, num_query_groups=2, hidden_size=384)
    ours = dm.DashFA3DotProductAttention(config, 1, mask_type, "self")
    causal = mask_type is not AttnMaskType.no_mask
    theirs = DotProductAttention(config, 1, AttnMaskType.causal if causal else AttnMaskType.no_mask, "self")
    g = torch.Generator().manual_seed(33)
    bounds = [0, 9, 10, 31, 45]
    t = bounds[-1]
    q = torch.randn(t, 6, 64, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(t, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=21, max_seqlen_kv=21)
    out = ours(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 6 * 64) and out.dtype == torch.bfloat16
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = hi - lo
        mask = causal_mask(s) if causal else torch.zeros(1, 1, s, s, dtype=torch.bool)
        want = theirs(q[lo:hi, None], k[lo:hi, None], v[lo:hi, None], mask).float()[:, 0]
        torch.testing.assert_close(out[lo:hi].float(), want, atol=3e-2, rtol=3e-2)


def test_packed_bias_and_extra_arguments_are_refused():
    module = _module()
    q, k, v = _qkv()
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    thd = q[:, 0], k[:, 0], v[:, 0]
    for params, match in (
            (PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu), "qkv_format='sbhd'"),
            (PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=torch.tensor([0, 6, 8], dtype=torch.int32)), "padded packed"),
            (PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, local_cp_size=2),
             "context parallelism")):
        with pytest.raises(dm.UnsupportedAttention, match=match):
            module(*thd, None, packed_seq_params=params)
    with pytest.raises(dm.UnsupportedAttention, match="expected \\(tokens, heads, dim\\)"):
        module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                                cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5))
    with pytest.raises(dm.UnsupportedAttention, match="attention_bias"):
        module(q, k, v, None, attention_bias=torch.zeros(1, 4, 8, 8))
    with pytest.raises(dm.UnsupportedAttention, match="extra core-attention arguments x"):
        module(q, k, v, None, x=q)


def test_dropout_is_refused_in_training():
    module = _module(attention_dropout=0.1)
    q, k, v = _qkv()
    module.eval()
    module(q, k, v, None)  # eval: no dropout, runs
    module.train()
    with pytest.raises(dm.UnsupportedAttention, match="dropout"):
        module(q, k, v, None)
    explicit = dm.DashFA3DotProductAttention(transformer_config(bf16=True), 1, AttnMaskType.causal, "self",
                                             attention_dropout=0.2)
    with pytest.raises(dm.UnsupportedAttention, match="p=0.2"):
        explicit(q, k, v, None)


def test_config_refusals():
    with pytest.raises(dm.UnsupportedAttention, match="sliding-window"):
        _module(window_size=(16, 0))
    with pytest.raises(dm.UnsupportedAttention, match="softmax_type"):
        _module(softmax_type="off-by-one")
    config = transformer_config(bf16=True)
    config.context_parallel_size = 2  # set after validation: a world of one rank cannot hold CP 2
    with pytest.raises(dm.UnsupportedAttention, match="context parallelism"):
        dm.DashFA3DotProductAttention(config, 1, AttnMaskType.causal, "self")


def test_fp32_is_refused_with_the_fix():
    module = _module()
    q = torch.randn(8, 2, 4, 64)
    with pytest.raises(dm.UnsupportedAttention, match="bf16=True"):
        module(q, q, q, None)


def test_importing_dash_fa3_does_not_import_megatron():
    code = "import sys, dash_fa3, dash_fa3.integrations; dash_fa3.flash_attn_func; print('megatron' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=dash_fa3.__path__[0] + "/..")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
