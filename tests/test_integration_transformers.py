"""The Hugging Face transformers adapter on tiny random models (CPU: the reference path).

Skips without transformers 5.x (``pip install 'transformers>=5,<6'``)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason="transformers 5.x is not installed (pip install 'transformers>=5,<6')")

from attn_utils import assert_model_close_to_reference  # noqa: E402
import dash_fa3  # noqa: E402
from dash_fa3.integrations import transformers as dt  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function  # noqa: E402

# Our error may be at most this multiple of transformers' own bf16 eager model's
# error (both against the fp32 eager model), plus a small floor.
ERR_FACTOR = 2.0
ERR_FLOOR = 2e-3


def tiny_config(**overrides):
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, attn_implementation="eager")
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_models(seed, **overrides):
    """(fp32 eager, bf16 eager, bf16 dash_fa3) copies of one randomly initialised model."""
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(tiny_config(**overrides))
    eager = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(ref).to(torch.bfloat16)
    ours.set_attn_implementation("dash_fa3")
    return ref, eager, ours


def ids(seed, batch=2, seqlen=40, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seqlen), generator=g)


def _compare_with_eager(make_model, seed, seqlen=40, **forward_kw):
    """fp32 eager, bf16 eager and bf16 dash_fa3 copies of one random model: our logits and
    attention/embedding gradients within ERR_FACTOR of bf16 eager's error against fp32.
    ``forward_kw`` go to every model call (e.g. position_ids)."""
    torch.manual_seed(seed)
    ref = make_model()
    eager = copy.deepcopy(ref).to(torch.bfloat16)
    ours = copy.deepcopy(ref).to(torch.bfloat16)
    ours.set_attn_implementation("dash_fa3")
    x = ids(seed, seqlen=seqlen)
    results = {}
    for name, model in (("ref", ref), ("eager", eager), ("ours", ours)):
        out = model(x, labels=x, **forward_kw)
        out.loss.backward()
        results[name] = (out.logits.detach().double(),
                         {n: p.grad.detach().double() for n, p in model.named_parameters()})

    assert_model_close_to_reference(results, ("self_attn", "embed"), "eager bf16", ERR_FACTOR, ERR_FLOOR)
    return ours


class Recorder:
    """Wraps the adapter's flash_attn_func, recording each call's tensors and keywords."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = dt.flash_attn_func

        def wrapped(q, k, v, **kw):
            self.calls.append((q, k, v, kw))
            return real(q, k, v, **kw)

        monkeypatch.setattr(dt, "flash_attn_func", wrapped)


@pytest.fixture
def recorder(monkeypatch):
    return Recorder(monkeypatch)


@pytest.fixture(autouse=True)
def restore_defaults():
    saved = dt.get_defaults()
    yield
    dt.set_defaults(**saved)


def test_registered_under_dash_fa3():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[dt.NAME] is dt.attention_forward
    assert AttentionMaskInterface._global_mapping[dt.NAME] is dt.mask_for_dash_fa3
    model = LlamaForCausalLM(tiny_config(attn_implementation="dash_fa3"))
    assert model.config._attn_implementation == "dash_fa3"


@pytest.mark.parametrize("heads_kv", [2, 1, 4])  # GQA, MQA, MHA
def test_logits_and_gradients_match_eager(heads_kv, recorder):
    _compare_with_eager(lambda: LlamaForCausalLM(tiny_config(num_key_value_heads=heads_kv)), 10 + heads_kv)
    assert len(recorder.calls) == 2  # one per layer, all through dash_fa3
    q, k, _, kw = recorder.calls[0]
    assert q.shape == (2, 40, 4, 64) and k.shape == (2, 40, heads_kv, 64) and kw["causal"] is True


