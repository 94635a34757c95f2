"""Hugging Face transformers (5.x): ``attn_implementation="dash_fa3"``.

Importing this module registers two functions under the name ``"dash_fa3"``:
the attention function (``AttentionInterface``) and its mask builder
(``AttentionMaskInterface``)::

    import dash_fa3.integrations.transformers  # noqa: F401  (registers "dash_fa3")
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dash_fa3", dtype=torch.bfloat16)

What it does with transformers' call:

- layout: transformers hands over (batch, heads, seq, dim) views of
  (batch, seq, heads, dim) projections; a ``transpose(1, 2)`` turns them back
  into dash_fa3's layout without a copy (a copy happens only if the last dim
  is not contiguous). The output is (batch, seq, heads, dim), as transformers
  expects from a non-eager attention.
- GQA/MQA: key/value heads go in unrepeated (dash_fa3 handles heads % heads_kv == 0).
- causal: the ``is_causal`` keyword if the model passes one, else the module's
  ``is_causal`` (and ``config.is_causal``, transformers' switch to
  bidirectional attention). The causal mask is bottom-right aligned, which is
  what a KV cache needs: queries are the last ``q_len`` positions of the keys.
- ``scaling`` becomes ``softmax_scale``.
- sliding windows (Mistral, Gemma 3's local layers; the model passes
  ``sliding_window=w``): ``window_size=(w - 1, 0)`` with the causal mask, the
  keys ``q - w < kv <= q`` that transformers' sliding-window mask keeps. The
  mask builder recognises transformers' own sliding-window causal mask
  function; any other overlay on it is refused.
- packed sequences (several documents in a row, position_ids restarting, as
  ``DataCollatorWithFlattening`` produces, with ``use_cache=False``):
  transformers' mask builder finds the packing and composes its packed mask,
  which the mask hook recognises; the documents then run through
  ``flash_attn_varlen_func`` on (batch * seq, heads, dim) views, each
  attending within itself (with its sliding window, if any). The document
  offsets are read on the host once per forward. Offsets handed over as
  ``cu_seq_lens_q/k`` with ``max_length_q/k`` (the collator's
  ``return_flash_attn_kwargs=True``) run the same way.
- ``deterministic`` / ``schedule``: a keyword of the model call
  (``model(ids, deterministic=True)``) wins; else the module default set with
  ``set_defaults``; else ``deterministic`` follows
  ``torch.are_deterministic_algorithms_enabled()`` and ``schedule`` is "auto".

Context parallelism: transformers and accelerate shard sequences only for
their SDPA attention (torch's ``context_parallel``, which replaces
``scaled_dot_product_attention``), not for an ``attn_implementation`` function.
Inside ``with context_parallel(group, layout="zigzag"):`` every "dash_fa3"
attention call runs ``dash_fa3.distributed.context_parallel_attn`` over
``group`` on this rank's tokens instead: shard ``input_ids``, ``position_ids``
and labels with ``dash_fa3.distributed.shard(x, group, layout=layout)``, pass
``attention_mask=torch.ones_like(input_ids)`` (an explicit mask without padding
keeps transformers from reading the zigzag positions as packed documents) and
``use_cache=False``. The position_ids must be this rank's positions of the
layout (checked once per tensor: a device sync on the GPU); packed documents,
KV caches, sliding windows and softcap are refused under it. See
``examples/context_parallel_transformers.py``.

Refused with ``UnsupportedAttention`` (a ``ValueError``), never run another way:
padding in the attention mask, packed sequences with a KV cache (transformers
looks for packing only without one; position_ids that restart inside a row are
checked (on the GPU asynchronously: the error comes from a later attention call
of the same or the next forward, not the first one), except while
torch.compile traces), bidirectional sliding windows, chunked or other custom mask patterns, a 4D mask handed
in by the caller, a static (pre-allocated) KV cache whose keys run past the
last query, dropout > 0, attention sinks, position bias, and fp32
models (dash_fa3 computes in bf16/fp16: load the model with
``dtype=torch.bfloat16``).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function
from transformers.masking_utils import and_masks, sliding_window_overlay
from transformers import masking_utils

from ..distributed import context_parallel_attn
from ..interface import flash_attn_func, flash_attn_varlen_func
from ..ops import remember_host_offsets
from ..validation import as_int
from . import UnsupportedAttention, check_options, resolve_deterministic

__all__ = ["NAME", "UnsupportedAttention", "attention_forward", "context_parallel", "mask_for_dash_fa3", "register",
           "set_defaults", "get_defaults"]

NAME = "dash_fa3"

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
        f"dash_fa3.integrations.transformers needs transformers 5.x, found {transformers.__version__}: "
        f"pip install 'transformers>=5,<6'"
    )

_UNSET = object()
_defaults = {"deterministic": None, "schedule": "auto"}


def set_defaults(*, deterministic=_UNSET, schedule=_UNSET) -> None:
    """Module-wide defaults for calls that do not pass ``deterministic`` / ``schedule``.

    ``deterministic=None`` (the initial value) follows
    ``torch.are_deterministic_algorithms_enabled()`` at each call.
    """
    check_options(None if deterministic is _UNSET else deterministic, "auto" if schedule is _UNSET else schedule)
    if deterministic is not _UNSET:
        _defaults["deterministic"] = deterministic
    if schedule is not _UNSET:
        _defaults["schedule"] = schedule


def get_defaults() -> dict:
    return dict(_defaults)


def _refuse(what: str) -> UnsupportedAttention:
    return UnsupportedAttention(
        f"attn_implementation='{NAME}' cannot compute {what}. dash_fa3 runs full or causal attention over "
        f"unpadded batches (one sequence per row, or packed documents without a KV cache) and does not fall "
        f"back to another attention; use "
        f"attn_implementation='sdpa' or 'eager' for this model or input"
    )


def _closure(fn) -> dict:
    """The free variables of a Python closure, by name ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _sliding_window_of(mask_function) -> int | None:
    """w if ``mask_function`` is transformers' sliding-window causal mask, built as
    ``and_masks(sliding_window_overlay(w), causal_mask_function)``; else None.

    Recognised by structure (the functions' qualified names and closures), so any
    other overlay, or a future transformers that builds it differently, is refused
    rather than run as a plain window."""
    if getattr(mask_function, "__qualname__", None) != and_masks(causal_mask_function).__qualname__:
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function):
        return None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", None) != sliding_window_overlay(1).__qualname__:
        return None
    w = as_int(_closure(overlay).get("sliding_window"))
    return w if w is not None and w > 0 else None


