"""tools/sass_softmax.py's counting of exp2s between the S wait and the PV wait (CPU only)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import sass_softmax  # noqa: E402


def _fn(name: str, *body: str) -> str:
    return "\n".join([f"\t\tFunction : {name}", *(f"        /*0{i:03x}*/  {b} ;" for i, b in enumerate(body))])


def test_counts_each_span_per_forward_kernel_only():
    sass = "\n".join([
        _fn("_ZN8dash_fa33fwd10fwd_kernelIA",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX.FTZ R1, R2, R3, !PT", "MUFU.EX2 R4, R5",
            "MUFU.EX2 R6, R7", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R8, R9",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        _fn("_ZN8dash_fa33bwd10bwd_kernelIB",
            "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R4, R5", "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        # A span left open at the end of a kernel is not counted.
        _fn("_ZN8dash_fa33fwd10fwd_kernelIC", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R4, R5"),
    ])
    assert sass_softmax.exp2_between_waits(sass) == {"_ZN8dash_fa33fwd10fwd_kernelIA": [2, 0]}