@pytest.mark.parametrize("use_cache", [False, True])
def test_layout_is_mapped_without_copies(recorder, monkeypatch, use_cache):
    from transformers import AttentionInterface

    handed = []

    def spy(module, query, key, value, *args, **kwargs):
        handed.append((query, key, value))
        return dt.attention_forward(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, dt.NAME, spy)
    _, _, ours = tiny_models(21)
    with torch.no_grad():
        ours(ids(21, seqlen=17), use_cache=use_cache)
    assert len(handed) == len(recorder.calls) == 2
    for theirs, (q, k, v, _) in zip(handed, recorder.calls):
        for t, ours_t in zip(theirs, (q, k, v)):
            # The same memory, (batch, heads, seq, dim) -> (batch, seq, heads, dim): a view, no copy.
            assert ours_t.data_ptr() == t.data_ptr() and torch.equal(ours_t, t.transpose(1, 2))


def test_attention_function_against_sdpa():
    # The function alone, on (batch, heads, seq, dim) inputs as transformers passes them.
    g = torch.Generator().manual_seed(31)
    b, h, hkv, s, d = 2, 6, 2, 23, 64
    query = torch.randn(b, s, h, d, generator=g).transpose(1, 2)
    key = torch.randn(b, s, hkv, d, generator=g).transpose(1, 2)
    value = torch.randn(b, s, hkv, d, generator=g).transpose(1, 2)

    class Module(torch.nn.Module):
        pass

    for is_causal in (True, False):
        module = Module()
        module.is_causal = is_causal
        out, weights = dt.attention_forward(module, query.bfloat16(), key.bfloat16(), value.bfloat16(), None,
                                            scaling=0.3)
        assert weights is None and out.shape == (b, s, h, d) and out.dtype == torch.bfloat16
        want = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(h // hkv, 1), value.repeat_interleave(h // hkv, 1),
            is_causal=is_causal, scale=0.3).transpose(1, 2)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
        # A wrong mask or head mapping would be far off; bf16 inputs keep it within about 1e-2.
        assert (out.float() - want).abs().mean() < 5e-3


def test_cached_decoding_matches_a_full_forward():
    # Bottom-right causal alignment: a query step against (past + new) keys.
    _, _, ours = tiny_models(41)
    x = ids(41, seqlen=25)
    with torch.no_grad():
        full = ours(x).logits
        prefix = ours(x[:, :20], use_cache=True)
        cache = prefix.past_key_values
        steps = [prefix.logits]
        for t in range(20, 25):
            out = ours(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1).float(), full.float(), atol=2e-2, rtol=2e-2)


def test_deterministic_and_schedule_from_the_call(recorder):
    _, _, ours = tiny_models(51)
    with torch.no_grad():
        ours(ids(51, seqlen=9), deterministic=True, schedule="symmetric_shift")
    assert [(kw["deterministic"], kw["schedule"]) for *_, kw in recorder.calls] == [(True, "symmetric_shift")] * 2


def test_deterministic_and_schedule_defaults(recorder):
    _, _, ours = tiny_models(52)
    x = ids(52, seqlen=9)
    dt.set_defaults(deterministic=True, schedule="spt")
    with torch.no_grad():
        ours(x)
        ours(x, deterministic=False)  # the call wins over the default
    got = [(kw["deterministic"], kw["schedule"]) for *_, kw in recorder.calls]
    assert got == [(True, "spt")] * 2 + [(False, "spt")] * 2


def test_deterministic_follows_torch_when_unset(recorder):
    _, _, ours = tiny_models(53)
    x = ids(53, seqlen=9)
    dt.set_defaults(deterministic=None)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        with torch.no_grad():
            torch.use_deterministic_algorithms(True)
            ours(x)
            torch.use_deterministic_algorithms(False)
            ours(x)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [kw["deterministic"] for *_, kw in recorder.calls] == [True, True, False, False]


def test_set_defaults_checks_its_arguments():
    with pytest.raises(TypeError, match="deterministic"):
        dt.set_defaults(deterministic="yes")
    with pytest.raises(ValueError, match="unknown schedule"):
        dt.set_defaults(schedule="fastest")


