"""Input checks of the public API, with errors that say what to change.

Everything here runs before any kernel launch and needs no GPU, so the tests
cover it on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator

import numpy as np
import torch

from . import reference, variants
from .schedule import SCHEDULE_NAMES

SUPPORTED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# The CPU reference also takes fp32 inputs (it computes in fp32 whatever it is given); the kernels do not.
CPU_DTYPES = {**SUPPORTED_DTYPES, torch.float32: "fp32"}
HOPPER_CAPABILITY = (9, 0)


# ---------------------------------------------------------------- scalar arguments
# The API's numbers may come from NumPy (np.float32, np.int64) or as 0-d tensors or arrays as well as
# Python ints and floats: each is read as a Python number and then range-checked the same way.
# Booleans (Python, NumPy or tensor) are refused where a number is expected, although Python counts
# them as ints: True as a scale or a length is a bug in the caller.


def _is_bool(x) -> bool:
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, (torch.Tensor, np.ndarray)) and x.dtype in (
        torch.bool, np.bool_))


def _zero_dim(x):
    """A 0-d tensor or array as a Python number; any other value unchanged (None for an array or
    tensor that is not 0-d: not a scalar)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.item() if x.ndim == 0 else None
    return x


def as_int(x):
    """``x`` as a Python int if it is an integer scalar (int, NumPy integer, 0-d integer tensor or
    array), else None. Booleans are not integers here."""
    if _is_bool(x):
        return None
    x = _zero_dim(x)
    if isinstance(x, float):  # a 0-d floating tensor's item()
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def as_real(x):
    """``x`` as a Python float if it is a real scalar (int, float, NumPy number, 0-d real tensor or
    array), else None. Booleans and complex numbers are not real numbers here."""
    if _is_bool(x):
        return None
    x = _zero_dim(x)
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    return None


def check_count(name: str, x, minimum: int = 0) -> int:
    """An integer argument ``name`` >= ``minimum`` as a Python int (see :func:`as_int`)."""
    value = as_int(x)
    if value is None or value < minimum:
        what = "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return value


def check_softmax_scale(softmax_scale, headdim: int) -> float:
    """``softmax_scale``: a positive finite number, or None for 1/sqrt(headdim)."""
    if softmax_scale is None:
        return reference.default_softmax_scale(headdim)
    value = as_real(softmax_scale)
    if value is None or not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return value


class _ValueHeadDim:
    """The shapes' one rule for v's head dim: ``headdim_v=None`` means ``headdim``."""

    def __post_init__(self):
        if self.headdim_v is None:
            object.__setattr__(self, "headdim_v", self.headdim)


@dataclasses.dataclass(frozen=True)
class AttnShape(_ValueHeadDim):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    headdim: int
    dtype: str  # "bf16" / "fp16"; "fp32" on CPU tensors (the reference)
    headdim_v: int | None = None  # v's (and out's) head dim; None: headdim

    def variant(self, causal: bool, mask: str | None = None) -> variants.Variant:
        """The kernel variant of this shape: mask kind ``mask`` (variants.MASKS), or by default
        causal / full."""
        return variants.Variant(self.headdim, self.dtype, mask or ("causal" if causal else "full"), self.headdim_v)


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULE_NAMES)


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def _check_tensors(q, k, v, dims: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type == "cpu" and t.dtype not in CPU_DTYPES:
            raise TypeError(f"{name} must be torch.bfloat16 or torch.float16 (or torch.float32 on the CPU), "
                            f"got {t.dtype}")
        if t.device.type != "cpu" and t.dtype not in SUPPORTED_DTYPES:
            fp32_note = "; torch.float32 runs on CPU tensors only (the reference)" if t.dtype == torch.float32 else ""
            raise TypeError(f"{name} must be torch.bfloat16 or torch.float16 on {t.device.type}, got {t.dtype}"
                            f"{fp32_note}")
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dims ({layout}), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}; "
                f"call .contiguous() first"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"dash_fa3 runs on CUDA (Hopper) or, slowly, on the CPU; got device {q.device}")


def _check_heads(heads: int, heads_kv: int, headdim: int, headdim_v: int) -> None:
    if heads == 0 or heads_kv == 0:
        raise ValueError(f"head counts must be >= 1, got heads={heads}, heads_kv={heads_kv}")
    if heads % heads_kv != 0:
        raise ValueError(
            f"GQA/MQA needs heads % heads_kv == 0, got heads={heads}, heads_kv={heads_kv}"
        )
    variants.check_head_dims(headdim, headdim_v)


def _check_kv(k, v) -> None:
    """k and v agree on every dim but the head dim (v's may be narrower: MLA)."""
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree on all dims but the last (head dim), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")


