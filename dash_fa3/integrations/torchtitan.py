"""TorchTitan (0.3.x): dash_fa3 as the inner attention of torchtitan's decoder models.

In torchtitan 0.3 a Llama 3 block's ``GQAttention`` calls an *inner attention*
module (``FlexAttention``, ``VarlenAttention`` or ``ScaledDotProductAttention``,
chosen by the model registry's ``attn_backend``) with (batch, seq, heads, dim)
tensors. This module swaps that inner attention for ``DashFA3Attention``,
either in the model config before the trainer builds the model, or in a built
model (before ``parallelize``, ``torch.compile`` or activation checkpointing)::

    from dash_fa3.integrations import torchtitan as dash_tt
    dash_tt.use_dash_fa3(model_spec.model, deterministic=True)   # a Decoder config, e.g. model_registry("8B").model
    # or, on a built model:
    dash_tt.apply(model, deterministic=None, schedule="auto")

What it does with torchtitan's call:

- layout: torchtitan hands (batch, seq, heads, dim) tensors, dash_fa3's own
  layout: they go to ``flash_attn_func`` as they are (a copy only if the last
  dim is not contiguous), and the output is (batch, seq, heads, dim).
- GQA/MQA: key/value heads go in unrepeated (heads % heads_kv == 0).
- ``scale`` becomes ``softmax_scale``.
- causal: the caller's ``is_causal`` keyword if it passes one (Flux does),
  else the config's ``window_size``: ``(-1, 0)`` causal (the default),
  ``(-1, -1)`` full.
- masks: torchtitan's trainer builds attention masks from the dataloader's
  per-document ``positions`` for Flex and Varlen configs only.
  ``DashFA3Attention.Config`` is a ``VarlenAttention.Config``, so the trainer
  hands it ``VarlenMetadata``. One document per row runs ``flash_attn_func``;
  documents packed in rows (positions that restart inside a row) run
  ``flash_attn_varlen_func`` on the (batch * seq, heads, dim) views, each
  document attending within itself, as torchtitan's own Varlen attention. A
  Flex model's causal + document mask becomes the same; ``apply`` /
  ``use_dash_fa3`` switch the config, so the model's ``get_attention_masks``
  returns ``VarlenMetadata`` from then on. Packed documents take the varlen
  schedules (``auto``, ``fa3``, ``spt``, ``descending``, ``lpt``); the
  backward reads the document lengths from the metadata's host copy when
  torchtitan attaches one, else once per step from the device.
- ``deterministic`` / ``schedule``: from the config (``use_dash_fa3`` /
  ``apply`` arguments); ``deterministic=None`` (the default) follows
  ``torch.are_deterministic_algorithms_enabled()`` at each call, which
  torchtitan's ``debug.deterministic`` switches on.

Context parallelism: TorchTitan's own CP route does not reach this module
(``apply_cp_to_forward`` wraps only Flex and SDPA inner attentions, and the
Llama 3 config refuses CP with a Varlen-type inner attention, which
``DashFA3Attention.Config`` is). ``apply_cp(model, cp_mesh)`` takes its place:
it hands every ``DashFA3Attention`` the CP mesh dimension (a ``DeviceMesh``,
``(mesh, dim)`` or a ``ProcessGroup``), and each call then runs
``dash_fa3.distributed.context_parallel_attn`` on the local tokens with the
``zigzag`` layout, which is the token order of TorchTitan's default CP load
balancer (``headtail``: rank r holds chunks r and 2·CP−1−r of 2·CP). Shard the
inputs, labels and positions with ``prepare_context_parallel_input(...,
load_balancer_type="headtail")`` (or ``dash_fa3.distributed.shard(x, group,
layout="zigzag")``, the same tokens); the global length must be a multiple of
2·CP·128. ``deterministic`` is passed through (``None`` follows
``torch.are_deterministic_algorithms_enabled()``, i.e. ``debug.deterministic``);
the deterministic algorithm (superblocks) gives the same bits at every CP size, any n_kv_heads. Under CP the masks must be
None or one document per row of the whole sequence; packed documents are
refused.

Refused with ``UnsupportedAttention`` (a ``ValueError``), never run another way:
a FlexAttention ``BlockMask``
or a per-layer dict of masks, sliding windows (``window_size`` other than
``(-1, 0)``/``(-1, -1)``, or a model that overrides ``get_attention_masks``,
as gpt-oss and Qwen 3.5 do for their windows), ``score_mod``,
``out_transform`` (attention sinks), unknown keyword arguments, DTensor inputs
(torchtitan's SDPA context-parallel wrapping; use ``apply_cp``), packed
documents with context parallelism, and fp32 inputs (dash_fa3
computes in bf16/fp16: train with torchtitan's bf16 mixed precision, its
default).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

import torchtitan
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
    VarlenMetadata,
)
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.module import Module

from ..distributed import context_parallel_attn
from ..interface import flash_attn_func, flash_attn_varlen_func
from ..ops import remember_host_offsets
from . import UnsupportedAttention, check_options, resolve_deterministic

__all__ = ["DashFA3Attention", "UnsupportedAttention", "apply", "apply_cp", "use_dash_fa3"]

_version = tuple(int(p) for p in torchtitan.__version__.split(".")[:2] if p.isdigit())
if _version < (0, 3):
    raise ImportError(
        f"dash_fa3.integrations.torchtitan needs torchtitan 0.3.x, found {torchtitan.__version__}: "
        f"pip install torchtitan==0.3.0"
    )

CAUSAL = (-1, 0)
FULL = (-1, -1)
# TorchTitan's default CP load balancer ("headtail") gives rank r chunks r and 2*CP-1-r of 2*CP:
# dash_fa3's zigzag layout.
CP_LAYOUT = "zigzag"
_REPLACED = (FlexAttention, VarlenAttention, ScaledDotProductAttention)
_REPLACED_CONFIGS = tuple(cls.Config for cls in _REPLACED)


def _refuse(what: str) -> UnsupportedAttention:
    return UnsupportedAttention(
        f"dash_fa3's torchtitan attention cannot compute {what}. It runs full or causal attention over one "
        f"document per row or documents packed in rows (one document per row under context parallelism), and "
        f"does not fall back to another attention; "
        f"use attn_backend='flex' or 'varlen' for this model or input"
    )


def _check_window(window_size) -> tuple[int, int]:
    window = tuple(window_size)
    if window not in (CAUSAL, FULL):
        raise _refuse(f"window_size={window} (a sliding window); only {CAUSAL} (causal) and {FULL} (full)")
    return window


_checked_metadata: list = [None, -1, False]  # weak reference to the last cu_seq_q checked, its version, the verdict


def _one_document_per_row(masks: VarlenMetadata, batch: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether VarlenMetadata is [0, L, 2L, ..., B*L]: every row one document (then the dense
    kernels run; else the packed ones).

    All layers of a forward get the same metadata, so the value check (a device sync on
    the GPU without the host copy torchtitan may attach, as its own metadata builder does)
    runs once per new cu_seq_q."""
    cu_q, cu_k = masks.cu_seq_q, masks.cu_seq_k
    if cu_q.numel() != batch + 1 or cu_k.numel() != batch + 1 or masks.max_q != seqlen_q or masks.max_k != seqlen_k:
        return False
    ref, version, verdict = _checked_metadata
    if ref is not None and ref() is cu_q and version == cu_q._version and (cu_k is cu_q or torch.equal(cu_k, cu_q)):
        return verdict
    host = masks.cu_seq_q_host
    if host is not None and cu_k is cu_q:
        unpacked = tuple(host) == tuple(range(0, (batch + 1) * seqlen_q, seqlen_q))
    else:
        want_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, device=cu_q.device, dtype=cu_q.dtype)
        want_k = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, device=cu_k.device, dtype=cu_k.dtype)
        unpacked = bool(torch.equal(cu_q, want_q)) and bool(torch.equal(cu_k, want_k))
    _checked_metadata[:] = [weakref.ref(cu_q), cu_q._version, unpacked]
    return unpacked