def test_padding_mask_is_refused():
    _, _, ours = tiny_models(61)
    x = ids(61, seqlen=12)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    with pytest.raises(dt.UnsupportedAttention, match="padded batch"):
        ours(x, attention_mask=mask)
    # An all-ones mask is no padding: it runs.
    with torch.no_grad():
        assert torch.isfinite(ours(x, attention_mask=torch.ones_like(x)).logits).all()


def test_packed_sequences_match_eager_per_document():
    # Without a cache (use_cache=False) transformers' mask builder finds the packing (position_ids
    # restart inside a row) and the documents run through flash_attn_varlen_func; eager's packed
    # mask is the reference.
    x = ids(62, batch=2, seqlen=24)
    positions = torch.stack([torch.arange(24), torch.cat([torch.arange(7), torch.arange(12), torch.arange(5)])])
    _compare_with_eager(lambda: LlamaForCausalLM(tiny_config()), 62, seqlen=24, position_ids=positions,
                        use_cache=False)
    # A document sees only itself: its logits do not change with what precedes it in the row.
    _, _, ours = tiny_models(62)
    with torch.no_grad():
        alone = ours(x[1:, 7:19], position_ids=torch.arange(12)[None], use_cache=False).logits
        packed = ours(x, position_ids=positions, use_cache=False).logits[1:, 7:19]
    torch.testing.assert_close(packed.float(), alone.float(), atol=2e-2, rtol=2e-2)


