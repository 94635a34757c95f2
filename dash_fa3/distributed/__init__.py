"""Sequence parallelism (context parallelism) whose results are bitwise identical for every
number of ranks. See docs/design/distributed.md.

* :func:`context_parallel_attn` -- attention on local shards, differentiable (``attention.py``); its
  first call per group and arguments checks that every rank passes the same ones (``agreement.py``);
* :func:`shard` / :func:`unshard` -- a full tensor to this rank's tokens and back (``layout.py``,
  with ``G``, the fixed block granularity: the global length must be a multiple of 2*P*G); both and
  the attention mark what they return with its layout, so a mismatch is an error;
* :class:`CommunicationError`, :class:`CommunicationTimeout` -- a peer failed or stalled (``comm.py``);
* :class:`BlockBackend` -- the interface a fold kernel backend implements (``folds/backend.py``).

One home per algorithm, each holding its plan as data, validation, cost model and runtime:
``heads.py`` (whole heads per rank; the deterministic default), ``runs.py`` (DistFlashAttn's run
plan; the non-deterministic default) and ``folds/`` (the fold schedules, P-invariant for any
heads_kv, CPU only). They move data through the transports of ``transport.py`` (``p2p``) and
``shared.py`` (``shared``), behind one interface. ``python -m dash_fa3.distributed plan`` models
them all (``cli.py``, ``model.py``).
"""

from .attention import context_parallel_attn
from .comm import CommunicationError, CommunicationTimeout
from .folds import BlockBackend, TorchBlockBackend
from .layout import DEFAULT_LAYOUT, LAYOUTS, G, shard, unshard
from .model import CPCostModel, Estimate

__all__ = ["G", "LAYOUTS", "DEFAULT_LAYOUT", "context_parallel_attn", "shard", "unshard", "BlockBackend",
           "TorchBlockBackend", "CommunicationError", "CommunicationTimeout", "CPCostModel", "Estimate"]
