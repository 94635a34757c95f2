"""dash_fa3: FlashAttention-3-class attention for Hopper with a fast deterministic backward."""

from . import reference, variants
from .interface import flash_attn_func
from .ops import ReferenceBackwardWarning

__all__ = ["flash_attn_func", "reference", "variants", "ReferenceBackwardWarning"]
__version__ = "0.1.0"
