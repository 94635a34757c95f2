"""Sequence parallelism (context parallelism) whose results are bitwise identical for every
number of ranks. See docs/distributed.md.

* :func:`context_parallel_attn` -- attention on local shards, differentiable; deterministic by
  whole heads per rank (bitwise one GPU's result), non-deterministic by DistFlashAttn's run plan;
* :func:`shard` / :func:`unshard` -- a full tensor to this rank's tokens and back;
* :class:`CommunicationError`, :class:`CommunicationTimeout` -- a peer failed or stalled;
* :class:`~.backend.BlockBackend` -- the interface a kernel backend implements;
* ``G`` -- the fixed block granularity (128 tokens); the global length must be a multiple of 2*P*G.

The schedules themselves (data, validation, simulation) are in ``dash_fa3.schedule.distributed``.
"""

from ..schedule.distributed import G, LAYOUTS
from .attention import context_parallel_attn
from .backend import BlockBackend, TorchBlockBackend
from .runtime import CommunicationError, CommunicationTimeout
from .sharding import DEFAULT_LAYOUT, shard, unshard

__all__ = ["G", "LAYOUTS", "DEFAULT_LAYOUT", "context_parallel_attn", "shard", "unshard", "BlockBackend",
           "TorchBlockBackend", "CommunicationError", "CommunicationTimeout"]
