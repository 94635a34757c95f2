"""``context_parallel_attn`` and its custom ops ``dash_fa3::cp_fwd`` / ``dash_fa3::cp_bwd``.

Four algorithms (``algorithm=``; the default follows the mode):

* ``"superblocks"`` (default with ``deterministic=True``; ``superblocks.py``): one kernel call per
  fixed superblock of query rows, fp32 dK/dV partials summed along one fixed tree: the same bits for
  every number of ranks and both layouts, any heads_kv (MQA included).
* ``"heads"`` (``heads.py``): each rank computes whole heads
  over the whole sequence with the single-GPU kernels (on CPU, the reference): output and gradients
  bitwise those of one GPU, for every number of ranks and both layouts. Needs heads_kv >= P.
* ``"runs"`` (default with ``deterministic=False`` on CPU and where heads_kv < P; ``runs.py``): DistFlashAttn's
  helper-worker run plan: each rank calls the single-GPU kernels on whole runs of query blocks;
  partial dK/dV summed in fp32 (within rounding of one GPU, not bitwise).
* ``"folds"`` (``deterministic=True`` only, CPU only: its fold kernels do not exist on the GPU;
  ``folds/``): every block's reduction in one fixed order on one rank, bitwise the same for
  every number of ranks and any heads_kv (MQA included).

Custom ops (not a bare autograd.Function) so that selective activation
checkpointing (``dash_fa3.checkpoint``) can save their outputs and skip them --
computation and communication -- when a checkpointed region is recomputed.
The process group travels as its name (ops take no ProcessGroup objects).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import validation
from . import agreement, folds, heads, runs, superblocks
from . import transport as tr
from .layout import DEFAULT_LAYOUT, check_seqlen, check_shard_layout, mark_layout, resolve_group, resolve_layout
from .model import ALGORITHMS

DTYPES = agreement.DTYPES


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("dash_fa3::cp_fwd", mutates_args=())
def cp_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, causal: bool,
           softmax_scale: float, deterministic: bool, layout: str, algorithm: str,
           superblock: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Context-parallel attention forward on local shards: (out, lse (b, h, n) fp32, saved). saved:
    with algorithm "heads", this rank's heads' q, k, v, out, lse over the whole sequence, which its
    backward uses instead of gathering them again; else empty. ``superblock``: the superblock
    algorithm's S in tokens (the others ignore it)."""
    group = _group(group_name)
    if algorithm == "superblocks":
        return *superblocks.forward(q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale,
                                    superblock=superblock, transport=tr.choose(group, q.device)), []
    if algorithm == "heads":
        return heads.forward(q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale)
    if algorithm == "folds":
        backend = folds.get_backend(q.device, q.shape[2], k.shape[2], softmax_scale)
        return *folds.forward(q, k, v, group=group, causal=causal, layout=layout, backend=backend), []
    return *runs.forward(q, k, v, group=group, causal=causal, layout=layout,
                                 softmax_scale=softmax_scale), []


@cp_fwd.register_fake
def _cp_fwd_fake(q, k, v, group_name, causal, softmax_scale, deterministic, layout, algorithm, superblock):
    b, n, h, _ = q.shape
    saved = []
    if algorithm == "heads":
        group = _group(group_name)
        p = heads.plan_of(q.shape, k.shape[2], group, layout)
        saved = [q.new_empty(s, dtype=torch.float32 if len(s) == 3 else q.dtype)
                 for s in heads.saved_shapes(q.shape, k.shape[2], p, dist.get_rank(group))]
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32), saved


@torch.library.custom_op("dash_fa3::cp_bwd", mutates_args=())
def cp_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, group_name: str, causal: bool, softmax_scale: float, deterministic: bool,
           layout: str, algorithm: str, superblock: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context-parallel attention backward on local shards ("superblocks", "runs", "folds"): (dq, dk,
    dv) like q, k, v."""
    group = _group(group_name)
    if algorithm == "superblocks":
        return superblocks.backward(dout, q, k, v, out, lse, group=group, causal=causal, layout=layout,
                                    softmax_scale=softmax_scale, superblock=superblock,
                                    transport=tr.choose(group, q.device))
    if algorithm == "folds":
        backend = folds.get_backend(q.device, q.shape[2], k.shape[2], softmax_scale)
        return folds.backward(dout, q, k, v, out, lse, group=group, causal=causal, layout=layout,
                                backend=backend)
    return runs.backward(dout, q, k, v, out, lse, group=group, causal=causal, layout=layout,
                                 softmax_scale=softmax_scale)


@cp_bwd.register_fake
def _cp_bwd_fake(dout, q, k, v, out, lse, group_name, causal, softmax_scale, deterministic, layout, algorithm,
                 superblock):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("dash_fa3::cp_heads_bwd", mutates_args=())
def cp_heads_bwd(dout: torch.Tensor, saved: list[torch.Tensor], heads_kv: int, group_name: str, causal: bool,
                 softmax_scale: float, deterministic: bool,
                 layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head-parallel backward from the forward's saved tensors: (dq, dk, dv) of the local shards."""
    return heads.backward(dout, saved, heads_kv=heads_kv, group=_group(group_name), causal=causal, layout=layout,
                          softmax_scale=softmax_scale, deterministic=deterministic)


