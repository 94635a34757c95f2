"""The TorchTitan adapter on tiny Llama 3 models (CPU: the reference path).

Skips without torchtitan 0.3 (``pip install torchtitan==0.3.0``), and where its
Llama 3 package does not import: torchtitan 0.3.0 needs a newer torch than 2.11
(``torch.distributed.fsdp.DataParallelMeshDims``)."""

import copy
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan==0.3.0)")
try:
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock
except ImportError as exc:  # torchtitan 0.3.0 on torch 2.11: its FSDP import needs a newer torch
    pytest.skip(f"torchtitan's Llama 3 does not import with torch {torch.__version__}: {exc}",
                allow_module_level=True)

from attn_utils import assert_model_close_to_reference  # noqa: E402
import dash_fa3  # noqa: E402
from dash_fa3.integrations import torchtitan as dtt  # noqa: E402
from torchtitan.models.common import (  # noqa: E402
    ComplexRoPE, Embedding, FlexAttention, Linear, RMSNorm, ScaledDotProductAttention, VarlenAttention,
    VarlenMetadata)
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config  # noqa: E402

# Our error may be at most this multiple of the bf16 SDPA model's error (both
# against the fp32 SDPA model), plus a small floor.
ERR_FACTOR = 2.0
ERR_FLOOR = 2e-3
VOCAB, SEQLEN = 97, 64


def _normal(std):
    return {"weight": lambda w: torch.nn.init.normal_(w, std=std), "bias": torch.nn.init.zeros_}


def tiny_config(inner, *, n_heads=4, n_kv_heads=2, head_dim=64, dim=128, layers=2, fuse_qkv=False):
    """A 2-layer Llama 3 config from torchtitan's own builders (head_dim 64: a dash_fa3 head dim)."""
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=256, theta=10000.0)
    blocks = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim),
            ffn_norm=RMSNorm.Config(normalized_shape=dim),
            attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                      wqkv_param_init=_normal(0.08), wo_param_init=_normal(0.08),
                                      inner_attention=copy.deepcopy(inner), rope=rope, fuse_qkv=fuse_qkv),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=256, w1_param_init=_normal(0.05),
                                         w2w3_param_init=_normal(0.05)),
        )
        for _ in range(layers)
    ]
    return Llama3Model.Config(
        dim=dim, vocab_size=VOCAB, layers=blocks,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_normal(1.0)),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_normal(0.05)),
    )


def build(config, seed):
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def to_bf16(model):
    """Parameters in bf16, buffers (the complex RoPE cache) kept: what FSDP's
    MixedPrecisionPolicy(param_dtype=bf16) computes with."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def tokens(seed, batch=2, seqlen=SEQLEN):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), generator=g)


def step(model, x, positions=None):
    """One training step's forward and backward as torchtitan's trainer runs it (masks from positions)."""
    if positions is None:
        positions = torch.arange(x.shape[1]).expand_as(x)
    masks = model.get_attention_masks(positions) if isinstance(
        model.config.layers[0].attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config)) else None
    logits = model(x, positions, masks)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    return logits.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


class Recorder:
    """Wraps the adapter's flash_attn_func, recording each call's tensors and keywords."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = dtt.flash_attn_func

        def wrapped(q, k, v, **kw):
            self.calls.append((q, k, v, kw))
            return real(q, k, v, **kw)

        monkeypatch.setattr(dtt, "flash_attn_func", wrapped)


@pytest.fixture
def recorder(monkeypatch):
    return Recorder(monkeypatch)


def inner_attentions(model):
    return [block.attention.inner_attention for block in model.layers.values()]


