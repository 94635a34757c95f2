"""dash_fa3: FlashAttention-3-class attention for Hopper with a fast deterministic backward.

Submodules load lazily, so ``dash_fa3.schedule`` and ``dash_fa3.variants``
import without torch.
"""

import importlib

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "reference", "variants", "schedule",
           "ReferenceBackwardWarning", "SlowReferenceWarning", "distributed", "checkpoint"]
__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": ("interface", "flash_attn_func"),
    "flash_attn_varlen_func": ("interface", "flash_attn_varlen_func"),
    "ReferenceBackwardWarning": ("ops", "ReferenceBackwardWarning"),
    "SlowReferenceWarning": ("reference", "SlowReferenceWarning"),
}


def __getattr__(name):
    # Called only for names not yet in the module's namespace: each is stored on
    # first use, so `dash_fa3.flash_attn_func(...)` in a training loop costs a
    # dict lookup, not an import_module call per step.
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
    elif name in ("reference", "variants", "schedule", "distributed", "checkpoint"):
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'dash_fa3' has no attribute {name!r}")
    globals()[name] = value
    return value
