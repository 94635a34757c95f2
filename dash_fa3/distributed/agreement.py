"""Every rank of a context-parallel call must pass the same arguments; this checks that they do.

A rank that passes another dtype, local length, head count, ``causal``, scale, layout, algorithm or
mode than its peers would compute garbage without any error (each rank's plan assumes its peers'
shapes), or abort inside gloo. So on its first call per (group, signature), every rank all-gathers a
compact encoding of its arguments (a few int64s, one small collective) together with whether its
own checks passed; each rank then raises the same one-line error naming the fields and the ranks
that differ, or the first rank whose own checks failed. A signature that passed on a group is
remembered, so repeated calls cost a set lookup. The all-gather is bounded by the group's timeout
like every wait (``comm.py``): a rank that never calls makes the others raise
:class:`~.comm.CommunicationTimeout`.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist

from .. import reference, validation
from . import comm
from .layout import LAYOUTS
from .model import ALGORITHMS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEVICES = ("cpu", "cuda")
INVALID = -2    # a field this rank's arguments do not give (not a tensor, not a bool, ...)


def _code(value, table) -> int:
    return table.index(value) if value in table else INVALID


def _flag(value) -> int:
    return int(value) if isinstance(value, bool) else INVALID


def _scale_bits(scale, headdim: int) -> int:
    if scale is None and headdim > 0:
        scale = reference.default_softmax_scale(headdim)
    scale = validation.as_real(scale)
    if scale is None or not math.isfinite(scale):
        return INVALID
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def _dims(t, n: int) -> list[int]:
    if isinstance(t, torch.Tensor) and t.dim() == n:
        return list(t.shape)
    return [INVALID] * n


# (name, how a gathered value reads in a message)
FIELDS = (
    ("dtype", lambda c: str(DTYPES[c]) if 0 <= c < len(DTYPES) else "not one of bf16/fp16/fp32"),
    ("batch", str), ("local length", str), ("heads", str), ("heads_kv", str), ("head dim", str),
    ("causal", lambda c: str(bool(c)) if c >= 0 else "not a bool"),
    ("softmax_scale", lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]) if c != INVALID else "invalid"),
    ("layout", lambda c: repr(LAYOUTS[c]) if 0 <= c < len(LAYOUTS) else "invalid"),
    ("algorithm", lambda c: repr(ALGORITHMS[c]) if 0 <= c < len(ALGORITHMS) else "invalid"),
    ("deterministic", lambda c: str(bool(c)) if c >= 0 else "not a bool"),
    ("device type", lambda c: DEVICES[c] if 0 <= c < len(DEVICES) else "invalid"),
    ("superblock", lambda c: str(c) if c > 0 else "none" if c == 0 else "invalid"),
)


def signature(q, k, causal, softmax_scale, layout, algorithm, deterministic, superblock=0) -> tuple[int, ...]:
    """The call's arguments as int64s, one per :data:`FIELDS` entry (the algorithm and scale as this
    rank resolved them); INVALID where an argument is not of its type or not resolved (the rank's own
    check reports that)."""
    b, n, h, d = _dims(q, 4)
    hk = _dims(k, 4)[2]
    dtype = _code(q.dtype, DTYPES) if isinstance(q, torch.Tensor) else INVALID
    device = _code(q.device.type, DEVICES) if isinstance(q, torch.Tensor) else INVALID
    algo = _code(algorithm, ALGORITHMS)   # None (not resolved: this rank's checks failed) is INVALID
    sb = validation.as_int(superblock if superblock is not None else 0)
    return (dtype, b, n, h, hk, d, _flag(causal), _scale_bits(softmax_scale, d), _code(layout, LAYOUTS), algo,
            _flag(deterministic), device, INVALID if sb is None else sb)


_agreed: dict[tuple[str, int], set] = {}


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if comm.is_nccl(group) else torch.device("cpu")


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def check(group, sig: tuple[int, ...], error: Exception | None) -> None:
    """Raise, on every rank alike, if the ranks' signatures differ or a rank's own checks failed
    (``error``); remember a signature that passed. Collective on a signature's first call."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    key = (group.group_name, id(group))
    if error is None and sig in _agreed.get(key, ()):
        return
    if P == 1:
        if error is not None:
            raise error
        _agreed.setdefault(key, set()).add(sig)
        return
    where = "checking that every rank passes the same arguments"
    mine = torch.tensor([int(error is None), *sig], dtype=torch.int64, device=_device(group))
    rows = [torch.empty_like(mine) for _ in range(P)]
    with comm.guard(group, rank, where):
        work = dist.all_gather(rows, mine, group=group, async_op=True)
    comm.wait_works([work], [("the all-gather of every rank's arguments", None)], group, rank, where)
    rows = [r.tolist() for r in rows]
    differ = []
    for i, (name, show) in enumerate(FIELDS):
        by_value: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            if row[1 + i] != INVALID:   # a rank's own check names what is wrong with its argument
                by_value.setdefault(row[1 + i], []).append(r)
        if len(by_value) > 1:
            differ.append(f"{name} " + ", ".join(f"{show(v)} on {_ranks(rs)}" for v, rs in by_value.items()))
    if differ:
        raise ValueError("context_parallel_attn: every rank of the group must pass the same arguments; they differ "
                         "in " + "; ".join(differ))
    failed = [r for r, row in enumerate(rows) if not row[0]]
    if failed:
        texts = [None] * P
        with comm.guard(group, rank, where):
            dist.all_gather_object(texts, None if error is None else (type(error).__name__, str(error)), group=group)
        kind, text = texts[failed[0]]
        cls = {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(kind, ValueError)
        raise cls(f"context_parallel_attn on {_ranks(failed)}: {text}") from error
    _agreed.setdefault(key, set()).add(sig)
