"""Schedules for programs without Python: the C++ harness (benchmarks/cpp/bwd_bench.cu)
and the contract tests read the kernel metadata from a file instead of building
their own.

A *bundle* is flat schedule buffers (``ScheduleMeta.as_int32_array()``) back to
back, native-endian int32; each buffer's header gives its length
(:func:`.metadata.buffer_len`), so a single buffer written with
``as_int32_array().tofile(path)`` is a bundle of one.

A *shape line* names one backward call: ``batch heads heads_kv seqlen_q
seqlen_k headdim causal`` (integers; ``#`` starts a comment), the format
``bwd_bench shapes CMD`` prints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .contract import H_MAGIC, H_VERSION, HEADER_LEN, MAGIC, METADATA_VERSION
from .geometry import Geometry
from .metadata import ScheduleMeta, buffer_len


def write_bundle(path: str | os.PathLike, metas) -> int:
    """Write the flat buffers of ``metas`` back to back; returns the number of int32 entries."""
    flat = [m.as_int32_array() for m in metas]
    data = np.concatenate(flat) if flat else np.zeros(0, np.int32)
    data.astype(np.int32).tofile(path)
    return int(data.size)


def read_bundle(path: str | os.PathLike) -> list[ScheduleMeta]:
    """The schedules of a bundle, in file order."""
    data = np.fromfile(path, dtype=np.int32)
    out, pos = [], 0
    while pos < data.size:
        header = data[pos:pos + HEADER_LEN]
        if header.size < HEADER_LEN or int(header[H_MAGIC]) != MAGIC or int(header[H_VERSION]) != METADATA_VERSION:
            raise ValueError(f"{path}: no dash_fa3 schedule header at entry {pos}")
        n = buffer_len(header)
        if pos + n > data.size:
            raise ValueError(f"{path}: schedule at entry {pos} is truncated")
        out.append(ScheduleMeta.from_int32_array(data[pos:pos + n]))
        pos += n
    return out


def parse_shape_line(line: str) -> Geometry | None:
    """The Geometry of one shape line (backward tile sizes of its head dim); None for blank lines."""
    text = line.split("#", 1)[0].split()
    if not text:
        return None
    if len(text) != 7:
        raise ValueError(f"shape line needs 7 integers (batch heads heads_kv seqlen_q seqlen_k headdim causal), "
                         f"got {line.strip()!r}")
    try:
        b, h, hkv, sq, sk, d, causal = (int(x) for x in text)
    except ValueError:
        raise ValueError(f"shape line must hold integers, got {line.strip()!r}") from None
    if causal not in (0, 1):
        raise ValueError(f"causal must be 0 or 1, got {causal} in {line.strip()!r}")
    return Geometry.from_shape(batch=b, heads=h, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, headdim=d,
                               causal=bool(causal))


# The paper's grid (DESIGN.md: bf16, 16384 tokens, hidden 2048): the repository's
# one copy, package data read by the CLI, the benchmarks and the tests.
GRID_PATH = Path(__file__).with_name("bench_grid.json")
DEFAULT_GRID = json.loads(GRID_PATH.read_text())


def grid_geometries(grid: dict):
    """(label, Geometry) for every shape of a bench-grid dict."""
    for hd in grid["headdims"]:
        for sl in grid["seqlens"]:
            for mask in grid["masks"]:
                g = Geometry.from_shape(batch=grid["total_tokens"] // sl, heads=grid["hidden"] // hd,
                                        seqlen_q=sl, headdim=hd, causal=(mask == "causal"))
                yield f"hdim{hd} s{sl} {mask}", g
