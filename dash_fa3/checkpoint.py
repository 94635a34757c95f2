"""Rematerialization-aware activation checkpointing (DistFlashAttn's third idea).

Plain checkpointing of a transformer block reruns the whole block in the
backward pass, attention included -- and attention's own backward then
recomputes the scores again, so the attention forward runs twice per step
(three times counting the score recomputation inside its backward). For
context-parallel attention the rerun also repeats all of its communication.
:func:`checkpoint_block` checkpoints the block with a selective policy that
*saves* the attention ops' outputs (out and LSE of ``dash_fa3::fwd`` and of
``dash_fa3::cp_fwd``) and recomputes everything else, so the recomputation
replays the cheap layers around attention and reuses its saved output: one
attention forward per layer per step. The cost is keeping out (the size of q)
and LSE per layer, which the attention backward needs anyway.

Built on ``torch.utils.checkpoint`` (non-reentrant) and
``create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["attention_ops", "attention_save_policy", "checkpoint_block"]


def attention_ops() -> tuple:
    """The attention forward ops whose outputs are saved: ``dash_fa3::fwd`` and, when
    torch.distributed is available, ``dash_fa3::cp_fwd``."""
    from . import ops  # noqa: F401  (registers dash_fa3::fwd)
    found = [torch.ops.dash_fa3.fwd.default]
    if torch.distributed.is_available():
        from .distributed import attention  # noqa: F401  (registers dash_fa3::cp_fwd)
        found.append(torch.ops.dash_fa3.cp_fwd.default)
    return tuple(found)


def attention_save_policy(extra_ops=()):
    """A selective-checkpoint policy: MUST_SAVE the attention ops (and ``extra_ops``, OpOverloads),
    PREFER_RECOMPUTE the rest."""
    save = frozenset(attention_ops() + tuple(extra_ops))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_block(fn, *args, extra_save_ops=(), **kwargs):
    """``fn(*args, **kwargs)`` under activation checkpointing that does not rerun attention.

    Use it where one would call ``torch.utils.checkpoint.checkpoint`` on a transformer block;
    gradients are those of the uncheckpointed block. ``extra_save_ops``: more ops (OpOverloads,
    e.g. ``torch.ops.aten.mm.default``) whose outputs to keep rather than recompute.
    """
    context_fn = functools.partial(create_selective_checkpoint_contexts, attention_save_policy(extra_save_ops))
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
