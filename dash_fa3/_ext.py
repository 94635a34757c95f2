"""Finds and loads the compiled extension (dash_fa3/_C*.so) once.

The pure-Python parts (reference, validation, schedule model) never need it.
``ext_error()`` says why it is unavailable, for error messages and test skips.
"""

from __future__ import annotations

import functools
import glob
import os

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    """Loads the .so; returns None on success or the reason it is unavailable."""
    candidates = sorted(glob.glob(os.path.join(_PKG_DIR, "_C*.so")))
    if not candidates:
        return (
            "the compiled extension dash_fa3/_C*.so was not found; build it on a machine with nvcc "
            "and a CUDA build of torch: pip install --no-build-isolation -e .  (see README.md)"
        )
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; the extension needs a CUDA build of torch"
    from . import _schemas  # noqa: F401  (the extension registers kernels for these schemas)

    try:
        torch.ops.load_library(candidates[0])
    except OSError as exc:
        return f"loading {candidates[0]} failed: {exc}"
    return None


def ext_error() -> str | None:
    return _load()


def available() -> bool:
    return _load() is None


def ops():
    """torch.ops.dash_fa3_C, loading it first; raises RuntimeError with the reason if absent."""
    err = _load()
    if err is not None:
        raise RuntimeError(f"dash_fa3: {err}")
    return torch.ops.dash_fa3_C


# The extension's op listing the compiled kernels of one direction and family.
_BUILT_OPS = {"fwd": "built_fwd_variants", "bwd": "built_bwd_variants"}


@functools.lru_cache(maxsize=None)
def built_variants(direction: str, packed: bool = False, softcap: bool = False) -> tuple[str, ...]:
    """Names of the variants whose ``direction`` ("fwd" / "bwd") kernel this build has, for
    dense tensors or, ``packed``, packed documents (variants.LAYOUTS), with plain or, ``softcap``,
    softcapped scores (variants.SOFTCAP_ENV); raises as ops() does when the extension is missing."""
    return tuple(getattr(ops(), _BUILT_OPS[direction])(bool(packed), bool(softcap)))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