class DashFA3Attention(Module):
    """torchtitan inner attention running ``dash_fa3.flash_attn_func``.

    Called like torchtitan's inner attentions: ``(q, k, v, *, attention_masks=None,
    scale=None, enable_gqa=False, is_causal=None)`` on (batch, seq, heads, dim) tensors,
    returning (batch, seq, heads, dim).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        # window_size (inherited): (-1, 0) causal, (-1, -1) full; nothing else.
        deterministic: bool | None = None
        """True/False, or None: follow torch.are_deterministic_algorithms_enabled() at each call."""
        schedule: str = "auto"
        """The deterministic backward's schedule (dash_fa3.schedule.SCHEDULE_NAMES)."""

        def __post_init__(self):
            _check_window(self.window_size)
            check_options(self.deterministic, self.schedule)

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.window_size = _check_window(config.window_size)
        check_options(config.deterministic, config.schedule)
        self.deterministic = config.deterministic
        self.schedule = config.schedule
        self.cp_group = None  # set by apply_cp: the context-parallel ProcessGroup

    def extra_repr(self) -> str:
        cp = "" if self.cp_group is None else f", context_parallel={dist.get_world_size(self.cp_group)} ranks (zigzag)"
        return (f"window_size={self.window_size}, deterministic={self.deterministic}, "
                f"schedule={self.schedule!r}{cp}")

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *, attention_masks=None,
                scale: float | None = None, enable_gqa: bool = False, is_causal: bool | None = None,
                score_mod=None, out_transform=None, **kwargs) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if any(isinstance(t, DTensor) for t in (q_BLNH, k_BLNH, v_BLNH)):
            raise _refuse("DTensor inputs (torchtitan's SDPA context-parallel wrapping, or an unwrapped tensor-parallel "
                          "layout; for context parallelism use dash_fa3.integrations.torchtitan.apply_cp)")
        if score_mod is not None:
            raise _refuse(f"a FlexAttention score_mod ({score_mod!r})")
        if out_transform is not None:
            raise _refuse("an out_transform epilogue (attention sinks or another use of the softmax LSE)")
        unknown = sorted(name for name, value in kwargs.items() if value is not None)
        if unknown:
            raise _refuse(f"the keyword arguments {', '.join(unknown)}")
        batch, seqlen_q = q_BLNH.shape[:2]
        seqlen_k = k_BLNH.shape[1]
        cp_ranks = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        packed = None
        if isinstance(attention_masks, VarlenMetadata):
            # Under CP the metadata describes the whole sequence (the trainer builds it before sharding).
            if not _one_document_per_row(attention_masks, batch, seqlen_q * cp_ranks, seqlen_k * cp_ranks):
                if self.cp_group is not None:
                    raise _refuse("documents packed in rows with context parallelism")
                packed = attention_masks
        elif isinstance(attention_masks, Mapping):
            raise _refuse(f"a dict of per-layer masks (keys {sorted(attention_masks)}): a hybrid or "
                          f"sliding-window model")
        elif attention_masks is not None:
            raise _refuse(
                f"an attention mask of type {type(attention_masks).__name__} (a FlexAttention BlockMask: build the "
                f"model through dash_fa3.integrations.torchtitan.use_dash_fa3 or apply, whose config makes the "
                f"trainer hand over VarlenMetadata)"
            )
        if q_BLNH.dtype not in (torch.bfloat16, torch.float16):
            raise UnsupportedAttention(
                f"dash_fa3's torchtitan attention computes in bf16/fp16, but q is {q_BLNH.dtype}: train with "
                f"bf16 mixed precision (training.mixed_precision_param='bfloat16', torchtitan's default)"
            )
        if is_causal is None:
            causal = self.window_size == CAUSAL
        elif isinstance(is_causal, bool):
            causal = is_causal
        else:
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        deterministic = resolve_deterministic(self.deterministic)
        if self.cp_group is not None:
            return context_parallel_attn(q_BLNH, k_BLNH, v_BLNH, self.cp_group, causal=causal, softmax_scale=scale,
                                         deterministic=deterministic, layout=CP_LAYOUT)
        if packed is not None:
            # Documents packed in rows: the (batch * seq, heads, dim) views go to the varlen
            # kernels, each document attending within itself.
            if packed.cu_seq_q_host is not None and packed.cu_seq_k is packed.cu_seq_q:
                remember_host_offsets(packed.cu_seq_q, packed.cu_seq_q_host)  # no sync for the backward's schedule
            q, k, v = (t.reshape(batch * t.shape[1], *t.shape[2:]) for t in (q_BLNH, k_BLNH, v_BLNH))
            out = flash_attn_varlen_func(q, k, v, packed.cu_seq_q, packed.cu_seq_k, packed.max_q, packed.max_k,
                                         softmax_scale=scale, causal=causal, deterministic=deterministic,
                                         schedule=self.schedule)
            return out.view(batch, seqlen_q, *out.shape[1:])
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BLNH, k_BLNH, v_BLNH))
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, deterministic=deterministic,
                               schedule=self.schedule)


