"""The packed forward's order of work, mirror of csrc/common/packed_order.h.

The forward kernel hands out units (a query tile, or with a causal mask a pair
of query tiles) to its CTAs in a static snake. For packed documents, a unit
costs about its document's key length in blocks, so the order kernel sorts the
documents by key blocks, descending, before the launch, and the CTAs take
each document's units (every head) in that order off a counter as they finish. ``packed_order``
builds the buffer the order kernel writes (with the documents of one bucket
in index order, one of the orders the kernel may pick);
tests/test_contract_cpp.py decodes it with the C++ helpers.
"""

from __future__ import annotations

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
