"""Megatron-Core (0.19.x): dash_fa3 as the ``core_attention`` of Megatron's attention layers.

``DashFA3DotProductAttention`` takes the constructor and ``forward`` of
``megatron.core.transformer.dot_product_attention.DotProductAttention`` (the
local, non-Transformer-Engine core attention), so it goes wherever a layer
spec names a core attention::

    from dash_fa3.integrations.megatron import get_gpt_layer_dash_fa3_spec
    spec = get_gpt_layer_dash_fa3_spec(normalization="RMSNorm")   # get_gpt_layer_local_spec's arguments
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=..., max_sequence_length=...)

What it does with Megatron's call:

- layout: Megatron hands (seq, batch, heads, dim) tensors; a ``transpose(0, 1)``
  turns them into dash_fa3's (batch, seq, heads, dim) without a copy (a copy
  happens only if the last dim is not contiguous). The output is
  (seq, batch, heads * dim), as from ``DotProductAttention`` (one copy, as there).
- GQA: key/value come with ``num_query_groups`` heads and go in unrepeated.
- heads per tensor-parallel rank come from the tensors' shapes.
- ``softmax_scale``: the constructor's, else ``config.softmax_scale``, else
  1/sqrt(``kv_channels``); ``apply_query_key_layer_scaling`` does not change
  it (in ``DotProductAttention`` it divides the scores by the layer number and
  multiplies them back in the softmax).
- masks (Megatron's ``attention_mask`` is a bool tensor, True = masked out):
  ``AttnMaskType.causal`` (or ``padding_causal``) runs causal attention when
  the mask is None, all False, or exactly the causal mask that Megatron's
  dataloader builds (checked once per mask tensor: a device sync on the GPU);
  ``no_mask`` / ``padding`` run full attention when the mask is None or all False.
- packed sequences (``packed_seq_params`` with ``qkv_format="thd"``): Megatron's
  (tokens, heads, dim) tensors go to ``flash_attn_varlen_func`` with its
  ``cu_seqlens_q/kv`` and ``max_seqlen_q/kv``; the output is (tokens, heads *
  dim), as Megatron's THD path expects.
- ``deterministic``: True when ``config.deterministic_mode`` is set, else the
  constructor's ``deterministic``, else ``torch.are_deterministic_algorithms_enabled()``
  at each call; ``schedule`` is the constructor's (``"auto"``). Set them
  through ``get_gpt_layer_dash_fa3_spec(deterministic=..., schedule=...)``.

Context parallelism (``context_parallel_size > 1``): each call runs
``dash_fa3.distributed.context_parallel_attn`` on Megatron's context-parallel
group (``pg_collection.cp``, else ``parallel_state.get_context_parallel_group()``)
with the ``zigzag`` layout, which is the token order of Megatron's own load
balancing (``get_batch_on_this_cp_rank``: rank r holds chunks r and 2·CP−1−r of
2·CP); GQA heads unrepeated, causal or full as above, ``deterministic`` as above
(the deterministic default, ``algorithm="superblocks"``, takes any
``num_query_groups``). The global sequence length must be a multiple of 2·CP·128. The mask
must be None, all False, or the CP-sharded causal mask (rows of this rank's
tokens, columns of the whole sequence). ``schedule`` applies to single-GPU
calls only.

``cp_comm_type`` (Megatron's ``config.cp_comm_type``, one layer's value) names how
Transformer Engine's context parallelism moves data across the CP group. dash_fa3's
context parallelism chooses its own exchange (that of its algorithm: superblocks,
whole heads per rank or DistFlashAttn's run plan) and computes the same attention over the same group, so ``None``,
``"p2p"``, ``"all_gather"`` and ``"a2a"`` all run it; the bits do not depend on which.
``"a2a+p2p"`` is refused at construction: it names Megatron's hierarchical CP
groups (``hierarchical_context_parallel_sizes``: all-to-all inside the inner groups,
a ring across them), a split of the CP group that ``context_parallel_attn`` has no
way to take; running over the flat group instead would silently drop that
configuration. Any other value is a ``ValueError`` naming the accepted ones.

Refused with ``UnsupportedAttention`` (a ``ValueError``), never run another way:
packed sequences (``qkv_format="thd"``) with context parallelism,
padded or context-parallel ``packed_seq_params``, ``attention_bias``,
attention dropout > 0 while training (``config.attention_dropout = 0.0``;
Megatron's default is 0.1), any other mask (padding, documents, an
``arbitrary`` mask type), sliding windows (``config.window_size``), softmax
offsets / sinks (``config.softmax_type`` other than "vanilla"), ``qk_clip``,
``cp_comm_type="a2a+p2p"``, extra core-attention
keywords, and fp32 inputs (dash_fa3 computes in bf16/fp16: ``bf16=True``).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

import megatron.core
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from ..distributed import context_parallel_attn
from ..interface import flash_attn_func, flash_attn_varlen_func
from ..ops import host_offsets
from . import UnsupportedAttention, check_options, resolve_deterministic

__all__ = ["DashFA3DotProductAttention", "UnsupportedAttention", "get_gpt_layer_dash_fa3_spec"]

_version = tuple(int(p) for p in megatron.core.__version__.split(".")[:2] if p.isdigit())
if _version < (0, 19):
    raise ImportError(
        f"dash_fa3.integrations.megatron needs megatron-core 0.19.x, found {megatron.core.__version__}: "
        f"pip install megatron-core==0.19.2 (Python >= 3.12)"
    )

# Megatron's CP load balancing (get_batch_on_this_cp_rank) gives rank r chunks r and 2*CP-1-r of
# 2*CP: dash_fa3's zigzag layout.
CP_LAYOUT = "zigzag"
# The cp_comm_type values whose exchange dash_fa3's context parallelism stands in for (the
# module docstring says why "a2a+p2p" is not one of them).
CP_COMM_TYPES = (None, "p2p", "all_gather", "a2a")
_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
_FULL_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


def _refuse(what: str) -> UnsupportedAttention:
    return UnsupportedAttention(
        f"DashFA3DotProductAttention cannot compute {what}. It runs full or causal attention over unpadded, "
        f"unpacked or THD-packed sequences (unpacked only with context parallelism), and does not fall back to another "
        f"attention; use the local or Transformer Engine spec for this model or input"
    )


_checked_masks: dict = {}  # id(mask) -> (weak reference, version, verdict): "causal", "none" or None


def _check_cp_comm_type(cp_comm_type, layer_number: int) -> None:
    accepted = ", ".join(repr(t) for t in CP_COMM_TYPES)
    if cp_comm_type is not None and not isinstance(cp_comm_type, str):
        raise TypeError(f"cp_comm_type must be one layer's communication type ({accepted}), got {cp_comm_type!r} "
                        f"in layer {layer_number}")
    if cp_comm_type == "a2a+p2p":
        raise UnsupportedAttention(
            f"DashFA3DotProductAttention cannot run cp_comm_type='a2a+p2p' (layer {layer_number}): dash_fa3's "
            f"context parallelism runs its own exchange over the whole CP group, not over Megatron's hierarchical "
            f"CP groups (hierarchical_context_parallel_sizes). Use cp_comm_type {accepted} (all run dash_fa3's "
            f"exchange), or the Transformer Engine spec for hierarchical context parallelism"
        )
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"unknown cp_comm_type {cp_comm_type!r} in layer {layer_number}; DashFA3DotProductAttention "
                         f"accepts {accepted} ('a2a+p2p' is refused)")


def _zigzag_rows(seqlen_k: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The global positions of a CP rank's tokens in Megatron's load-balanced order."""
    chunk = seqlen_k // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def _mask_kind(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, cp=(0, 1)):
    """"none" for an all-False mask, "causal" for Megatron's causal mask, else None. Under
    context parallelism (``cp`` = (rank, size)) the causal mask has this rank's query rows.

    Every layer of a forward gets the same mask tensor, so each is checked once."""
    entry = _checked_masks.get(id(mask))
    if entry is not None and entry[0]() is mask and entry[1] == mask._version:
        return entry[2]
    if mask.dtype != torch.bool:
        raise _refuse(f"an attention_mask of dtype {mask.dtype} (Megatron's masks are bool, True = masked out)")
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (seqlen_q, seqlen_k):
        raise _refuse(f"an attention_mask of shape {tuple(mask.shape)} for {seqlen_q} queries and {seqlen_k} "
                      f"keys (expected (batch or 1, heads or 1, {seqlen_q}, {seqlen_k}))")
    if not bool(mask.any()):
        kind = "none"
    elif cp[1] > 1:
        rows = _zigzag_rows(seqlen_k, *cp).to(mask.device)
        causal = torch.arange(seqlen_k, device=mask.device)[None, :] > rows[:, None]
        kind = "causal" if rows.numel() == seqlen_q and bool((mask == causal).all()) else None
    else:
        causal = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device).triu(1 + seqlen_k - seqlen_q)
        kind = "causal" if bool((mask == causal).all()) else None
    for key in [k for k, (ref, *_) in _checked_masks.items() if ref() is None]:
        del _checked_masks[key]
    _checked_masks[id(mask)] = (weakref.ref(mask), mask._version, kind)
    return kind


