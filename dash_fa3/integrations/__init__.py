"""Adapters that put dash_fa3 behind the attention switch of a training framework.

Each adapter lives in its own module and imports its framework only when that
module is imported, so ``import dash_fa3`` never pulls a framework in:

- ``dash_fa3.integrations.transformers``: Hugging Face transformers 5.x;
  importing it registers ``attn_implementation="dash_fa3"``.

Adapters translate layouts and arguments into ``dash_fa3.flash_attn_func``,
pass ``deterministic`` and ``schedule`` through, and raise a clear error for
what they cannot express (a mask, dropout, a window); they never fall back to
another attention.
"""
