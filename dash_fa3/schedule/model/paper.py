"""The paper's closed forms (DASH, arXiv 2601.21824) for n KV tiles = n SMs, m heads.

Returns None where the paper gives no formula.  The causal fa3 and descending
forms are approximations in the paper ("about"); see docs/design/schedule.md for the
exact values of our model and the bounds the tests check.
"""

from __future__ import annotations


def paper_makespan(mask: str, schedule: str, n: int, m: int, c: float, r: float) -> float | None:
    if mask == "full":
        if schedule == "fa3":
            return m * n * (c + r) + (n - 1) * r
        if schedule in ("shift", "symmetric_shift"):
            return m * n * (c + r)
        return None
    if mask == "causal":
        if schedule == "fa3":
            return m * (n * (c + r) + (n - 1) * r)
        if schedule == "descending":
            return m * (n + 1) * (c + r) / 2 + (n - 1) * r
        if schedule == "symmetric_shift":
            return m * (n + 1) * (c + r) / 2
        return None
    raise ValueError(f"unknown mask {mask!r}")