class DashFA3DotProductAttention(MegatronModule):
    """Megatron core attention running ``dash_fa3.flash_attn_func``: a drop-in for
    ``DotProductAttention`` (same constructor arguments, plus ``deterministic`` and
    ``schedule``); forward takes (seq, batch, heads, dim) and returns (seq, batch, heads * dim).

    ``cp_comm_type``: None, ``"p2p"``, ``"all_gather"`` or ``"a2a"`` (each runs dash_fa3's own
    context-parallel exchange over the CP group); ``"a2a+p2p"`` (hierarchical CP groups) raises
    ``UnsupportedAttention``, anything else ``ValueError``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *, deterministic: bool | None = None,
                 schedule: str = "auto"):
        super().__init__(config=config)
        _check_cp_comm_type(cp_comm_type, layer_number)
        self.cp_group = None
        if config.context_parallel_size > 1:
            cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
            ranks = torch.distributed.get_world_size(self.cp_group)
            if ranks != config.context_parallel_size:
                raise _refuse(f"context parallelism over a group of {ranks} ranks while context_parallel_size="
                              f"{config.context_parallel_size} (initialize_model_parallel with the config's size)")
        self.layer_number = max(1, layer_number)
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            raise _refuse(f"sliding-window attention (window_size={config.window_size}) in layer "
                          f"{self.layer_number}")
        if config.softmax_type != "vanilla":
            raise _refuse(f"softmax_type={config.softmax_type!r} (a softmax offset / attention sink)")
        if getattr(config, "qk_clip", False):
            raise _refuse("qk_clip (it needs the maximum attention logit of each head)")
        if not isinstance(attn_mask_type, AttnMaskType):
            raise TypeError(f"attn_mask_type must be an AttnMaskType, got {attn_mask_type!r}")
        check_options(deterministic, schedule)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None)
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else float(softmax_scale)
        self.softmax_offset = None  # read by Megatron's attention in some paths; dash_fa3 has none
        self.deterministic = deterministic
        self.schedule = schedule

    def extra_repr(self) -> str:
        return (f"attn_mask_type={self.attn_mask_type.name}, softmax_scale={self.softmax_scale:.4g}, "
                f"deterministic={self.deterministic}, schedule={self.schedule!r}")

    def _causal(self, attention_mask, attn_mask_type: AttnMaskType, seqlen_q: int, seqlen_k: int, cp=(0, 1)) -> bool:
        if attn_mask_type in _CAUSAL_TYPES:
            if attention_mask is None or _mask_kind(attention_mask, seqlen_q, seqlen_k, cp) in ("causal", "none"):
                return True
            raise _refuse(f"an attention_mask that is not the causal mask ({attn_mask_type.name}: padding, "
                          f"document or custom masks)")
        if attn_mask_type in _FULL_TYPES:
            if attention_mask is None or _mask_kind(attention_mask, seqlen_q, seqlen_k, cp) == "none":
                return False
            raise _refuse(f"a {attn_mask_type.name} mask that masks tokens out (padded batches)")
        raise _refuse(f"attn_mask_type={attn_mask_type.name}")

    def _forward_packed(self, query, key, value, attention_mask, attn_mask_type, params, deterministic):
        return _forward_packed_thd(self, query, key, value, attention_mask, attn_mask_type, params, deterministic)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None, packed_seq_params=None,
                **kwargs) -> torch.Tensor:
        if attention_bias is not None:
            raise _refuse(f"an attention_bias (shape {tuple(attention_bias.shape)})")
        unknown = sorted(name for name, v in kwargs.items() if v is not None)
        if unknown:
            raise _refuse(f"the extra core-attention arguments {', '.join(unknown)}")
        if self.training and self.attention_dropout_p > 0:
            raise _refuse(f"attention dropout (p={self.attention_dropout_p}) while training; set "
                          f"config.attention_dropout = 0.0")
        if query.dtype not in (torch.bfloat16, torch.float16):
            raise UnsupportedAttention(
                f"DashFA3DotProductAttention computes in bf16/fp16, but query is {query.dtype}: train with "
                f"bf16=True (or fp16=True)"
            )
        deterministic = True if self.config.deterministic_mode else resolve_deterministic(self.deterministic)
        if self.cp_group is not None:
            if packed_seq_params is not None:
                raise _refuse(f"packed sequences (qkv_format={packed_seq_params.qkv_format!r}) with context "
                              f"parallelism (context_parallel_size={self.config.context_parallel_size})")
            return self._forward_cp(query, key, value, attention_mask, attn_mask_type or self.attn_mask_type,
                                    deterministic)
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, attention_mask, attn_mask_type or self.attn_mask_type,
                                        packed_seq_params, deterministic)
        seqlen_q, batch, heads, headdim = query.shape
        causal = self._causal(attention_mask, attn_mask_type or self.attn_mask_type, seqlen_q, key.shape[0])
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = flash_attn_func(q, k, v, softmax_scale=self.softmax_scale, causal=causal,
                              deterministic=deterministic, schedule=self.schedule)
        return out.transpose(0, 1).reshape(seqlen_q, batch, heads * out.shape[-1])

    def _forward_cp(self, query, key, value, attention_mask, attn_mask_type, deterministic):
        """This CP rank's tokens (Megatron's zigzag order) through context_parallel_attn."""
        cp = (torch.distributed.get_rank(self.cp_group), torch.distributed.get_world_size(self.cp_group))
        seqlen_q, batch, heads, _ = query.shape
        causal = self._causal(attention_mask, attn_mask_type, seqlen_q, seqlen_q * cp[1], cp)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = context_parallel_attn(q, k, v, self.cp_group, causal=causal, softmax_scale=self.softmax_scale,
                                    deterministic=deterministic, layout=CP_LAYOUT)
        return out.transpose(0, 1).reshape(seqlen_q, batch, heads * out.shape[-1])


def _packed_offsets(params, which: str) -> torch.Tensor:
    """cu_seqlens_{which} of a THD call; padded offsets (context parallel's, or padding between
    sequences) are refused unless they equal the unpadded ones."""
    cu = getattr(params, f"cu_seqlens_{which}")
    padded = getattr(params, f"cu_seqlens_{which}_padded")
    if cu is None:
        raise _refuse(f"packed_seq_params without cu_seqlens_{which}")
    if padded is not None and padded is not cu and host_offsets(padded) != host_offsets(cu):
        raise _refuse(f"padded packed sequences (cu_seqlens_{which}_padded differs from cu_seqlens_{which})")
    return cu


def _forward_packed_thd(module, query, key, value, attention_mask, attn_mask_type, params, deterministic):
    """Megatron's THD layout: (tokens, heads, dim) packed documents in, (tokens, heads * dim) out."""
    if params.qkv_format != "thd":
        raise _refuse(f"packed_seq_params with qkv_format={params.qkv_format!r} (only 'thd')")
    if params.cp_group is not None or (params.local_cp_size or 1) > 1:
        raise _refuse("packed sequences split by context parallelism (packed_seq_params.cp_group/local_cp_size)")
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise _refuse(f"packed (THD) tensors of shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                      f"{tuple(value.shape)} (expected (tokens, heads, dim))")
    if attention_mask is not None:
        raise _refuse("an attention_mask with packed sequences")
    if attn_mask_type in _CAUSAL_TYPES:
        causal = True
    elif attn_mask_type in _FULL_TYPES:
        causal = False
    else:
        raise _refuse(f"attn_mask_type={attn_mask_type.name} with packed sequences")
    cu_q, cu_k = _packed_offsets(params, "q"), _packed_offsets(params, "kv")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, int(params.max_seqlen_q), int(params.max_seqlen_kv),
                                 softmax_scale=module.softmax_scale, causal=causal, deterministic=deterministic,
                                 schedule=module.schedule)
    return out.reshape(out.shape[0], -1)


def get_gpt_layer_dash_fa3_spec(*args, deterministic: bool | None = None, schedule: str = "auto", **kwargs):
    """``get_gpt_layer_local_spec(*args, **kwargs)`` with ``DashFA3DotProductAttention`` as the
    self-attention's core attention. Multi-latent attention (MLA) is refused: its core
    attention gets value heads of another dim than the query's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    check_options(deterministic, schedule)
    spec = get_gpt_layer_local_spec(*args, **kwargs)
    if spec.submodules.self_attention.module is not SelfAttention:
        raise _refuse(f"the self-attention {spec.submodules.self_attention.module.__name__} (multi-latent "
                      f"attention or another variant)")
    spec.submodules.self_attention.submodules.core_attention = functools.partial(
        DashFA3DotProductAttention, deterministic=deterministic, schedule=schedule)
    return spec
