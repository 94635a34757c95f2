"""The ptxas report's parser: what makes a kernel fail the CI gate (CPU only)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import ptxas_report  # noqa: E402

ENTRY = "ptxas info    : Compiling entry function '{k}' for 'sm_90a'"
PROPS = "ptxas info    : Function properties for {k}\n    {stack} bytes stack frame, {st} bytes spill stores, {ld} bytes spill loads"
USED = "ptxas info    : Used 168 registers, used 16 barriers"


def _log(*parts: str) -> str:
    return "\n".join(parts)


def _kernel(k: str, *notes: str, stack: int = 0, st: int = 0, ld: int = 0) -> str:
    """ptxas -v output for kernel k: entry line, notes, properties, register line."""
    return _log(ENTRY.format(k=k), *notes, PROPS.format(k=k, stack=stack, st=st, ld=ld), USED)


def test_clean_kernel_row():
    rows = ptxas_report.parse(_kernel("_Za"))
    assert rows == [{"kernel": "_Za", "arch": "sm_90a", "stack": 0, "spill_st": 0, "spill_ld": 0, "regs": 168, "smem": 0}]


def test_warnings_are_folded_into_their_kernel():
    # The -v property line said 0 bytes while the warnings named a stack frame
    # and spills (seen with a kernel whose register array went to local memory).
    log = _log(
        _kernel("_Za"),
        _kernel("_Zb"),
        "ptxas warning : Local memory used for function '_Zb', size of stack frame: 896 bytes",
        "ptxas warning : Registers are spilled to local memory in function '_Zb', 40 bytes spill stores, 24 bytes spill loads",
    )
    a, b = ptxas_report.parse(log)
    assert (a["stack"], a["spill_st"], a["spill_ld"]) == (0, 0, 0)
    assert (b["stack"], b["spill_st"], b["spill_ld"]) == (896, 40, 24)


def test_serialized_wgmma_is_flagged():
    log = _log(
        _kernel("_Za", "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are "
                "serialized due to insufficient register resources for the wgmma pipeline in the function '_Za'"),
        _kernel("_Zb"),
    )
    a, b = ptxas_report.parse(log)
    assert a["wgmma_serialized"].startswith("C7511: insufficient register resources")
    assert "wgmma_serialized" not in b


def test_serialized_wgmma_for_the_function_and_injected_wait_are_flagged():
    # Wordings of a CUDA 13.0 build whose forward kernel ran 30% slower.
    log = _log(
        _kernel("_Za", "ptxas info    : (C7517) warpgroup.wait is injected in around line 1790 by compiler to "
                "allow use of registers defined by GMMA in function '_Za'"),
        _kernel("_Zb", "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
                "serialized due to insufficient register resources for the function '_Zb'"),
        _kernel("_Zc"),
    )
    a, b, c = ptxas_report.parse(log)
    assert a["wgmma_serialized"] == "C7517: wait injected near PTX line 1790"
    assert b["wgmma_serialized"] == "C7512: insufficient register resources"
    assert "wgmma_serialized" not in c
