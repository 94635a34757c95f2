"""Load the FlashAttention-3 peer built by build_fa3.py, and call its forward and
backward ops the way FA3's own autograd does.

    from peers.fa3 import load_fa3, forward, backward
    fa3 = load_fa3()                     # raises FA3NotBuilt with the build command
    out, lse = forward(fa3, q, k, v, causal=True)
    dq, dk, dv = backward(fa3, dout, q, k, v, out, lse, causal=True, deterministic=True)

`forward` is the `_flash_attn_forward` custom op with the arguments
`flash_attn_func` passes; `backward` is the `_flash_attn_backward` custom op
with the arguments FA3's autograd backward passes (its C++ op runs the
preprocess, the main kernel and the postprocess). Nothing here reimplements FA3.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

try:
    from . import build_fa3
except ImportError:  # loaded as a top-level module, with benchmarks/peers on sys.path
    import build_fa3

DEFAULT_BUILD_DIR = build_fa3.DEFAULT_BUILD_DIR


class FA3NotBuilt(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class FA3:
    module: object                    # FA3's flash_attn_interface
    flash_attn_func: object
    flash_attn_varlen_func: object    # None unless built with --features varlen
    info: dict                        # fa3_build.json of the build
    build_dir: str

    @property
    def commit(self) -> str:
        return self.info.get("commit", "unknown")


def build_hint(build_dir) -> str:
    return (f"build it with: python benchmarks/peers/build_fa3.py --src PATH/TO/flash-attention"
            + ("" if Path(build_dir).resolve() == DEFAULT_BUILD_DIR else f" --build-dir {build_dir}"))


def load_fa3(build_dir=DEFAULT_BUILD_DIR) -> FA3:
    """FA3's interface from build_dir; FA3NotBuilt (saying how to build it) when absent."""
    build_dir = Path(build_dir).resolve()
    hopper = build_dir / "hopper"
    if build_fa3.built_library(build_dir) is None:
        raise FA3NotBuilt(f"FA3 is not built in {build_dir}; {build_hint(build_dir)}")
    info_path = build_dir / build_fa3.BUILD_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if str(hopper) not in sys.path:
        sys.path.insert(0, str(hopper))
    try:
        module = importlib.import_module("flash_attn_interface")
    except Exception as exc:  # a broken or mismatched .so: say which build failed to load
        raise FA3NotBuilt(f"importing FA3 from {hopper} failed: {type(exc).__name__}: {exc}") from exc
    # Another flash_attn_interface (a pip-installed FA3) imported earlier would shadow ours.
    origin = Path(module.__file__).resolve().parent
    if origin != hopper:
        raise FA3NotBuilt(f"flash_attn_interface was already imported from {origin}, not from {hopper}")
    varlen = module.flash_attn_varlen_func if "varlen" in info.get("features", ()) else None
    return FA3(module, module.flash_attn_func, varlen, info, str(build_dir))


def _packed(fa3: FA3, docs) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of packed documents ``docs``, or
    four Nones for dense tensors; packed documents need a build with --features varlen."""
    if docs is None:
        return None, None, None, None
    if fa3.flash_attn_varlen_func is None:
        raise FA3NotBuilt(f"this FA3 build has no varlen kernels; rebuild with --features varlen ({fa3.build_dir})")
    return tuple(docs)


def forward(fa3: FA3, q, k, v, causal: bool, softmax_scale: float | None = None, window=(-1, -1), docs=None,
            softcap: float = 0.0):
    """(out, lse) from FA3's forward op, called as flash_attn_func calls it; ``window`` is FA3's
    (left, right) window_size (needs a build with --features local), ``softcap`` its softcap
    (> 0 needs --features softcap). ``docs``: packed documents
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of (total, heads, d) tensors, called
    as flash_attn_varlen_func calls it."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    cu_q, cu_k, max_q, max_k = _packed(fa3, docs)
    out, lse, *_ = fa3.module._flash_attn_forward(
        q, k, v,
        None, None,         # k_new, v_new
        None,               # qv
        None,               # out
        cu_q, cu_k, None,   # cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new
        None, None,         # seqused_q, seqused_k
        max_q, max_k,       # max_seqlen_q, max_seqlen_k
        None, None, None,   # page_table, kv_batch_idx, leftpad_k
        None, None, None,   # rotary_cos, rotary_sin, seqlens_rotary
        None, None, None,   # q_descale, k_descale, v_descale
        softmax_scale,
        causal=causal, window_size_left=window[0], window_size_right=window[1], attention_chunk=0,
        softcap=softcap, num_splits=1, pack_gqa=None, sm_margin=0,
    )
    return out, lse


def backward(fa3: FA3, dout, q, k, v, out, lse, causal: bool, deterministic: bool,
             softmax_scale: float | None = None, dq=None, dk=None, dv=None, window=(-1, -1), docs=None,
             softcap: float = 0.0):
    """(dq, dk, dv) from FA3's backward op as its autograd calls it: into dq/dk/dv
    when given (preallocated), else into fresh empty_like tensors, as FA3 does. ``docs`` and
    ``softcap`` as for forward."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    cu_q, cu_k, max_q, max_k = _packed(fa3, docs)
    if dq is None:
        dq, dk, dv = (x.new_empty(x.shape) for x in (q, k, v))
    fa3.module._flash_attn_backward(
        dout, q, k, v, out, lse,
        cu_q, cu_k,         # cu_seqlens_q, cu_seqlens_k
        None, None,         # seqused_q, seqused_k
        max_q, max_k,       # max_seqlen_q, max_seqlen_k
        dq, dk, dv,
        softmax_scale, causal,
        window[0], window[1],   # window_size left, right
        softcap,
        deterministic,
        0,                  # sm_margin
    )
    return dq, dk, dv


def forward_fn(fa3: FA3, q, k, v, causal: bool):
    """A no-argument callable running FA3's forward (for timing)."""
    return lambda: forward(fa3, q, k, v, causal)


def backward_fn(fa3: FA3, q, k, v, dout, causal: bool, deterministic: bool, preallocate: bool = False):
    """A no-argument callable running FA3's backward on the output of one forward
    (for timing); preallocate reuses one set of dq/dk/dv across calls."""
    out, lse = forward(fa3, q, k, v, causal)
    grads = tuple(x.new_empty(x.shape) for x in (q, k, v)) if preallocate else (None, None, None)
    return lambda: backward(fa3, dout, q, k, v, out, lse, causal, deterministic, None, *grads)