@cp_heads_bwd.register_fake
def _cp_heads_bwd_fake(dout, saved, heads_kv, group_name, causal, softmax_scale, deterministic, layout):
    b, n, _, d = dout.shape
    return torch.empty_like(dout), dout.new_empty((b, n, heads_kv, d)), dout.new_empty((b, n, heads_kv, d))


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, causal, softmax_scale, deterministic, layout, algorithm, superblock = inputs
    out, lse, saved = output
    ctx.heads_kv = k.shape[2]
    ctx.save_for_backward(*(saved if algorithm == "heads" else (q, k, v, out, lse)))
    ctx.args = (group_name, causal, softmax_scale, deterministic, layout, algorithm, superblock)
    ctx.mark_non_differentiable(lse, *saved)


def _backward(ctx, dout, dlse, dsaved):
    group_name, causal, softmax_scale, deterministic, layout, algorithm, _ = ctx.args
    if algorithm == "heads":
        dq, dk, dv = cp_heads_bwd(dout.contiguous(), list(ctx.saved_tensors), ctx.heads_kv, group_name, causal,
                                  softmax_scale, deterministic, layout)
    else:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = cp_bwd(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


cp_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check(q, k, v, pg):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, local_seqlen, heads, headdim)")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; dash_fa3.distributed takes bf16, fp16 or fp32")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, n, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != n or k.shape[3] != d:
        raise ValueError(f"k and v must be (batch, local_seqlen, heads_kv, headdim) matching q {tuple(q.shape)}: "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % k.shape[2]:
        raise ValueError(f"heads ({h}) must be a multiple of heads_kv ({k.shape[2]})")
    P = dist.get_world_size(pg)
    try:
        check_seqlen(n * P, P)
    except ValueError as e:
        raise ValueError(f"local length {n} x {P} ranks = {n * P} tokens: {e}") from None


def resolve_algorithm(algorithm, deterministic: bool, heads_kv: int = 0, num_ranks: int = 1,
                      device_type: str = "cpu") -> str:
    """The algorithm a call runs: ``algorithm`` checked against the mode, or the mode's default.

    Defaults: deterministic, ``superblocks`` (the same bits at every P, any heads_kv). Otherwise
    ``heads`` on CUDA when every rank can hold whole KV heads (heads_kv >= P), else ``runs``: on GPUs
    the head-parallel algorithm through the shared transport was the faster non-deterministic one
    where it applies (docs/journal/results.md)."""
    if algorithm is None:
        if deterministic:
            return "superblocks"
        return "heads" if device_type == "cuda" and heads_kv >= num_ranks else "runs"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)} "
                         f"(None: 'superblocks' when deterministic, else 'heads' on CUDA with heads_kv >= P, "
                         f"else 'runs')")
    if deterministic and algorithm == "runs":
        raise ValueError("algorithm='runs' sums partial dK/dV, whose grouping changes with the number of ranks: "
                         "it is not deterministic; use algorithm='superblocks' (the default), 'heads' or 'folds'")
    if not deterministic and algorithm in ("folds", "superblocks"):
        raise ValueError(f"algorithm={algorithm!r} is deterministic only: pass deterministic=True")
    return algorithm