@pytest.mark.parametrize("backend", [FlexAttention, VarlenAttention, ScaledDotProductAttention])
def test_apply_swaps_modules_and_config(backend):
    model = build(tiny_config(backend.Config()), 1)
    assert dtt.apply(model, deterministic=True, schedule="spt") is model
    for module in inner_attentions(model):
        assert type(module) is dtt.DashFA3Attention
        assert (module.window_size, module.deterministic, module.schedule) == ((-1, 0), True, "spt")
    for layer in model.config.layers:
        assert type(layer.attention.inner_attention) is dtt.DashFA3Attention.Config
    # The trainer's mask builder now hands over varlen metadata, which the module checks.
    assert isinstance(model.get_attention_masks(torch.arange(8).expand(2, 8)), VarlenMetadata)


@pytest.mark.parametrize("heads_kv,fuse_qkv", [(2, False), (1, True), (4, False)])  # GQA, MQA (fused QKV), MHA
def test_logits_and_gradients_match_sdpa(heads_kv, fuse_qkv, recorder):
    seed = 10 + heads_kv
    ref_config = tiny_config(ScaledDotProductAttention.Config(), n_kv_heads=heads_kv, fuse_qkv=fuse_qkv)
    ref = build(ref_config, seed)
    eager = to_bf16(copy.deepcopy(ref))
    ours = to_bf16(copy.deepcopy(ref))
    dtt.apply(ours)
    x = tokens(seed)
    results = {name: step(model, x) for name, model in (("ref", ref), ("eager", eager), ("ours", ours))}
    assert len(recorder.calls) == 2  # one per layer, all through dash_fa3
    q, k, v, kw = recorder.calls[0]
    assert q.shape == (2, SEQLEN, 4, 64) and k.shape == v.shape == (2, SEQLEN, heads_kv, 64)
    assert q.dtype == torch.bfloat16 and kw["causal"] is True and kw["softmax_scale"] == 64 ** -0.5

    assert_model_close_to_reference(results, ("attention", "embed"), "SDPA bf16", ERR_FACTOR, ERR_FLOOR, min_checked=5)


def test_inputs_are_passed_without_copies(recorder):
    model = to_bf16(build(dtt.use_dash_fa3(tiny_config(FlexAttention.Config())), 20))
    handed = []
    for module in inner_attentions(model):
        module.register_forward_pre_hook(lambda mod, args: handed.append(args), with_kwargs=False)
    with torch.no_grad():
        step_x = tokens(20, seqlen=17)
        model(step_x, None, None)
    assert len(handed) == len(recorder.calls) == 2
    for theirs, (q, k, v, _) in zip(handed, recorder.calls):
        for t, ours in zip(theirs, (q, k, v)):
            assert ours is t  # torchtitan's (batch, seq, heads, dim) is dash_fa3's layout


def test_module_against_sdpa_causal_and_full():
    g = torch.Generator().manual_seed(31)
    b, h, hkv, s, d = 2, 6, 2, 23, 64
    q = torch.randn(b, s, h, d, generator=g)
    k = torch.randn(b, s, hkv, d, generator=g)
    v = torch.randn(b, s, hkv, d, generator=g)
    sdpa = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    causal_module = dtt.DashFA3Attention.Config().build()
    full_module = dtt.DashFA3Attention.Config(window_size=(-1, -1)).build()
    for module, is_causal, want_causal in ((causal_module, None, True), (full_module, None, False),
                                           (causal_module, False, False), (full_module, True, True)):
        out = module(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.3, enable_gqa=True, is_causal=is_causal)
        want = sdpa(q, k, v, scale=0.3, enable_gqa=True, is_causal=want_causal)
        assert out.shape == (b, s, h, d) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
        # A wrong mask or head mapping would be far off; bf16 inputs keep it within about 1e-2.
        assert (out.float() - want).abs().mean() < 5e-3


def test_deterministic_and_schedule_from_the_config(recorder):
    model = to_bf16(build(dtt.use_dash_fa3(tiny_config(VarlenAttention.Config()), deterministic=True,
                                           schedule="symmetric_shift"), 40))
    with torch.no_grad():
        model(tokens(40, seqlen=9))
    assert [(kw["deterministic"], kw["schedule"]) for *_, kw in recorder.calls] == [(True, "symmetric_shift")] * 2