def test_packed_offsets_from_the_caller():
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands cu_seq_lens_q/k and max_length_q/k.
    q = torch.randn(1, 4, 20, 64, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 20, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    out, _ = dt.attention_forward(torch.nn.Module(), q, kv, kv, None, scaling=0.125, cu_seq_lens_q=cu,
                                  cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
    assert out.shape == (1, 20, 4, 64)
    for lo, hi in ((0, 8), (8, 20)):
        want, _ = dt.attention_forward(torch.nn.Module(), q[:, :, lo:hi], kv[:, :, lo:hi], kv[:, :, lo:hi], None,
                                       scaling=0.125)
        torch.testing.assert_close(out[:, lo:hi].float(), want.float(), atol=1e-2, rtol=1e-2)
    with pytest.raises(dt.UnsupportedAttention, match="max_length_q"):
        dt.attention_forward(torch.nn.Module(), q, kv, kv, None, cu_seq_lens_q=cu)


def test_packed_sequences_with_a_cache_are_refused():
    # With a KV cache transformers does not look for packing; the attention function does.
    _, _, ours = tiny_models(62)
    x = ids(62, batch=2, seqlen=16)
    positions = torch.stack([torch.arange(16), torch.cat([torch.arange(6), torch.arange(10)])])  # row 1: 2 documents
    with pytest.raises(dt.UnsupportedAttention, match="packed sequences"):
        ours(x, position_ids=positions, use_cache=True)
    with torch.no_grad():  # positions that do not restart: one document per row, runs
        ours(x, position_ids=torch.arange(3, 19).expand(2, 16), use_cache=True)


def test_custom_4d_mask_is_refused():
    _, _, ours = tiny_models(63)
    x = ids(63, seqlen=8)
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(dt.UnsupportedAttention, match="explicit attention mask"):
        ours(x, attention_mask=mask)


def test_dropout_is_refused_in_training():
    _, _, ours = tiny_models(64, attention_dropout=0.1)
    x = ids(64, seqlen=8)
    ours.eval()
    with torch.no_grad():
        ours(x)  # eval mode: no dropout, runs
    ours.train()
    with pytest.raises(dt.UnsupportedAttention, match="dropout"):
        ours(x)


def test_sliding_window_matches_eager(recorder):
    from transformers import MistralConfig, MistralForCausalLM

    def make():
        return MistralForCausalLM(MistralConfig(
            vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, sliding_window=8, attn_implementation="eager"))

    _compare_with_eager(make, 70, seqlen=40)  # the window (8) is far shorter than the sequence
    assert len(recorder.calls) == 2
    for q, k, _, kw in recorder.calls:
        assert kw["causal"] is True and kw["window_size"] == (7, 0)  # keys q - 8 < kv <= q
    # Packed documents keep the window inside each document (the varlen path).
    positions = torch.stack([torch.cat([torch.arange(25), torch.arange(15)]),
                             torch.cat([torch.arange(3), torch.arange(37)])])
    _compare_with_eager(make, 71, seqlen=40, position_ids=positions, use_cache=False)


def test_gemma3_local_and_global_layers_match_eager(recorder):
    # Gemma 3: head dim 256, sliding-window layers next to full-attention ones.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def make():
        return Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=256, sliding_window=8, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"], attn_implementation="eager"))

    _compare_with_eager(make, 71, seqlen=24)
    windows = [kw["window_size"] for _, _, _, kw in recorder.calls]
    assert windows == [(7, 0), (-1, -1)] and all(kw["causal"] for _, _, _, kw in recorder.calls)


def test_deepseek_v3_mla_matches_eager(recorder):
    # DeepSeek-V3's MLA: queries and keys of head dim 192 (128 + 64 rotary), values of 128,
    # which transformers hands to the attention function unpadded (it pads only for FA2).
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    def make():
        return DeepseekV3ForCausalLM(DeepseekV3Config(
            vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=2, max_position_embeddings=256,
            attn_implementation="eager"))

    _compare_with_eager(make, 74, seqlen=24)
    assert [(q.shape[-1], k.shape[-1], v.shape[-1]) for q, k, v, _ in recorder.calls] == [(192, 192, 128)] * 2


def test_gemma2_softcap_and_sliding_window_match_eager(recorder):
    # Gemma 2: attention logits capped (attn_logit_softcapping), local and global layers. A tiny
    # random model's scores are small: a cap of 0.05 makes it bite (dropping it fails the logits).
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def make():
        return Gemma2ForCausalLM(Gemma2Config(
            vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, sliding_window=8, max_position_embeddings=256,
            attn_logit_softcapping=0.05, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
            attn_implementation="eager"))

    _compare_with_eager(make, 72, seqlen=24)
    assert [kw["softcap"] for _, _, _, kw in recorder.calls] == [0.05, 0.05]
    assert [kw["window_size"] for _, _, _, kw in recorder.calls] == [(7, 0), (-1, -1)]
    # Packed documents (the varlen path) keep the cap and the window inside each document.
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                             torch.cat([torch.arange(3), torch.arange(21)])])
    _compare_with_eager(make, 73, seqlen=24, position_ids=positions, use_cache=False)


def test_sliding_window_cached_decoding_matches_a_full_forward():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(72)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=6, attn_implementation="dash_fa3")).to(torch.bfloat16)
    x = ids(72, batch=1, seqlen=20)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :12], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(12, 20):
            out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    stepped = torch.cat(steps, dim=1)
    assert (stepped.float() - full.float()).abs().max().item() < 0.05


def test_sliding_window_mask_is_recognised_and_other_overlays_are_refused():
    from transformers.masking_utils import and_masks, sliding_window_bidirectional_mask_function

    assert dt.mask_for_dash_fa3(1, 8, 8, mask_function=sliding_window_causal_mask_function(4)) is None
    assert dt.mask_for_dash_fa3(1, 8, 8, mask_function=sliding_window_causal_mask_function(4), local_size=4) is None
    with pytest.raises(dt.UnsupportedAttention, match="local_size=5"):
        dt.mask_for_dash_fa3(1, 8, 8, mask_function=sliding_window_causal_mask_function(4), local_size=5)
    extra = and_masks(sliding_window_causal_mask_function(4), lambda b, h, q, kv: q >= 0)
    for fn in (extra, sliding_window_bidirectional_mask_function(4), and_masks(causal_mask_function)):
        with pytest.raises(dt.UnsupportedAttention, match="mask pattern"):
            dt.mask_for_dash_fa3(1, 8, 8, mask_function=fn)
    with pytest.raises(dt.UnsupportedAttention, match="static"):  # keys past the last query, as for causal
        dt.mask_for_dash_fa3(1, 5, 16, mask_function=sliding_window_causal_mask_function(4))
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(dt.UnsupportedAttention, match="bidirectional sliding window"):
        dt.attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=4, is_causal=False)
    for bad in (0, True, 2.5):
        with pytest.raises(TypeError, match="sliding_window"):
            dt.attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=bad)


