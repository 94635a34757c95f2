"""Which tokens each rank holds: the fixed block granularity ``G``, the two layouts, and
``shard`` / ``unshard`` (every algorithm shares them).

The sequence is cut into blocks of ``G = 128`` tokens whatever the number of ranks P is, so every
algorithm's plan is made of the same aligned blocks. A layout assigns the blocks to ranks in
*chunks* (one owner's run of blocks): ``contiguous`` gives rank r chunk r of P; ``zigzag`` gives
rank r chunks r and 2P-1-r of 2P (one cheap and one expensive band of a causal mask). A global
length must therefore be a multiple of 2*P*G.

The same layout must reach ``shard``, ``context_parallel_attn`` and ``unshard``: a mismatch gives
tokens in the wrong places, not an error. So ``shard`` and ``context_parallel_attn`` mark the tensors
they return with their layout (an attribute, :func:`mark_layout`), and each group remembers the
layouts ``shard`` used per local length; :func:`check_shard_layout` refuses a call whose layout
contradicts either (a copy of a shard loses its mark, but not the group's record).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .. import validation
from . import comm

G = 128  # block granularity in tokens; fixed so no algorithm's structure depends on P
LAYOUTS = ("contiguous", "zigzag")
DEFAULT_LAYOUT = "contiguous"   # what the default balancing (helper-worker) evens out


def check_seqlen(seqlen, num_ranks, block: int = G) -> int:
    """The number of blocks of a global sequence of ``seqlen`` tokens over ``num_ranks``
    ranks; ValueError (saying which lengths work) unless seqlen is a multiple of 2*P*G."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"the number of ranks must be a positive int, got {num_ranks!r}")
    unit = 2 * int(num_ranks) * block
    if isinstance(seqlen, bool) or not isinstance(seqlen, (int, np.integer)) or seqlen <= 0 or seqlen % unit:
        hint = f"{unit}, {2 * unit}, {3 * unit}, ..."
        if isinstance(seqlen, (int, np.integer)) and seqlen > unit:
            below = seqlen // unit * unit
            hint += f" (nearest: {below} or {below + unit})"
        raise ValueError(f"sequence length {seqlen!r} does not split into whole {block}-token blocks over "
                         f"{num_ranks} ranks: the total length must be a multiple of 2*P*{block} = {unit}: {hint}")
    return int(seqlen) // block


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    return layout


def chunk_bounds(layout: str, num_ranks: int, num_blocks: int) -> np.ndarray:
    """Chunk boundaries in blocks (ascending, len C+1). A chunk is one owner's run of blocks and
    the unit of a step: step s+1 folds partner chunk s."""
    check_layout(layout)
    parts = num_ranks if layout == "contiguous" else 2 * num_ranks
    if num_blocks % parts:
        raise ValueError(f"{num_blocks} blocks do not split into {parts} chunks")
    return np.arange(parts + 1, dtype=np.int64) * (num_blocks // parts)


def chunk_owners(layout: str, num_ranks: int) -> np.ndarray:
    """Owner rank of each chunk: contiguous, rank r owns chunk r; zigzag, rank r owns chunks
    r and 2P-1-r of 2P (each rank gets one early and one late chunk, which balances causal work)."""
    check_layout(layout)
    if layout == "contiguous":
        return np.arange(num_ranks, dtype=np.int64)
    i = np.arange(2 * num_ranks, dtype=np.int64)
    return np.where(i < num_ranks, i, 2 * num_ranks - 1 - i)


def block_owners(layout: str, num_ranks: int, num_blocks: int) -> np.ndarray:
    cb = chunk_bounds(layout, num_ranks, num_blocks)
    return np.repeat(chunk_owners(layout, num_ranks), np.diff(cb))


def local_blocks(layout: str, num_ranks: int, num_blocks: int, rank: int) -> np.ndarray:
    """The global blocks rank ``rank`` holds, in its local order (ascending)."""
    return np.flatnonzero(block_owners(layout, num_ranks, num_blocks) == rank)


def block_runs(blocks) -> list[tuple[int, int]]:
    """Ascending global blocks as maximal [lo, hi) runs of consecutive ones."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return [(lo, hi) for lo, hi in runs]


def resolve_group(group):
    """A ProcessGroup from ``group``: a ProcessGroup, a 1-D DeviceMesh, or ``(DeviceMesh, dim)``.
    There is no default: sequence parallelism over the whole world by accident is a bug."""
    if group is None:
        raise TypeError("dash_fa3.distributed needs an explicit process group: pass group=<ProcessGroup>, "
                        "a 1-D DeviceMesh, or (DeviceMesh, mesh_dim)")
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a {group.ndim}-D DeviceMesh needs a dimension: pass (mesh, mesh_dim)")
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh_dim = group[1]
        if mesh_dim is not None and not isinstance(mesh_dim, str):
            # DeviceMesh takes only a Python int as an index (a NumPy integer fails its assertion)
            mesh_dim = validation.as_int(mesh_dim)
            if mesh_dim is None:
                raise TypeError(f"the mesh_dim of (DeviceMesh, mesh_dim) must be an int or a dimension name, "
                                f"got {group[1]!r}")
        return group[0].get_group(mesh_dim)
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, mesh_dim), "
                    f"got {type(group).__name__}")


def resolve_layout(layout) -> str:
    if layout is None:
        return DEFAULT_LAYOUT
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)} (None: {DEFAULT_LAYOUT})")
    return layout


MARK = "_dash_fa3_layout"
_sharded: dict[tuple[str, int, int], set[str]] = {}   # (group name, id, local length) -> layouts shard used


def mark_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` marked as holding this rank's tokens in ``layout`` (what shard and the attention return)."""
    setattr(x, MARK, layout)
    return x


def check_shard_layout(layout: str, *xs: torch.Tensor, group, seq_dim: int = 1) -> None:
    """ValueError if a tensor is marked with another layout, or, for unmarked ones, if ``shard`` on
    this group cut tensors of this local length only with another layout. With one rank both
    layouts are the identity."""
    if dist.get_world_size(group) == 1:
        return
    for x in xs:
        have = getattr(x, MARK, None)
        if have is not None and have != layout:
            raise ValueError(f"a tensor passed with layout={layout!r} holds its rank's tokens in layout={have!r} "
                             f"(shard/context_parallel_attn made it so): pass layout={have!r} here too")
        if have is None:
            used = _sharded.get((group.group_name, id(group), x.shape[seq_dim % x.dim()]), ())
            if used and layout not in used:
                raise ValueError(f"a tensor passed with layout={layout!r} has the local length that shard gave "
                                 f"on this group only with layout={sorted(used)[0]!r}: pass that layout here too")


def _check_dim(x: torch.Tensor, seq_dim) -> int:
    """``seq_dim`` (an int or NumPy integer, negative counting from the end; not a bool) as an
    index into ``x.shape``."""
    dim = validation.as_int(seq_dim)
    if dim is None or not -x.dim() <= dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim!r} is not a dimension of a {x.dim()}-D tensor: "
                         f"pass an int in [{-x.dim()}, {x.dim() - 1}]")
    return dim % x.dim()