def test_deterministic_follows_torch_when_unset(recorder):
    model = to_bf16(dtt.apply(build(tiny_config(FlexAttention.Config()), 41), deterministic=None))
    x = tokens(41, seqlen=9)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        with torch.no_grad():
            torch.use_deterministic_algorithms(True)
            model(x)
            torch.use_deterministic_algorithms(False)
            model(x)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [kw["deterministic"] for *_, kw in recorder.calls] == [True, True, False, False]
    model_false = to_bf16(dtt.apply(build(tiny_config(FlexAttention.Config()), 41), deterministic=False))
    recorder.calls.clear()
    try:
        torch.use_deterministic_algorithms(True)
        with torch.no_grad():
            model_false(x)  # an explicit False wins over torch's flag
    finally:
        torch.use_deterministic_algorithms(was)
    assert [kw["deterministic"] for *_, kw in recorder.calls] == [False, False]


def test_options_are_checked():
    with pytest.raises(TypeError, match="deterministic"):
        dtt.use_dash_fa3(tiny_config(FlexAttention.Config()), deterministic="yes")
    with pytest.raises(ValueError, match="unknown schedule"):
        dtt.apply(build(tiny_config(FlexAttention.Config()), 42), schedule="fastest")
    with pytest.raises(ValueError, match="no torchtitan inner attention"):
        dtt.apply(torch.nn.Linear(2, 2))


def test_packed_documents_run_the_varlen_path_per_document():
    # Module level: each document attends within itself, as per-document SDPA does.
    g = torch.Generator().manual_seed(32)
    b, s, h, hkv, d = 2, 40, 4, 2, 64
    q = torch.randn(b, s, h, d, generator=g).bfloat16()
    k, v = (torch.randn(b, s, hkv, d, generator=g).bfloat16() for _ in range(2))
    bounds = [0, 13, 40, 41, 80]  # row 0: documents of 13 and 27 tokens; row 1: 1 and 39
    cu = torch.tensor(bounds, dtype=torch.int32)
    meta = VarlenMetadata(cu, cu, 39, 39, tuple(bounds))
    sdpa = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    for module, causal in ((dtt.DashFA3Attention.Config().build(), True),
                           (dtt.DashFA3Attention.Config(window_size=(-1, -1)).build(), False)):
        out = module(q, k, v, attention_masks=meta, scale=0.2, enable_gqa=True)
        assert out.shape == (b, s, h, d)
        flat = [t.reshape(b * s, *t.shape[2:]).float() for t in (q, k, v)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            want = sdpa(*(t[None, lo:hi] for t in flat), scale=0.2, enable_gqa=True, is_causal=causal)[0]
            torch.testing.assert_close(out.reshape(b * s, h, d)[lo:hi].float(), want, atol=3e-2, rtol=3e-2)
    # Gradients flow (the CPU reference's varlen backward; the GPU runs the kernels).
    qg = q.clone().requires_grad_()
    dtt.DashFA3Attention.Config().build()(qg, k, v, attention_masks=meta, enable_gqa=True).sum().backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


def test_packed_documents_run_in_a_model():
    # Model level: positions that restart inside a row give packed metadata, which now runs.
    model = to_bf16(dtt.apply(build(tiny_config(FlexAttention.Config()), 50)))
    x = tokens(50)
    packed = torch.stack([torch.arange(SEQLEN), torch.cat([torch.arange(30), torch.arange(SEQLEN - 30)])])
    with torch.no_grad():
        out_packed = model(x, packed, model.get_attention_masks(packed))
        positions = torch.arange(SEQLEN).expand(2, SEQLEN)  # one document per row: the dense kernels
        out_rows = model(x, positions, model.get_attention_masks(positions))
    assert torch.isfinite(out_packed).all() and torch.isfinite(out_rows).all()
    # Row 0 is one document either way; row 1's second document sees only itself when packed.
    torch.testing.assert_close(out_packed[0].float(), out_rows[0].float(), atol=2e-2, rtol=2e-2)
    assert not torch.allclose(out_packed[1, 30:].float(), out_rows[1, 30:].float(), atol=1e-2)


def test_packed_documents_refuse_wave_schedules():
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    meta = VarlenMetadata(cu, cu, 27, 27)
    q = torch.randn(1, 40, 2, 64).bfloat16()
    module = dtt.DashFA3Attention.Config(deterministic=True, schedule="shift").build()
    with pytest.raises(ValueError, match="does not run on packed documents"):
        module(q.requires_grad_(), q, q, attention_masks=meta)


def test_sliding_windows_are_refused():
    with pytest.raises(dtt.UnsupportedAttention, match="sliding window"):
        dtt.use_dash_fa3(tiny_config(VarlenAttention.Config(window_size=(128, 0))))
    with pytest.raises(dtt.UnsupportedAttention, match="sliding window"):
        dtt.apply(build(tiny_config(VarlenAttention.Config(window_size=(16, 0))), 51))
    with pytest.raises(dtt.UnsupportedAttention, match="sliding window"):
        dtt.DashFA3Attention.Config(window_size=(8, 0))

    class WindowedLlama(Llama3Model):  # a model with its own masks, as gpt-oss has
        def get_attention_masks(self, positions):
            raise AssertionError("not reached")

    torch.manual_seed(52)
    model = WindowedLlama(tiny_config(FlexAttention.Config()))
    with pytest.raises(dtt.UnsupportedAttention, match="overrides get_attention_masks"):
        dtt.apply(model)
    assert all(type(m) is FlexAttention for m in inner_attentions(model))  # nothing half-replaced


def test_other_masks_and_arguments_are_refused():
    module = dtt.DashFA3Attention.Config().build()
    q = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16)
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, None, 8, 8, device="cpu")
    for kw, match in (({"attention_masks": block_mask}, "BlockMask"),
                      ({"attention_masks": {"full": None}}, "per-layer masks"),
                      ({"score_mod": lambda s, b, h, qi, ki: s}, "score_mod"),
                      ({"out_transform": lambda o, lse: o}, "out_transform"),
                      ({"sinks": torch.zeros(4)}, "sinks")):
        with pytest.raises(dtt.UnsupportedAttention, match=match):
            module(q, q, q, **kw)
    with pytest.raises(TypeError, match="is_causal"):
        module(q, q, q, is_causal="yes")


