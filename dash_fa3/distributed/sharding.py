"""Token-to-rank layouts: ``shard`` / ``unshard`` and process-group arguments."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..schedule import distributed as S

DEFAULT_LAYOUT = "contiguous"   # what the default schedule (helper-worker) balances


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
        return group[0].get_group(group[1])
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or (DeviceMesh, mesh_dim), "
                    f"got {type(group).__name__}")


def resolve_layout(layout) -> str:
    if layout is None:
        return DEFAULT_LAYOUT
    if layout not in S.LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(S.LAYOUTS)} (None: {DEFAULT_LAYOUT})")
    return layout


def _check_dim(x: torch.Tensor, seq_dim: int) -> int:
    if not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim!r} is not a dimension of a {x.dim()}-D tensor")
    return seq_dim % x.dim()


def shard(x: torch.Tensor, group, seq_dim: int = 1, layout=None) -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` (the same on every rank), in global order.

    ``layout``: ``"contiguous"`` (default; rank r holds tokens [r*N/P, (r+1)*N/P)) or
    ``"zigzag"`` (2P chunks; rank r holds chunks r and 2P-1-r). N must be a multiple of 2*P*128.
    Differentiable (narrow/cat)."""
    pg = resolve_group(group)
    layout = resolve_layout(layout)
    dim = _check_dim(x, seq_dim)
    P, rank = dist.get_world_size(pg), dist.get_rank(pg)
    nb = S.check_seqlen(x.shape[dim], P)
    parts = [x.narrow(dim, lo * S.G, (hi - lo) * S.G)
             for lo, hi in S.block_runs(S.local_blocks(layout, P, nb, rank).tolist())]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x_local: torch.Tensor, group, seq_dim: int = 1, layout=None) -> torch.Tensor:
    """The full tensor on every rank from each rank's ``shard`` (an all-gather; not differentiable,
    a utility for checking and for outputs)."""
    pg = resolve_group(group)
    layout = resolve_layout(layout)
    dim = _check_dim(x_local, seq_dim)
    P = dist.get_world_size(pg)
    n = x_local.shape[dim]
    nb = S.check_seqlen(n * P, P)
    gathered = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(P)]
    dist.all_gather(gathered, x_local.contiguous(), group=pg)
    shape = list(x_local.shape)
    shape[dim] = n * P
    full = x_local.new_empty(shape)
    for r in range(P):
        pos = 0
        for lo, hi in S.block_runs(S.local_blocks(layout, P, nb, r).tolist()):
            full.narrow(dim, lo * S.G, (hi - lo) * S.G).copy_(gathered[r].narrow(dim, pos, (hi - lo) * S.G))
            pos += (hi - lo) * S.G
    return full