def _packed_overlay(mask_function):
    """(base mask function, packed_sequence_mask) if ``mask_function`` is transformers' packed-
    sequence composition of a base mask (documents packed in rows, found in position_ids without
    a KV cache): ``and_masks`` of ``packed_sequence_mask_function`` and the base, the base wrapped
    by ``remap_positions_for_packed_sequence`` where transformers has it. Else None."""
    if getattr(mask_function, "__qualname__", None) != and_masks(causal_mask_function).__qualname__:
        return None
    parts = _closure(mask_function).get("mask_functions")
    packed_fn = getattr(masking_utils, "packed_sequence_mask_function", None)
    if not (isinstance(parts, tuple) and len(parts) == 2) or packed_fn is None:
        return None
    packed_name = packed_fn(torch.zeros(1, 1)).__qualname__
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)
    remap_name = remap(causal_mask_function, torch.zeros(1, 1)).__qualname__ if remap is not None else None
    for i, part in enumerate(parts):
        if getattr(part, "__qualname__", None) != packed_name:
            continue
        packed = _closure(part).get("packed_sequence_mask")
        base = parts[1 - i]
        if remap_name is not None and getattr(base, "__qualname__", None) == remap_name:
            base = _closure(base).get("mask_function")
        if isinstance(packed, torch.Tensor) and packed.dim() == 2 and callable(base):
            return base, packed
    return None


# The packed_sequence_mask of the last mask the hook accepted with packing, or None: the
# attention calls of that forward run the documents through flash_attn_varlen_func. Held (a
# (batch, seq) int tensor) until the next model forward's hook call replaces it: nothing else
# keeps it alive once transformers' mask builder returns.
_packed_mask: list = [None]


