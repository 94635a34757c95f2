"""What the Megatron-Core adapter's tests share (import after importorskip("megatron.core"))."""

import contextlib
import os
import socket

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from dash_fa3.integrations import megatron as dm


@contextlib.contextmanager
def world_of_one():
    """A world of one rank (gloo) with Megatron's tensor/pipeline parallel state of size 1,
    as for one GPU; the environment and the process group are restored afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def transformer_config(**overrides) -> TransformerConfig:
    """A small GPT's config: 2 layers, GQA 4/2 heads of dim 64, no dropout, RMSNorm, CPU initialisation."""
    kw = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=64,
              ffn_hidden_size=256, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
              normalization="RMSNorm", add_bias_linear=False, init_method_std=0.05)
    kw.update(overrides)
    return TransformerConfig(**kw)


def three_gpts(make_gpt, seed, **overrides):
    """(fp32 Megatron, bf16 Megatron, bf16 dash_fa3) copies of one randomly initialised GPT;
    make_gpt(config, layer_spec, seed) builds one (weights in fp32 until the caller casts)."""
    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    ref = make_gpt(transformer_config(**overrides), local, seed)
    eager = make_gpt(transformer_config(bf16=True, **overrides), local, seed)
    ours = make_gpt(transformer_config(bf16=True, **overrides), dm.get_gpt_layer_dash_fa3_spec(normalization="RMSNorm"),
                    seed)
    eager.load_state_dict(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    return ref, eager, ours