def shard(x: torch.Tensor, group, seq_dim: int = 1, layout=None) -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` (the same on every rank), in global order.

    ``layout``: ``"contiguous"`` (default; rank r holds tokens [r*N/P, (r+1)*N/P)) or
    ``"zigzag"`` (2P chunks; rank r holds chunks r and 2P-1-r). N must be a multiple of 2*P*128.
    Differentiable (narrow/cat)."""
    pg = resolve_group(group)
    layout = resolve_layout(layout)
    dim = _check_dim(x, seq_dim)
    P, rank = dist.get_world_size(pg), dist.get_rank(pg)
    nb = check_seqlen(x.shape[dim], P)
    parts = [x.narrow(dim, lo * G, (hi - lo) * G)
             for lo, hi in block_runs(local_blocks(layout, P, nb, rank).tolist())]
    local = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    _sharded.setdefault((pg.group_name, id(pg), local.shape[dim]), set()).add(layout)
    return mark_layout(local, layout)


def unshard(x_local: torch.Tensor, group, seq_dim: int = 1, layout=None) -> torch.Tensor:
    """The full tensor on every rank from each rank's ``shard`` (an all-gather; not differentiable,
    a utility for checking and for outputs). A peer that fails or stalls raises
    :class:`~.comm.CommunicationError` (:class:`~.comm.CommunicationTimeout`)."""
    pg = resolve_group(group)
    layout = resolve_layout(layout)
    dim = _check_dim(x_local, seq_dim)
    P, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n = x_local.shape[dim]
    nb = check_seqlen(n * P, P)
    have = getattr(x_local, MARK, None)
    if P > 1 and have is not None and have != layout:
        raise ValueError(f"unshard(layout={layout!r}) of a tensor that holds its rank's tokens in layout={have!r}: "
                         f"pass layout={have!r}")
    gathered = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(P)]
    with comm.guard(pg, rank, "unshard"):
        work = dist.all_gather(gathered, x_local.contiguous(), group=pg, async_op=True)
    comm.wait_works([work], [("the all-gather of every rank's shard", None)], pg, rank, "unshard")
    shape = list(x_local.shape)
    shape[dim] = n * P
    full = x_local.new_empty(shape)
    for r in range(P):
        pos = 0
        for lo, hi in block_runs(local_blocks(layout, P, nb, r).tolist()):
            full.narrow(dim, lo * G, (hi - lo) * G).copy_(gathered[r].narrow(dim, pos, (hi - lo) * G))
            pos += (hi - lo) * G
    return full