def mask_for_dash_fa3(batch_size: int, q_length: int | None = None, kv_length: int | None = None, q_offset=0,
                      kv_offset=0, mask_function=causal_mask_function, attention_mask=None, cache_position=None,
                      local_size=None, **kwargs):
    """transformers' mask hook for "dash_fa3": checks the mask is one dash_fa3 expresses
    with its ``causal`` flag and window (causal, full, or causal with a sliding window)
    and returns None (no mask tensor), or raises.

    Without this hook transformers would build no mask at all for a custom
    attention name, and padding would be silently ignored. Query positions come
    as ``q_length``/``q_offset`` (recent 5.x) or as ``cache_position`` (5.0).
    """
    if q_length is None:
        if cache_position is None:
            raise TypeError("mask_for_dash_fa3 needs q_length (and q_offset) or cache_position")
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    packed = _packed_overlay(mask_function)
    _packed_mask[0] = None if packed is None else packed[1]
    if packed is not None:
        mask_function = packed[0]  # the documents' own mask, checked as any other below
    window = _sliding_window_of(mask_function)
    if window is not None and local_size is not None and local_size != window:
        raise _refuse(f"a sliding-window mask of {window} keys built with local_size={local_size}")
    if mask_function is causal_mask_function or window is not None:
        if int(q_offset) + q_length != int(kv_offset) + kv_length:  # the last query is not at the last key
            raise _refuse(
                f"a causal mask whose keys run past the last query (q positions {int(q_offset)}.."
                f"{int(q_offset) + q_length - 1}, {kv_length} key slots from {int(kv_offset)}): a static, "
                f"pre-allocated KV cache. Use the default dynamic cache"
            )
    elif mask_function is not bidirectional_mask_function:
        raise _refuse(
            "this mask pattern (a bidirectional sliding window, chunked attention, packed sequences found in "
            "position_ids, or another model-specific overlay on the causal/full/sliding-window mask)"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise _refuse(
            f"a padded batch (attention_mask of shape {tuple(attention_mask.shape)} has zeros). Pass unpadded "
            f"sequences of equal length, or no attention_mask"
        )
    return None


_checked_positions: list = [None, -1]  # weak reference to the last position_ids checked, its version
_pending_checks: list = []  # (event, pinned flag, shape) of position_ids checks still running on the GPU


def _raise_if_packed(flag: bool, shape) -> None:
    if flag:
        _pending_checks.clear()
        raise _refuse(f"packed sequences (position_ids of shape {tuple(shape)} restart inside a row) with a KV "
                      f"cache, where transformers builds no packed mask; pass use_cache=False")


def _resolve_pending_checks() -> None:
    """Raises for any finished position_ids check that found packing (never waits for the GPU)."""
    while _pending_checks and _pending_checks[0][0].query():
        _, flag, shape = _pending_checks.pop(0)
        _raise_if_packed(bool(flag.item()), shape)


def _check_unpacked(position_ids) -> None:
    """Refuses position_ids that restart inside a row (several documents packed in one row).

    transformers detects packing in its mask builder only without a KV cache, so the
    attention function checks too, once per new position_ids tensor (every layer of a
    forward gets the same one). On the GPU the check must not stall the host, so it
    runs asynchronously: its verdict is read by the first attention call after the
    GPU has computed it, which raises then, within the same or the next forward.
    Skipped while torch.compile traces."""
    _resolve_pending_checks()
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return
    ref, version = _checked_positions
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return
    if torch.compiler.is_compiling():
        return
    packed = (position_ids.diff(dim=-1) != 1).any()
    _checked_positions[:] = [weakref.ref(position_ids), position_ids._version]
    if not position_ids.is_cuda:
        _raise_if_packed(bool(packed), position_ids.shape)
        return
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending_checks.append((event, flag, position_ids.shape))


_packed_offsets: list = [None, -1, None]  # weak reference to the last packed_sequence_mask read, its version, result


def _documents_of(packed_mask: torch.Tensor):
    """(cu_seqlens on the mask's device, longest document) of a packed_sequence_mask, (batch, seq)
    document indices: a document is a run of one index within a row. Read on the host once per
    mask tensor and version (one synchronisation per forward); the offsets' host copy is recorded
    for the backward's schedule."""
    ref, version, result = _packed_offsets
    if ref is not None and ref() is packed_mask and version == packed_mask._version:
        return result
    rows = packed_mask.cpu()
    starts = torch.ones(rows.shape, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    cu_host = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([rows.numel()])]).to(torch.int32)
    cu = cu_host.to(packed_mask.device)
    remember_host_offsets(cu, cu_host.tolist())
    result = (cu, int((cu_host[1:] - cu_host[:-1]).max()))
    _packed_offsets[:] = [weakref.ref(packed_mask), packed_mask._version, result]
    return result