def _config_for(old, deterministic, schedule) -> DashFA3Attention.Config:
    """The DashFA3Attention config that replaces the inner-attention config (or module) ``old``."""
    if isinstance(old, (VarlenAttention.Config, VarlenAttention)):
        window = _check_window(old.window_size)
    else:  # Flex (causal + document mask in a Decoder, checked by the caller) or SDPA (is_causal per call)
        window = CAUSAL
    sharding = getattr(old, "sharding_config", None) if isinstance(old, Module.Config) else old._sharding_config
    return DashFA3Attention.Config(window_size=window, deterministic=deterministic, schedule=schedule,
                                   sharding_config=sharding)


def _check_mask_builder(owner: type | None, has_flex: bool) -> None:
    """A Flex inner attention is replaceable only where torchtitan's Decoder builds its (causal +
    document) masks; models that override get_attention_masks add windows or other masks."""
    if owner is None or not issubclass(owner, Decoder):
        if has_flex:
            raise _refuse("a FlexAttention outside a torchtitan Decoder (its BlockMask is model-specific)")
        return
    if owner.get_attention_masks is not Decoder.get_attention_masks:
        raise _refuse(
            f"the masks of {owner.__name__}, which overrides get_attention_masks (sliding windows, chunked or "
            f"other model-specific masks)"
        )


