"""Adapters that put dash_fa3 behind the attention switch of a training framework.

Each adapter lives in its own module and imports its framework only when that
module is imported, so ``import dash_fa3`` never pulls a framework in:

- ``dash_fa3.integrations.transformers``: Hugging Face transformers 5.x;
  importing it registers ``attn_implementation="dash_fa3"``.
- ``dash_fa3.integrations.torchtitan``: TorchTitan 0.3.x; ``use_dash_fa3(model_config)``
  or ``apply(model)`` swaps the decoder's inner attention for ``DashFA3Attention``.
- ``dash_fa3.integrations.megatron``: Megatron-Core 0.19.x;
  ``DashFA3DotProductAttention`` replaces ``DotProductAttention`` as a layer spec's
  core attention (``get_gpt_layer_dash_fa3_spec``).

Adapters translate layouts and arguments into ``dash_fa3.flash_attn_func``,
pass ``deterministic`` and ``schedule`` through, and raise a clear error for
what they cannot express (a mask, dropout, a window); they never fall back to
another attention.

Context parallelism goes to ``dash_fa3.distributed.context_parallel_attn`` with
the framework's token order: Megatron-Core's ``context_parallel_size`` (its CP
group, zigzag as ``get_batch_on_this_cp_rank`` shards), TorchTitan through
``torchtitan.apply_cp(model, cp_mesh)`` (zigzag: its "headtail" load balancer),
transformers inside ``transformers.context_parallel(group)`` (inputs sharded
with ``dash_fa3.distributed.shard``).
"""


class UnsupportedAttention(ValueError):
    """The model asked for attention that dash_fa3 cannot compute exactly; nothing fell back.

    Every adapter raises it (and re-exports it under its own module)."""


def check_options(deterministic, schedule) -> None:
    """An adapter's ``deterministic`` (True, False, or None: follow
    ``torch.are_deterministic_algorithms_enabled()`` at each call) and ``schedule``."""
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True, False or None, got {deterministic!r}")
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a schedule name (str), got {schedule!r}")
    from ..validation import check_schedule

    check_schedule(schedule)


def resolve_deterministic(deterministic) -> bool:
    """An adapter's ``deterministic`` at call time: None follows torch's deterministic flag."""
    if deterministic is None:
        import torch

        return torch.are_deterministic_algorithms_enabled()
    return deterministic