def _validate(q, k, v, pg, causal, softmax_scale, deterministic, layout, algorithm, superblock):
    """This rank's own checks: (layout, algorithm, softmax scale, superblock) resolved, or the error."""
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):   # as flash_attn_func: "no" is not True
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    layout = resolve_layout(layout)
    _check(q, k, v, pg)
    check_shard_layout(layout, q, k, v, group=pg)
    P = dist.get_world_size(pg)
    algorithm = resolve_algorithm(algorithm, deterministic, k.shape[2], P, q.device.type)
    if q.device.type == "cuda":
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dash_fa3.distributed on CUDA takes bf16 or fp16, got {q.dtype}")
        if algorithm == "folds":
            raise NotImplementedError(
                "dash_fa3.distributed: algorithm='folds' needs fold kernels that do not exist on the GPU; "
                "use algorithm='superblocks' (the deterministic default: the same bits at every P, any "
                "heads_kv) or 'heads' (bitwise one GPU's result, heads_kv >= P)")
    elif q.device.type != "cpu":
        raise ValueError(f"dash_fa3.distributed runs on CUDA or CPU tensors, got {q.device.type}")
    if algorithm == "heads":
        heads.kv_ranges(k.shape[2], P)   # raises for heads_kv < P
    if superblock is not None and algorithm != "superblocks":
        raise ValueError(f"superblock={superblock!r} is the superblock algorithm's; algorithm={algorithm!r} "
                         f"takes none")
    sb = superblocks.check_superblock(superblock) if algorithm == "superblocks" else 0
    return layout, algorithm, validation.check_softmax_scale(softmax_scale, q.shape[-1]), sb


def context_parallel_attn(q, k, v, group, causal=False, softmax_scale=None, deterministic=False, layout=None,
                          algorithm=None, superblock=None):
    """Attention over a sequence split across the ranks of ``group``; returns this rank's output.

    q: (batch, local_seqlen, heads, headdim); k, v: (batch, local_seqlen, heads_kv, headdim),
    heads % heads_kv == 0; bf16 or fp16 (fp32 too on CPU). Each rank passes its shard as
    ``shard(x, group, layout=layout)`` gives it; the global length P * local_seqlen must be a
    multiple of 2 * P * 128. ``group``: a ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, dim);
    required. ``layout``: "contiguous" (default, helper-worker load balancing) or "zigzag".
    Differentiable.

    ``deterministic=True`` (``algorithm="superblocks"``): one kernel call per superblock of
    ``superblock`` tokens (default 8192; the bits depend on it, so keep it fixed) and fp32 dK/dV
    partials summed along one fixed tree, so output and gradients are bitwise the same for every
    number of ranks and both layouts, any heads_kv; the output and LSE are bitwise
    ``flash_attn_func``'s on the GPU, the gradients those of this algorithm on one rank. Balanced
    when the length is a multiple of 2 * P * superblock. ``algorithm="heads"``: each rank computes
    whole heads over the whole sequence, so output and gradients are bitwise those of
    ``flash_attn_func(..., deterministic=True)`` on one GPU; needs heads_kv >= P.
    ``algorithm="folds"`` (CPU only): the fold schedules, P-invariant at 128-token granularity.
    ``deterministic=False``: on CUDA with heads_kv >= P, ``heads`` (the faster there),
    else ``algorithm="runs"``: DistFlashAttn's helper-worker plan,
    the Hopper kernels on whole runs of query blocks (the reference on CPU); the output is bitwise a
    single-GPU call's, the gradients agree with one GPU to rounding (partial dK/dV summed in fp32).
    Either algorithm can be named in either mode where it is allowed. See docs/design/distributed.md.

    Every rank must pass the same dtype, local shape, ``causal``, scale, layout, algorithm, superblock and mode:
    the first call per (group, arguments) checks that with one small all-gather and raises the same
    one-line error on every rank otherwise (as it does when one rank's own arguments are wrong). A
    peer that fails or stalls makes every other rank raise :class:`CommunicationError` /
    :class:`CommunicationTimeout` within the group's timeout.
    """
    pg = resolve_group(group)
    try:
        args = _validate(q, k, v, pg, causal, softmax_scale, deterministic, layout, algorithm, superblock)
        error = None
    except (TypeError, ValueError, NotImplementedError) as e:   # every rank learns of it (agreement.check)
        args, error = None, e
    if torch.compiler.is_compiling():
        if error is not None:
            raise error
    else:
        # the resolved values where this rank's checks passed: ranks that resolve alike agree
        sig = agreement.signature(q, k, causal, args[2] if args else softmax_scale,
                                  args[0] if args else (DEFAULT_LAYOUT if layout is None else layout),
                                  args[1] if args else algorithm, deterministic, args[3] if args else superblock)
        agreement.check(pg, sig, error)
    layout, algorithm, softmax_scale, superblock = args
    out, _, _ = cp_fwd(q, k, v, pg.group_name, causal, softmax_scale, deterministic, layout, algorithm, superblock)
    return out if torch.compiler.is_compiling() else mark_layout(out, layout)
