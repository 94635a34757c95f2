"""Input checks of the public API, with errors that say what to change.

Everything here runs before any kernel launch and needs no GPU, so the tests
cover it on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import variants
from .schedule import SCHEDULE_NAMES

SUPPORTED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
HOPPER_CAPABILITY = (9, 0)


@dataclasses.dataclass(frozen=True)
class AttnShape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    headdim: int
    dtype: str  # "bf16" / "fp16"

    def variant(self, causal: bool) -> variants.Variant:
        return variants.Variant(self.headdim, self.dtype, "causal" if causal else "full")


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULE_NAMES)


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def check_attention_inputs(q, k, v, *, causal: bool, schedule: str = "auto") -> AttnShape:
    """Validates q, k, v of ``flash_attn_func`` and returns their shape."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be torch.bfloat16 or torch.float16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}; "
                f"call .contiguous() first"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")

    batch, seqlen_q, heads, headdim = q.shape
    kb, seqlen_k, heads_kv, kd = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kb != batch:
        raise ValueError(f"batch sizes differ: q has {batch}, k and v have {kb}")
    if kd != headdim:
        raise ValueError(f"head dims differ: q has {headdim}, k and v have {kd}")
    if batch == 0:
        raise ValueError("batch size must be >= 1, got 0")
    if seqlen_q == 0 or seqlen_k == 0:
        raise ValueError(f"zero-length sequence: seqlen_q={seqlen_q}, seqlen_k={seqlen_k}; both must be >= 1")
    if heads == 0 or heads_kv == 0:
        raise ValueError(f"head counts must be >= 1, got heads={heads}, heads_kv={heads_kv}")
    if heads % heads_kv != 0:
        raise ValueError(
            f"GQA/MQA needs heads % heads_kv == 0, got heads={heads}, heads_kv={heads_kv}"
        )
    if headdim not in variants.HEADDIMS:
        raise ValueError(
            f"head dim {headdim} is not supported; supported: {', '.join(map(str, variants.HEADDIMS))}"
        )
    check_schedule(schedule)
    shape = AttnShape(batch, seqlen_q, seqlen_k, heads, heads_kv, headdim, SUPPORTED_DTYPES[q.dtype])
    if q.is_cuda:
        # Host lookups (device properties, the extension's variant list) that
        # torch.compile cannot trace; under compilation the C++ op re-checks at run time.
        if not torch.compiler.is_compiling():
            check_cuda_device(q.device)
            check_built(shape.variant(causal).name)
    elif q.device.type != "cpu":
        raise ValueError(f"dash_fa3 runs on CUDA (Hopper) or, slowly, on the CPU; got device {q.device}")
    return shape


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


@functools.lru_cache(maxsize=None)
def check_built(variant_name: str) -> None:
    """Raises unless the forward of ``variant_name`` is in this build (cached per name)."""
    from . import _ext

    built = _ext.built_fwd_variants()  # raises with the reason when the extension is missing
    if variant_name not in built:
        hdim = variant_name.split("-")[0]
        raise ValueError(
            f"variant {variant_name} was not compiled into this build (built: {', '.join(built)}); "
            f"rebuild with {variants.ENV_VAR} selecting it, e.g. {variants.ENV_VAR}={hdim}"
        )
