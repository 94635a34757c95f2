"""Load the FlashAttention-4 peer (the `flash-attn-4` package, CuTe DSL kernels, with SM90
kernels for Hopper) and call its forward and backward the way its autograd does.

    from peers.fa4 import load_fa4, forward, backward
    fa4 = load_fa4()                     # raises FA4NotInstalled with the install command
    out, lse = forward(fa4, q, k, v, causal=True)
    dq, dk, dv = backward(fa4, dout, q, k, v, out, lse, causal=True, deterministic=True)

`forward` is `flash_attn.cute.interface._flash_attn_fwd` with the arguments its
`FlashAttnFunc` passes under autograd (the LSE kept for the backward); `backward` is
`_flash_attn_bwd` as `FlashAttnFunc.backward` calls it. Nothing here reimplements FA4.

FA4 is optional and comes from the package registry, never vendored:

    pip install flash-attn-4 "nvidia-cutlass-dsl[cu13]"     # CUDA 13; [cu12] for CUDA 12

Its kernels are compiled on first use per configuration (tens of seconds each);
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 keeps them on disk for the next process.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import sys

INSTALL_HINT = 'pip install flash-attn-4 "nvidia-cutlass-dsl[cu13]"'


class FA4NotInstalled(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class FA4:
    interface: object     # flash_attn.cute.interface
    version: str


def _dsl_on_path() -> None:
    """The CuTe DSL's Python packages live in nvidia_cutlass_dsl/dsl_packages, which its .pth
    file puts on sys.path; an install with ``pip install --target`` skips .pth files."""
    try:
        importlib.import_module("cutlass")
        return
    except ImportError:
        pass
    try:
        dsl = importlib.import_module("nvidia_cutlass_dsl")
    except ImportError:
        return
    packages = os.path.join(list(dsl.__path__)[0], "dsl_packages")
    if os.path.isdir(packages) and packages not in sys.path:
        sys.path.insert(0, packages)


def load_fa4() -> FA4:
    """FA4's interface; FA4NotInstalled (saying how to install it) when absent or broken."""
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        raise FA4NotInstalled(f"flash-attn-4 is not installed; {INSTALL_HINT}") from None
    _dsl_on_path()
    try:
        interface = importlib.import_module("flash_attn.cute.interface")
    except Exception as exc:  # a missing DSL library or a mismatched torch: say which
        raise FA4NotInstalled(f"importing flash_attn.cute (flash-attn-4 {version}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    return FA4(interface, version)


def forward(fa4: FA4, q, k, v, causal: bool, softmax_scale: float | None = None):
    """(out, lse) from FA4's forward, with the LSE a training forward keeps."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse, *_ = fa4.interface._flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                 return_lse=True)
    return out, lse


def backward(fa4: FA4, dout, q, k, v, out, lse, causal: bool, deterministic: bool,
             softmax_scale: float | None = None):
    """(dq, dk, dv) from FA4's backward, as its autograd backward calls it."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    dq, dk, dv = fa4.interface._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal,
                                               deterministic=deterministic)[:3]
    return dq, dk, dv


def forward_fn(fa4: FA4, q, k, v, causal: bool):
    """A no-argument callable running FA4's forward (for timing)."""
    return lambda: forward(fa4, q, k, v, causal)


def backward_fn(fa4: FA4, q, k, v, dout, causal: bool, deterministic: bool):
    """A no-argument callable running FA4's backward on the output of one forward (for timing)."""
    out, lse = forward(fa4, q, k, v, causal)
    return lambda: backward(fa4, dout, q, k, v, out, lse, causal, deterministic)