def _current_packing(query: torch.Tensor, key: torch.Tensor, position_ids):
    """The packed documents the mask hook found in this forward for this call's shape, or None."""
    packed = _packed_mask[0]
    if packed is None or position_ids is None:
        return None
    batch, _, seqlen, _ = query.shape
    if tuple(packed.shape) != (batch, seqlen) or key.shape[2] != seqlen:
        return None  # not this call's (position_ids are checked as without packing)
    return _documents_of(packed)


def _causal(module, kwargs) -> bool:
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "is_causal", True) is False:
            is_causal = False  # transformers' switch to bidirectional attention for decoder models
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    return is_causal


_cp: list = [None]  # (group, layout) inside context_parallel(), else None
# The last position_ids accepted under CP: weak reference, version, and the (group, layout) checked against.
_cp_checked_positions: list = [None, -1, None]


@contextlib.contextmanager
def context_parallel(group, layout: str = "zigzag"):
    """Within it, every "dash_fa3" attention call runs ``context_parallel_attn`` over ``group`` (a
    ProcessGroup, 1-D DeviceMesh or (DeviceMesh, dim)) with ``layout`` ("zigzag" or "contiguous"):
    the model gets this rank's tokens, as ``dash_fa3.distributed.shard`` gives them."""
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"unknown layout {layout!r}; choose from zigzag, contiguous")
    if group is None:
        raise TypeError("context_parallel needs the process group of the sequence's ranks")
    saved = _cp[0]
    _cp[0] = (group, layout)
    try:
        yield
    finally:
        _cp[0] = saved


def _cp_ranks(group) -> tuple[int, int]:
    if isinstance(group, tuple):
        group = group[0].get_group(group[1])
    elif not isinstance(group, dist.ProcessGroup):
        group = group.get_group()
    return dist.get_rank(group), dist.get_world_size(group)