def use_dash_fa3(model_config, *, deterministic: bool | None = None, schedule: str = "auto"):
    """Rewrites a torchtitan model config in place so that every inner attention is
    ``DashFA3Attention``; returns the config. Call it before the model is built
    (e.g. on ``model_registry(flavor).model``, or the trainer config's model spec)."""
    check_options(deterministic, schedule)
    if not hasattr(model_config, "traverse"):
        raise TypeError(f"use_dash_fa3 needs a torchtitan model config, got {type(model_config).__name__}")
    found = [(parent, attr, cfg) for _, cfg, parent, attr in model_config.traverse(_REPLACED_CONFIGS)
             if parent is not None and not isinstance(cfg, DashFA3Attention.Config)]
    if not found and not any(True for _ in model_config.traverse(DashFA3Attention.Config)):
        raise ValueError(f"found no inner attention config (FlexAttention, VarlenAttention or "
                         f"ScaledDotProductAttention) in {type(model_config).__name__}")
    _check_mask_builder(getattr(model_config, "_owner", None),
                        any(isinstance(cfg, FlexAttention.Config) for *_, cfg in found))
    new_configs = [_config_for(cfg, deterministic, schedule) for *_, cfg in found]  # all checks before any change
    for (parent, attr, _), new in zip(found, new_configs):
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


def apply(model: torch.nn.Module, *, deterministic: bool | None = None, schedule: str = "auto") -> torch.nn.Module:
    """Replaces every torchtitan inner attention module of a built ``model`` with
    ``DashFA3Attention`` and rewrites ``model.config`` the same way (so the trainer and
    ``model.get_attention_masks`` build VarlenMetadata); returns the model.

    Call it before ``parallelize``, ``torch.compile``, activation checkpointing or
    context parallel wrap the model."""
    check_options(deterministic, schedule)
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, _REPLACED)]
    if not found:
        raise ValueError(f"found no torchtitan inner attention module (FlexAttention, VarlenAttention or "
                         f"ScaledDotProductAttention) in {type(model).__name__}")
    _check_mask_builder(type(model), any(isinstance(m, FlexAttention) for _, m in found))
    for name, module in found:
        if "forward" in vars(module):
            raise _refuse(f"{name}, whose forward was already wrapped (context parallel): apply dash_fa3 first")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "traverse"):
        use_dash_fa3(config, deterministic=deterministic, schedule=schedule)
    replacements = [(name, _config_for(module, deterministic, schedule).build()) for name, module in found]
    for name, new in replacements:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return model


def _process_group(cp_mesh) -> dist.ProcessGroup:
    """The ProcessGroup of a CP mesh dimension: a 1-D DeviceMesh, (DeviceMesh, dim) or a ProcessGroup."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    if isinstance(cp_mesh, DeviceMesh) and cp_mesh.ndim == 1:
        return cp_mesh.get_group()
    if isinstance(cp_mesh, tuple) and len(cp_mesh) == 2 and isinstance(cp_mesh[0], DeviceMesh):
        return cp_mesh[0].get_group(cp_mesh[1])
    raise TypeError(f"apply_cp needs the CP mesh dimension: a 1-D DeviceMesh, (DeviceMesh, dim) or a "
                    f"ProcessGroup, got {type(cp_mesh).__name__}")


def apply_cp(model: torch.nn.Module, cp_mesh) -> torch.nn.Module:
    """Runs every ``DashFA3Attention`` of ``model`` with context parallelism over ``cp_mesh``
    (a 1-D ``DeviceMesh``, ``(mesh, dim)``, e.g. ``(parallel_dims.world_mesh, "cp")``, or a
    ``ProcessGroup``); returns the model. It takes the place of torchtitan's
    ``apply_cp_to_forward``. The inputs must come sharded in the headtail / zigzag order
    (``prepare_context_parallel_input(..., load_balancer_type="headtail")``)."""
    found = [m for m in model.modules() if isinstance(m, DashFA3Attention)]
    others = [name for name, m in model.named_modules() if isinstance(m, _REPLACED)]
    if others:
        raise _refuse(f"context parallelism for {others[0]} ({len(others)} torchtitan inner attentions): call "
                      f"apply(model) before apply_cp")
    if not found:
        raise ValueError(f"found no DashFA3Attention in {type(model).__name__}: call apply(model) first")
    group = _process_group(cp_mesh)
    for module in found:
        module.cp_group = group
    return model