def check_attention_inputs(q, k, v, *, causal: bool, schedule: str = "auto", mask: str | None = None,
                           softcap: bool = False) -> AttnShape:
    """Validates q, k, v of ``flash_attn_func`` and returns their shape. On CUDA tensors the
    forward kernel of mask kind ``mask`` (default: causal / full by ``causal``), the softcap
    one if ``softcap``, must be built."""
    _check_tensors(q, k, v, 4, "batch, seqlen, heads, headdim")

    batch, seqlen_q, heads, headdim = q.shape
    kb, seqlen_k, heads_kv, kd = k.shape
    _check_kv(k, v)
    if kb != batch:
        raise ValueError(f"batch sizes differ: q has {batch}, k and v have {kb}")
    if kd != headdim:
        raise ValueError(f"head dims differ: q has {headdim}, k has {kd}")
    if batch == 0:
        raise ValueError("batch size must be >= 1, got 0")
    if seqlen_q == 0 or seqlen_k == 0:
        raise ValueError(f"zero-length sequence: seqlen_q={seqlen_q}, seqlen_k={seqlen_k}; both must be >= 1")
    _check_heads(heads, heads_kv, headdim, v.shape[-1])
    check_schedule(schedule)
    shape = AttnShape(batch, seqlen_q, seqlen_k, heads, heads_kv, headdim, CPU_DTYPES[q.dtype], v.shape[-1])
    if q.is_cuda:
        # Host lookups (device properties, the extension's variant list) that
        # torch.compile cannot trace; under compilation the C++ op re-checks at run time.
        if not torch.compiler.is_compiling():
            check_cuda_device(q.device)
            check_built(shape.variant(causal, mask).name, softcap=softcap)
    return shape


def _window_side(w) -> int | None:
    """One side of a window_size as an int (None: unbounded, -1), or None if it is no integer:
    Python and NumPy ints and integer tensor entries (FA3's own tests pass a tensor) count."""
    if w is None:
        return -1
    return as_int(w)


def check_window_size(window_size) -> tuple[int, int]:
    """FA3's ``window_size``: a pair (left, right) of integers >= -1 (-1, or None, = unbounded),
    as a tuple, list or 2-element integer tensor."""
    try:
        pair = tuple(_window_side(w) for w in window_size)
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(w is not None and w >= -1 for w in pair):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded), got {window_size!r}")
    return pair


def check_softcap(softcap) -> float:
    """FA3's ``softcap``: 0 (or None) for none, else a positive finite number."""
    if softcap is None:
        return 0.0
    value = as_real(softcap)
    if value is None or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no capping), got {softcap!r}")
    return value


@dataclasses.dataclass(frozen=True)
class VarlenShape(_ValueHeadDim):
    batch: int
    total_q: int
    total_k: int
    heads: int
    heads_kv: int
    headdim: int
    dtype: str  # "bf16" / "fp16"; "fp32" on CPU tensors (the reference)
    headdim_v: int | None = None  # v's (and out's) head dim; None: headdim
    max_seqlen_q: int = 0  # the longest documents, as Python ints
    max_seqlen_k: int = 0