def _layout_positions(layout: str, seqlen: int, rank: int, size: int) -> torch.Tensor:
    """The global positions of ``rank``'s tokens of a ``seqlen``-token sequence, in local order."""
    if layout == "contiguous":
        return torch.arange(rank * seqlen // size, (rank + 1) * seqlen // size)
    chunk = seqlen // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * size - 1 - rank)])


def _cp_attention(query, key, value, scaling, causal, kwargs):
    """One attention call inside context_parallel(): this rank's tokens through context_parallel_attn."""
    group, layout = _cp[0]
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise _refuse("packed sequences (cu_seq_lens_q/k) with context parallelism")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap"):
        raise _refuse("a sliding window or softcap with context parallelism")
    if query.shape[2] != key.shape[2]:
        raise _refuse(f"{query.shape[2]} queries over {key.shape[2]} keys (a KV cache) with context parallelism")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise _refuse("context parallelism without position_ids (pass this rank's shard of the positions)")
    ref, version, checked_for = _cp_checked_positions
    if not (ref is not None and ref() is position_ids and version == position_ids._version and checked_for is _cp[0]):
        rank, size = _cp_ranks(group)
        want = _layout_positions(layout, query.shape[2] * size, rank, size).to(position_ids.device)
        if position_ids.shape[-1] != want.numel() or not bool((position_ids == want).all()):
            raise _refuse(f"position_ids that are not rank {rank}'s {layout} positions under context parallelism "
                          f"(packed documents, a KV cache offset or another layout)")
        _cp_checked_positions[:] = [weakref.ref(position_ids), position_ids._version, _cp[0]]
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = resolve_deterministic(_defaults["deterministic"])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = context_parallel_attn(q, k, v, group, causal=causal, softmax_scale=scaling, deterministic=deterministic,
                                layout=layout)
    return out, None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The "dash_fa3" attention function: (batch, heads, seq, dim) in, ((batch, seq, heads, dim), None) out."""
    if attention_mask is not None:
        raise _refuse(
            f"an explicit attention mask tensor (shape {tuple(attention_mask.shape)}): padding, packed sequences "
            f"or a custom 4D mask"
        )
    if dropout:
        raise _refuse(f"attention dropout (p={dropout}); set config.attention_dropout = 0 or use model.eval()")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise _refuse(f"{name}={kwargs[name]!r}")
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if kwargs.get(name) is not None:
            raise _refuse(f"the keyword {name} (transformers passes packed offsets as cu_seq_lens_q/k)")
    if _cp[0] is not None:
        if query.dtype not in (torch.bfloat16, torch.float16):
            raise UnsupportedAttention(f"attn_implementation='{NAME}' computes in bf16/fp16, but the model runs in "
                                       f"{query.dtype}: load it with dtype=torch.bfloat16")
        return _cp_attention(query, key, value, scaling, _causal(module, kwargs), kwargs)
    documents = None
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        # Offsets handed over by the caller (e.g. DataCollatorWithFlattening(return_flash_attn_kwargs=True)).
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        cu_k = cu_q if cu_k is None else cu_k
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        if cu_q is None or max_q is None or max_k is None:
            raise _refuse("packed offsets without cu_seq_lens_q, max_length_q and max_length_k")
        documents = (cu_q, cu_k, int(max_q), int(max_k))
    else:
        found = _current_packing(query, key, kwargs.get("position_ids"))
        if found is not None:
            documents = (found[0], found[0], found[1], found[1])
        else:
            _check_unpacked(kwargs.get("position_ids"))
    if query.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedAttention(
            f"attn_implementation='{NAME}' computes in bf16/fp16, but the model runs in {query.dtype}: "
            f"load it with dtype=torch.bfloat16 (or call model.to(torch.bfloat16))"
        )
    causal = _causal(module, kwargs)
    window = (-1, -1)  # no window beyond the causal flag
    given = kwargs.get("sliding_window")
    if given is not None:
        sliding_window = as_int(given)  # a model config may hold it as a NumPy integer
        if sliding_window is None or sliding_window < 1:
            raise TypeError(f"sliding_window must be a positive int, got {given!r}")
        if not causal:
            raise _refuse(f"a bidirectional sliding window (sliding_window={sliding_window}, is_causal=False)")
        window = (sliding_window - 1, 0)  # keys q - sliding_window < kv <= q
    # Gemma 2's logit cap (config.attn_logit_softcapping): on CUDA tensors the softcap kernels
    # (a DASH_FA3_SOFTCAP=1 build; without them flash_attn_func raises, naming the switch).
    softcap = kwargs.get("softcap") or 0.0
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = resolve_deterministic(_defaults["deterministic"])
    schedule = kwargs.get("schedule") or _defaults["schedule"]

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if documents is not None:
        # Documents packed in rows: (batch * seq, heads, dim) views, each document attending within itself.
        batch, seqlen = q.shape[:2]
        q, k, v = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v))
        out = flash_attn_varlen_func(q, k, v, *documents, softmax_scale=scaling, causal=causal, window_size=window,
                                     softcap=softcap, deterministic=deterministic, schedule=schedule)
        return out.view(batch, seqlen, *out.shape[1:]), None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap,
                          deterministic=deterministic, schedule=schedule)
    return out, None


def register() -> None:
    """Registers "dash_fa3" with transformers (done on import; calling it again is harmless)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_for_dash_fa3)


register()