def test_fp32_is_refused_with_the_fix():
    model = dtt.apply(build(tiny_config(FlexAttention.Config()), 53))  # parameters left in fp32
    with pytest.raises(dtt.UnsupportedAttention, match="mixed_precision_param"):
        model(tokens(53, seqlen=8))


def test_context_parallel_is_refused():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    import torch.distributed as dist
    from torchtitan.distributed.context_parallel import apply_cp_to_forward

    modules = [dtt.DashFA3Attention.Config().build()]
    with pytest.raises(NotImplementedError, match="DashFA3Attention"):  # torchtitan's own refusal
        apply_cp_to_forward(modules, None)

    model = build(tiny_config(FlexAttention.Config()), 54)
    first = inner_attentions(model)[0]
    first.forward = lambda *a, **k: None  # what apply_cp_to_forward does to the modules it wraps
    with pytest.raises(dtt.UnsupportedAttention, match="already wrapped"):
        dtt.apply(model)

    if not dist.is_available():
        return
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        q = DTensor.from_local(torch.randn(1, 8, 4, 64, dtype=torch.bfloat16), mesh, [Replicate()])
        with pytest.raises(dtt.UnsupportedAttention, match="DTensor"):
            modules[0](q, q, q)
    finally:
        if owned:
            dist.destroy_process_group()


def test_importing_dash_fa3_does_not_import_torchtitan():
    code = ("import sys, dash_fa3, dash_fa3.integrations; dash_fa3.flash_attn_func; "
            "print('torchtitan' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=dash_fa3.__path__[0] + "/..")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
