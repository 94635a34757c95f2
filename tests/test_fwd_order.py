"""The dense causal forward's order (dash_fa3/fwd_order.py's unit-cost model): on the bench grid,
single tiles longest first in power-of-two sections end within 2% of the mean load, where the
static pairs they replaced leave the last round's quantisation (3% and more); sections of an odd
size leave a partial section at the end."""

import pytest

from dash_fa3 import fwd_order

GRID_TOKENS, GRID_HIDDEN, SMS = 16384, 2048, 132


def bench_point(hdim, seqlen):
    """(batch * heads, query tiles per head) of a bench-grid point; hdim 64 runs 192-row tiles from
    4096 rows (three MMA warpgroups), every other point 128-row tiles."""
    block_m = 192 if hdim == 64 and seqlen >= 4096 else 128
    return (GRID_TOKENS // seqlen) * (GRID_HIDDEN // hdim), -(-seqlen // block_m)


@pytest.mark.parametrize("hdim", (64, 128))
@pytest.mark.parametrize("seqlen", (512, 1024, 2048, 4096, 8192, 16384))
def test_longest_first_balances_better_than_pairs(hdim, seqlen):
    pairs, n_m = bench_point(hdim, seqlen)
    longest = fwd_order.causal_balance(pairs, n_m, SMS, "longest")
    static = fwd_order.causal_balance(pairs, n_m, SMS, "pairs")
    assert longest < 1.02, longest
    assert static > 1.025, static
    assert longest < static


def test_a_partial_last_section_costs_balance():
    """hdim 128 causal 4k: 64 heads of 32 tiles. Nine heads per section (a round's tiles twice,
    any size) leave one head alone at the end; eight (a power of two) do not."""
    pairs, n_m = bench_point(128, 4096)
    assert fwd_order.causal_section_kv_heads(n_m, SMS) == 8
    nine = fwd_order.causal_balance(pairs, n_m, SMS, "longest", kv_heads_per_section=9)
    eight = fwd_order.causal_balance(pairs, n_m, SMS, "longest", kv_heads_per_section=8)
    assert nine > 1.05 and eight < 1.01, (nine, eight)


def test_bad_order_is_rejected():
    with pytest.raises(ValueError, match="order must be"):
        fwd_order.causal_balance(1, 4, 132, "snake")