def check_seqused(name: str, seqused, cu_seqlens) -> None:
    """FA3's ``seqused_q`` / ``seqused_k``: the tokens of each document that count.

    Accepted when it equals the documents' lengths (``cu_seqlens`` differences),
    which is what FA3's callers pass when no token is allocated but unused; the
    comparison reads device data (one synchronisation per call that passes it).
    Fewer used tokens than a document holds are not offered: NotImplementedError."""
    if seqused is None:
        return
    if not isinstance(seqused, torch.Tensor) or seqused.dtype != torch.int32:
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.int32, got "
                        f"{seqused.dtype if isinstance(seqused, torch.Tensor) else type(seqused).__name__}")
    if seqused.dim() != 1 or seqused.numel() != cu_seqlens.numel() - 1 or seqused.device != cu_seqlens.device:
        raise ValueError(f"{name} must be 1-D with one entry per document on {cu_seqlens.device}, got shape "
                         f"{tuple(seqused.shape)} on {seqused.device}")
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"{name} cannot be checked under torch.compile (the check reads device data); "
                                  f"pass None")
    if not torch.equal(seqused, cu_seqlens[1:] - cu_seqlens[:-1]):
        raise NotImplementedError(f"{name} smaller than the documents' lengths (tokens allocated but unused) is "
                                  f"not supported; {name} equal to the lengths, or None, is")


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        schedule: str = "auto") -> VarlenShape:
    """Validates the packed inputs of ``flash_attn_varlen_func`` and returns their shape.

    cu_seqlens_q/k: int32, 1-D, batch + 1 entries each, on q's device. On CPU
    tensors their values are checked too (start at 0, non-decreasing, end at
    total_q / total_k, no document longer than max_seqlen_q / max_seqlen_k). On
    CUDA tensors reading them would synchronize with the device, so only their
    dtype, shape and device are checked; nor are they under torch.compile, which
    cannot trace a check that reads tensor data."""
    _check_tensors(q, k, v, 3, "total_tokens, heads, headdim")
    total_q, heads, headdim = q.shape
    total_k, heads_kv, kd = k.shape
    _check_kv(k, v)
    if kd != headdim:
        raise ValueError(f"head dims differ: q has {headdim}, k has {kd}")
    _check_heads(heads, heads_kv, headdim, v.shape[-1])
    check_schedule(schedule)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe one batch: got {cu_seqlens_q.numel()} and "
            f"{cu_seqlens_k.numel()} entries (batch + 1 each)"
        )
    max_seqlen_q = check_count("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_count("max_seqlen_k", max_seqlen_k)
    if q.device.type == "cpu" and not torch.compiler.is_compiling():  # data-dependent: not traceable
        check_offsets("cu_seqlens_q", cu_seqlens_q.tolist(), total_q, max_seqlen_q)
        check_offsets("cu_seqlens_k", cu_seqlens_k.tolist(), total_k, max_seqlen_k)
    return VarlenShape(cu_seqlens_q.numel() - 1, total_q, total_k, heads, heads_kv, headdim,
                       CPU_DTYPES[q.dtype], v.shape[-1], max_seqlen_q, max_seqlen_k)


def check_offsets(name: str, values, total: int, max_seqlen: int) -> None:
    """The host values of cu_seqlens_q / cu_seqlens_k (``name``): start at 0, non-decreasing,
    end at ``total`` packed tokens, no document longer than ``max_seqlen``."""
    values = [int(x) for x in values]
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the number of packed tokens ({total}, {name[-1]}.shape[0]), got "
                         f"{values[-1]}")
    longest = max(lengths)
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen_{name[-1]}={max_seqlen} is smaller than the longest document ({longest} tokens)")


def check_varlen_kernel(q, shape: VarlenShape, mask: str, softcap: bool = False) -> None:
    """On CUDA tensors: a Hopper GPU, and the packed forward kernel of ``mask`` (the softcap one
    if ``softcap``) for the shape in the build."""
    if q.is_cuda and not torch.compiler.is_compiling():
        check_cuda_device(q.device)
        check_built(variants.Variant(shape.headdim, shape.dtype, mask, shape.headdim_v).name, packed=True,
                    softcap=softcap)


@functools.lru_cache(maxsize=None)
def check_cuda_device(device: torch.device) -> None:
    """Raises unless ``device`` is a Hopper GPU (cached: a device's kind never changes)."""
    cap = torch.cuda.get_device_capability(device)
    if cap != HOPPER_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"dash_fa3's kernels need a Hopper GPU (sm_90: H100/H200); {device} is {name} "
            f"(sm_{cap[0]}{cap[1]}). Tensors on the CPU use the (slow) reference implementation."
        )


def family_name(packed: bool, softcap: bool) -> str:
    """How errors name a kernel family: "", "packed-document ", "softcap ", "packed-document softcap "."""
    return ("packed-document " if packed else "") + ("softcap " if softcap else "")


@functools.lru_cache(maxsize=None)
def check_built(variant_name: str, packed: bool = False, softcap: bool = False) -> None:
    """Raises unless the forward of ``variant_name`` is in this build (cached per name), for
    dense tensors or, ``packed``, for packed documents (variants.LAYOUTS), with plain or,
    ``softcap``, softcapped scores."""
    from . import _ext

    built = _ext.built_variants("fwd", packed, softcap)  # raises with the reason when the extension is missing
    if variant_name not in built:
        raise ValueError(f"the {family_name(packed, softcap)}forward kernel of variant {variant_name} was not "
                         f"compiled into this build (built: {', '.join(built) or 'none'}); "
                         f"{rebuild_hint(variant_name, packed, softcap)}")


def rebuild_hint(variant_name: str, packed: bool, softcap: bool = False) -> str:
    """How to build the kernels of ``variant_name`` (with the packed layout if ``packed``, the
    softcap kernels if ``softcap``)."""
    hdim = variant_name.split("-")[0]
    hint = f"rebuild with {variants.ENV_VAR} selecting it, e.g. {variants.ENV_VAR}={hdim}"
    if packed:
        hint += f", and {variants.LAYOUT_ENV} unset or naming packed"
    if softcap:
        hint += f", and {variants.SOFTCAP_ENV}=1"
    return hint + " pip install --no-build-isolation -e ."
