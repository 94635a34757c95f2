"""The forward's order of work, mirror of csrc/common/packed_order.h.

The forward kernel hands out units to its CTAs (csrc/kernels/fwd/fwd_tile_scheduler.h):
full and local masks a query tile each, in a static snake; dense causal masks
single query tiles longest first off a counter, in sections of
``causal_section_kv_heads`` KV heads (the hdim-64 two-warpgroup kernel: pairs
of query tiles in the static snake). For packed documents (a unit: a query
tile, or with a causal mask a pair), a unit costs about its document's key
length in blocks, so the order kernel sorts the documents by key blocks,
descending, before the launch, and the CTAs take each document's units (every
head) in that order off a counter as they finish. ``packed_order`` builds the
buffer the order kernel writes (with the documents of one bucket in index
order, one of the orders the kernel may pick); tests/test_contract_cpp.py
decodes it with the C++ helpers. ``causal_balance`` is the unit-cost model
behind the dense causal order's choices.
"""

from __future__ import annotations

import heapq

import numpy as np

BUCKETS = 4096  # kPackedOrderBuckets


def units_per_head(num_m_blocks: int, causal_pairs: bool) -> int:
    """Units of one (document, head): causal masks pair query tile n - 1 - j with tile j."""
    return (num_m_blocks + 1) // 2 if causal_pairs else num_m_blocks


def bucket(seqlen_k: int, block_n: int) -> int:
    """Sort bucket of a document with seqlen_k keys, 0 first (descending key blocks)."""
    blocks = -(-seqlen_k // block_n)
    return BUCKETS - 1 - min(blocks, BUCKETS - 1)


def packed_order(cu_q, cu_k, heads: int, block_m: int, block_n: int, causal_pairs: bool) -> np.ndarray:
    """The int32 buffer: [units, first unit of each position (batch + 1), document of each position,
    the tile counter (0)]."""
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    batch = len(cu_q) - 1
    docs = sorted(range(batch), key=lambda d: (bucket(int(cu_k[d + 1] - cu_k[d]), block_n), d))
    units = [units_per_head(-(-int(cu_q[d + 1] - cu_q[d]) // block_m), causal_pairs) * heads for d in docs]
    first = np.concatenate([[0], np.cumsum(units, dtype=np.int64)]).astype(np.int32)
    return np.concatenate([[first[-1]], first, docs, [0]]).astype(np.int32)


def causal_section_kv_heads(num_m_blocks: int, grid: int) -> int:
    """KV heads per section of the dense causal forward's longest-first queue: the smallest power of
    two whose tiles fill the grid's CTAs once (fwd_causal_section_kv_heads)."""
    kv_heads = 1
    while kv_heads * num_m_blocks < grid:
        kv_heads *= 2
    return kv_heads


def causal_balance(pairs: int, num_m_blocks: int, grid: int, order: str, tile_cost: float = 1.5,
                   kv_heads_per_section: int | None = None) -> float:
    """Unit-cost model of a dense causal forward (seqlen_q == seqlen_k, one KV head per head): the
    busiest CTA's load over the mean. Query tile m costs m + 1 key blocks plus ``tile_cost``.

    order="pairs": units (n_m - 1 - j, j), one KV head per section, the static snake of
    fwd_tile_scheduler.h. order="longest": single tiles, longest first within sections of
    ``kv_heads_per_section`` (default: causal_section_kv_heads), handed out greedily to the CTA
    that finishes first, as the counter does.
    """
    n = num_m_blocks
    cost = [m + 1 + tile_cost for m in range(n)]
    if order == "pairs":
        units = []
        for _ in range(pairs):
            for j in range((n + 1) // 2):
                hi = n - 1 - j
                units.append(cost[hi] + (cost[j] if j != hi else 0.0))
        loads = [0.0] * grid
        for u, c in enumerate(units):
            r, i = divmod(u, grid)
            loads[i if r % 2 == 0 else grid - 1 - i] += c
    elif order == "longest":
        sec = kv_heads_per_section or causal_section_kv_heads(n, grid)
        tiles = [cost[m] for first in range(0, pairs, sec) for m in range(n - 1, -1, -1)
                 for _ in range(min(sec, pairs - first))]
        heap = [(0.0, c) for c in range(grid)]
        for t in tiles:
            load, c = heapq.heappop(heap)
            heapq.heappush(heap, (load + t, c))
        loads = [load for load, _ in heap]
    else:
        raise ValueError(f"order must be 'pairs' or 'longest', got {order!r}")
    return max(loads) / (sum(loads) / grid)
