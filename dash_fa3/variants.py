"""The one list of compiled kernel variants.

Every consumer reads this module: ``setup.py`` (which instantiation files to
compile and the generated C++ variant table), the C++ dispatch (through that
generated table), the tests (their parameters) and the benchmarks.

A variant is (head dim, dtype, mask kind), plus the value head dim where it
differs from the query/key one (``hdim192v128``: DeepSeek-style MLA, 192 for Q
and K, 128 for V, O and their gradients). ``DASH_FA3_VARIANTS`` narrows the
list at build time; at run time the extension reports what it was built with
(``built_variants()``), and that is the list the tests and benchmarks use.

Filter syntax: a comma-separated list of patterns; a pattern is a dash-separated
set of tokens, and a variant matches when every token equals one of its fields.
``hdim128-bf16`` selects every mask of hdim 128 bf16; ``hdim64,hdim128-causal``
selects every hdim-64 variant plus the causal hdim-128 ones. ``all`` (or an
unset variable) selects everything.

This module imports nothing but the standard library so ``setup.py`` can load it
before torch's extension machinery is involved.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterable

ENV_VAR = "DASH_FA3_VARIANTS"

HEADDIMS: tuple[int, ...] = (64, 96, 128, 192, 256)
# (head dim, value head dim) pairs with kernels: every head dim with V of its
# own width, and (192, 128), the MLA shape FA3 supports (its "hdimdiff").
HEADDIM_PAIRS: tuple[tuple[int, int], ...] = tuple((d, d) for d in HEADDIMS) + ((192, 128),)
DTYPES: tuple[str, ...] = ("bf16", "fp16")
# Mask kinds. full and causal are fixed windows; local is any other (left,
# right) window, FA3's window_size with causal folded in, taken at run time.
MASKS: tuple[str, ...] = ("full", "causal", "local")
MASK_WINDOWS: dict[str, tuple[int, int]] = {"full": (-1, -1), "causal": (-1, 0)}
# Head dims with a Hopper backward kernel: all of them.
BWD_HEADDIMS: tuple[int, ...] = HEADDIMS

# What a plain build compiles: the head dims of the benchmark grid. Wider
# builds name their head dims explicitly (``DASH_FA3_VARIANTS=all``).
DEFAULT_FILTER = "hdim64,hdim128"

# Tensor layouts every selected variant is compiled for, each its own kernel
# instantiation: dense (batch, seqlen, heads, d) tensors, and packed documents
# (FA3's varlen: (total, heads, d) with cu_seqlens; flash_attn_varlen_func).
# The dense kernels so carry no per-document code. ``DASH_FA3_LAYOUTS=dense``
# halves the build of a machine that never packs documents.
LAYOUTS: tuple[str, ...] = ("dense", "packed")
LAYOUT_ENV = "DASH_FA3_LAYOUTS"

# Softcapped scores (``softcap > 0``: the Gemma 2 family's logit cap) have their
# own instantiations of every selected variant and layout, built on request only
# (``DASH_FA3_SOFTCAP=1``): they double the build, and the plain kernels so carry
# no tanh. False stands for the plain kernels, True for the softcap ones.
SOFTCAP_AXIS: tuple[bool, ...] = (False, True)
SOFTCAP_ENV = "DASH_FA3_SOFTCAP"


@dataclasses.dataclass(frozen=True, order=True)
class Variant:
    hdim: int
    dtype: str
    mask: str
    # The value head dim (V, O, dO, dV); None: hdim's.
    hdim_v: int | None = None

    def __post_init__(self):
        if self.hdim_v is None:
            object.__setattr__(self, "hdim_v", self.hdim)

    @property
    def hdims(self) -> str:
        """The head-dim token: hdim128, or hdim192v128 where V is narrower."""
        return f"hdim{self.hdim}" + ("" if self.hdim_v == self.hdim else f"v{self.hdim_v}")

    @property
    def name(self) -> str:
        return f"{self.hdims}-{self.dtype}-{self.mask}"

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def local(self) -> bool:
        return self.mask == "local"

    @property
    def has_bwd(self) -> bool:
        return self.hdim in BWD_HEADDIMS

    def tokens(self) -> frozenset[str]:
        return frozenset((self.hdims, self.dtype, self.mask))

    @classmethod
    def parse(cls, name: str) -> "Variant":
        parts = name.split("-")
        match = re.fullmatch(r"hdim(\d+)(?:v(\d+))?", parts[0]) if len(parts) == 3 else None
        if match is None:
            raise ValueError(f"not a variant name: {name!r} (expected e.g. 'hdim128-bf16-causal' or "
                             f"'hdim192v128-bf16-causal')")
        hdim = int(match.group(1))
        return cls(hdim, parts[1], parts[2], int(match.group(2)) if match.group(2) else hdim)


def check_head_dims(hdim: int, hdim_v: int) -> None:
    """ValueError naming the supported pairs unless (hdim, hdim_v) has kernels (HEADDIM_PAIRS)."""
    if (hdim, hdim_v) not in HEADDIM_PAIRS:
        pairs = ", ".join(f"{d}" if d == dv else f"q/k {d} with v {dv}" for d, dv in HEADDIM_PAIRS)
        what = f"head dim {hdim}" if hdim == hdim_v else f"head dims q/k {hdim} with v {hdim_v}"
        raise ValueError(f"{what} is not supported; supported: {pairs}")


ALL_VARIANTS: tuple[Variant, ...] = tuple(
    Variant(h, d, m, hv) for h, hv in HEADDIM_PAIRS for d in DTYPES for m in MASKS
)

_KNOWN_TOKENS = frozenset().union(*(v.tokens() for v in ALL_VARIANTS))


def select(pattern: str | None = None) -> tuple[Variant, ...]:
    """Variants matching ``pattern`` (default: ``$DASH_FA3_VARIANTS`` or the default build).

    Raises ``ValueError`` for an unknown token or a pattern that selects nothing,
    so a typo never yields a silently empty build.
    """
    if pattern is None:
        pattern = os.environ.get(ENV_VAR) or DEFAULT_FILTER
    pattern = pattern.strip()
    if pattern == "all":
        return ALL_VARIANTS
    chosen: set[Variant] = set()
    for alt in filter(None, (p.strip() for p in pattern.split(","))):
        tokens = set(alt.split("-"))
        unknown = tokens - _KNOWN_TOKENS
        if unknown:
            raise ValueError(
                f"{ENV_VAR}: unknown token(s) {sorted(unknown)} in {alt!r}; "
                f"known: {sorted(_KNOWN_TOKENS)}"
            )
        chosen.update(v for v in ALL_VARIANTS if tokens <= v.tokens())
    if not chosen:
        raise ValueError(f"{ENV_VAR}={pattern!r} selects no variant")
    return tuple(sorted(chosen))


def select_layouts(value: str | None = None) -> tuple[str, ...]:
    """Layouts named by ``value`` (default: ``$DASH_FA3_LAYOUTS``, unset: all of LAYOUTS),
    comma-separated, in LAYOUTS order. Raises ``ValueError`` for an unknown name or none."""
    if value is None:
        value = os.environ.get(LAYOUT_ENV) or ",".join(LAYOUTS)
    names_ = {n.strip() for n in value.split(",") if n.strip()}
    unknown = names_ - set(LAYOUTS)
    if unknown or not names_:
        raise ValueError(f"{LAYOUT_ENV}={value!r}: name one or more of {', '.join(LAYOUTS)}")
    return tuple(layout for layout in LAYOUTS if layout in names_)


def select_softcap(value: str | None = None) -> tuple[bool, ...]:
    """The softcap axis of a build named by ``value`` (default: ``$DASH_FA3_SOFTCAP``):
    "0" or unset, the plain kernels only, (False,); "1", softcap kernels too, (False, True).
    Raises ``ValueError`` for anything else."""
    if value is None:
        value = os.environ.get(SOFTCAP_ENV, "")
    value = value.strip()
    if value in ("", "0"):
        return SOFTCAP_AXIS[:1]
    if value == "1":
        return SOFTCAP_AXIS
    raise ValueError(f"{SOFTCAP_ENV}={value!r}: 1 builds the softcap kernels too, 0 (or unset) does not")


def fold_causal(left: int, right: int, causal: bool) -> tuple[int, int]:
    """The window (left, right) with ``causal`` folded in: causal sets the right bound
    to 0 whatever it is, as FA3 does (its own tests pass causal=True with random windows)."""
    return (left, 0) if causal else (left, right)


def mask_of_window(left: int, right: int) -> str:
    """The mask kind (kernel family) that runs the window (left, right), -1 unbounded:
    full for (-1, -1), causal for (-1, 0), local otherwise. The C++ dispatch maps
    windows the same way (csrc/api/variant_registry.h, mask_kind_of), and the
    backward kernel refuses a schedule built for another kind."""
    if left < -1 or right < -1:
        raise ValueError(f"window (left, right) entries must be >= -1 (-1: unbounded), got ({left}, {right})")
    for mask, window in MASK_WINDOWS.items():
        if (left, right) == window:
            return mask
    return "local"


def names(variants: Iterable[Variant]) -> list[str]:
    return [v.name for v in variants]


DTYPE_CPP = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}
# C++ MaskKind enumerators (csrc/common/params.h).
MASK_CPP = {"full": "kFull", "causal": "kCausal", "local": "kLocal"}