def test_numpy_integer_sliding_window_is_the_int(recorder):
    """A window that a config holds as a NumPy integer (issue 53): the mask hook recognises it
    and the attention runs the window of the Python int, with the same output."""
    import numpy as np

    for w in (np.int64(4), np.int32(4)):
        assert dt.mask_for_dash_fa3(1, 8, 8, mask_function=sliding_window_causal_mask_function(w)) is None
        assert dt.mask_for_dash_fa3(1, 8, 8, mask_function=sliding_window_causal_mask_function(w),
                                    local_size=np.int64(4)) is None
        with pytest.raises(dt.UnsupportedAttention, match="local_size=5"):
            dt.mask_for_dash_fa3(1, 8, 8, mask_function=sliding_window_causal_mask_function(w), local_size=5)
    g = torch.Generator().manual_seed(53)
    q, k, v = (torch.randn(1, 4, 16, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    want, _ = dt.attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=4)
    for w in (np.int64(4), np.int32(4), np.uint8(4)):
        got, _ = dt.attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=w)
        assert torch.equal(got, want)
    windows = [kw["window_size"] for _, _, _, kw in recorder.calls]
    assert windows == [(3, 0)] * 4 and all(type(x) is int for x in windows[-1])
    for bad in (np.int64(0), np.True_):
        with pytest.raises(TypeError, match="sliding_window"):
            dt.attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=bad)


def test_static_cache_layout_is_refused():
    # Keys past the last query (a pre-allocated cache) cannot be bottom-right aligned.
    assert dt.mask_for_dash_fa3(1, 5, 12, q_offset=7, mask_function=causal_mask_function) is None
    with pytest.raises(dt.UnsupportedAttention, match="static"):
        dt.mask_for_dash_fa3(1, 5, 16, q_offset=0, mask_function=causal_mask_function)
    # transformers 5.0 passes the query positions as cache_position instead.
    assert dt.mask_for_dash_fa3(1, kv_length=12, cache_position=torch.arange(7, 12)) is None
    with pytest.raises(dt.UnsupportedAttention, match="static"):
        dt.mask_for_dash_fa3(1, kv_length=16, cache_position=torch.arange(5))


def test_fp32_model_is_refused_with_the_fix():
    torch.manual_seed(66)
    model = LlamaForCausalLM(tiny_config(attn_implementation="dash_fa3"))
    with pytest.raises(dt.UnsupportedAttention, match="dtype=torch.bfloat16"):
        model(ids(66, seqlen=8))


def test_other_refusals():
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    for kw, match in (({"s_aux": torch.zeros(4)}, "s_aux"),
                      ({"cu_seqlens_q": torch.tensor([0, 8])}, "cu_seq_lens_q/k")):
        with pytest.raises(dt.UnsupportedAttention, match=match):
            dt.attention_forward(torch.nn.Module(), q, q, q, None, **kw)
    with pytest.raises(TypeError, match="is_causal"):
        dt.attention_forward(torch.nn.Module(), q, q, q, None, is_causal="yes")


def test_importing_dash_fa3_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, dash_fa3, dash_fa3.integrations; dash_fa3.flash_attn_func; print('transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=dash_fa3.__path__[0] + "/..")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
