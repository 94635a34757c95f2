"""Tile geometry: pair sets, masks, ragged tiles, block sizes."""

import numpy as np
import pytest

from dash_fa3.schedule import Geometry, bwd_block_sizes
from dash_fa3.schedule.geometry import TileGeometry


def brute_pairs(g: Geometry):
    """(kv, q) pairs from the element-level mask."""
    i = np.arange(g.seqlen_q)[:, None]
    j = np.arange(g.seqlen_k)[None, :]
    off = g.seqlen_k - g.seqlen_q
    allowed = np.ones((g.seqlen_q, g.seqlen_k), bool)
    if g.window_right >= 0:
        allowed &= j <= i + off + g.window_right
    if g.window_left >= 0:
        allowed &= j >= i + off - g.window_left
    out = set()
    counts = {}
    for kv in range(g.n_kv):
        for q in range(g.n_q):
            blk = allowed[q * g.block_m:(q + 1) * g.block_m, kv * g.block_n:(kv + 1) * g.block_n]
            if blk.any():
                out.add((kv, q))
            counts[(kv, q)] = int(blk.sum())
    return out, counts


SHAPES = [
    (1, 1, 1, 128, 128, 64, 64, "full"),
    (1, 1, 1, 128, 128, 64, 64, "causal"),
    (1, 1, 1, 100, 300, 32, 64, "causal"),   # seqlen_k > seqlen_q, ragged
    (1, 1, 1, 300, 100, 64, 32, "causal"),   # seqlen_q > seqlen_k: early rows attend nothing
    (1, 1, 1, 1, 1, 64, 64, "causal"),
    (1, 1, 1, 257, 129, 64, 128, "causal"),
    (1, 1, 1, 257, 129, 64, 128, "full"),
    (1, 1, 1, 64, 512, 64, 128, "causal"),
    (1, 1, 1, 512, 64, 64, 128, "causal"),
    (1, 1, 1, 200, 200, 128, 32, "causal"),
    # sliding windows
    (1, 1, 1, 300, 300, 64, 32, "local", 0, 0),
    (1, 1, 1, 300, 300, 32, 64, "local", 40, -1),
    (1, 1, 1, 300, 300, 32, 64, "local", -1, 40),
    (1, 1, 1, 300, 500, 64, 64, "local", 70, 0),     # causal + left; the first keys seen by no row
    (1, 1, 1, 500, 300, 64, 64, "local", 30, 10),    # the first rows see no key
    (1, 1, 1, 257, 129, 64, 128, "local", 1000, 1000),
    (1, 1, 1, 257, 129, 64, 128, "local", -1, -1),
    (1, 1, 1, 1000, 1000, 64, 128, "local", 127, 0),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_pairs_match_element_mask(shape):
    g = Geometry(*shape)
    want, counts = brute_pairs(g)
    assert g.needed_pairs() == want
    kv, q = g.pairs()
    assert len(kv) == g.pairs_per_head == len(want)
    # the Q ranges of KV tiles and the KV ranges of Q tiles are consistent descriptions of the same set
    for (k, qq) in [(k, qq) for k in range(g.n_kv) for qq in range(g.n_q)]:
        assert ((k, qq) in want) == (g.q_begin[k] <= qq < g.q_end[k]) == (g.kv_begin[qq] <= k < g.kv_end[qq])
        assert g.kv_end_of(qq) == int(g.kv_end[qq])
    # element counts (cost model) match the brute-force mask
    ka = np.array([k for k, _ in counts]); qa = np.array([qq for _, qq in counts])
    assert np.array_equal(g.valid_elements(ka, qa), np.array(list(counts.values())))


def test_window_geometry_edges():
    # causal + left window with seqlen_k > seqlen_q: the first keys are seen by no row -> tasks without steps
    g = Geometry(1, 1, 1, 300, 500, 64, 64, "local", 70, 0)
    assert g.task_len[0] == 0 and g.task_len[1] == 0 and np.all(g.task_len[3:] > 0)
    assert g.num_tasks == g.n_kv and list(g.active_kv) == list(range(2, g.n_kv))
    # the first rows see no key: empty Q tiles
    g = Geometry(1, 1, 1, 500, 300, 64, 64, "local", 30, 10)
    assert g.kv_end[0] <= g.kv_begin[0] and g.kv_end[1] <= g.kv_begin[1] and g.kv_end[2] > g.kv_begin[2]
    # fixed windows of full / causal
    assert Geometry(1, 1, 1, 64, 64, 64, 64, "causal").window == (-1, 0)
    assert Geometry(1, 1, 1, 64, 64, 64, 64).window == (-1, -1)
    with pytest.raises(ValueError):
        Geometry(1, 1, 1, 64, 64, 64, 64, "causal", 5, 0)
    with pytest.raises(ValueError):
        Geometry(1, 1, 1, 64, 64, 64, 64, "local", -2, 0)
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=256, headdim=128, window_size=(32, 0))
    assert (g.mask, g.window) == ("local", (32, 0))
    assert Geometry.from_shape(batch=1, heads=2, seqlen_q=256, headdim=128, causal=True).mask == "causal"
    assert Geometry.from_shape(batch=1, heads=2, seqlen_q=256, headdim=128, window_size=(-1, 0)).mask == "causal"
    # causal sets the right bound to 0 whatever window_size[1] says, as FA3 (and the API) do.
    g = Geometry.from_shape(batch=1, heads=2, seqlen_q=256, headdim=128, window_size=(32, 7), causal=True)
    assert (g.mask, g.window) == ("local", (32, 0))
    assert Geometry.from_shape(batch=1, heads=2, seqlen_q=256, headdim=128, window_size=(-1, 9),
                               causal=True).mask == "causal"


def test_seqlen_q_longer_than_k_has_empty_q_tiles():
    g = Geometry(1, 1, 1, 512, 128, 64, 64, "causal")
    # rows 0..383 attend nothing: Q tiles 0..5 get no pair
    assert list(g.kv_end[:6]) == [0] * 6
    assert all(g.q_begin >= 6)
    # every KV tile still has work (the last query row sees every key)
    assert np.all(g.task_len > 0)


def element_mask(t: TileGeometry) -> np.ndarray:
    i = np.arange(t.seqlen_q)[:, None]
    j = np.arange(t.seqlen_k)[None, :]
    off = t.seqlen_k - t.seqlen_q
    keep = np.ones((t.seqlen_q, t.seqlen_k), bool)
    if t.window_right >= 0:
        keep &= j <= i + off + t.window_right
    if t.window_left >= 0:
        keep &= j >= i + off - t.window_left
    return keep


def random_window(rng, sq, sk):
    kind = int(rng.integers(4))
    if kind < 2:
        return -1, (-1, 0)[kind]
    side = lambda: int(rng.choice([-1, 0, int(rng.integers(0, 40)), int(rng.integers(0, 2 * max(sq, sk) + 2))]))
    return side(), side()


def test_tile_geometry_matches_element_mask():
    """Block ranges, mask tests and unmasked ranges against the element mask,
    scalar and vectorized, on random shapes and windows (seqlen_q > seqlen_k, ragged tiles)."""
    rng = np.random.default_rng(1)
    for _ in range(250):
        sq, sk = (int(x) for x in rng.integers(1, 400, size=2))
        bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
        t = TileGeometry(sq, sk, bm, bn, *random_window(rng, sq, sk))
        allowed = element_mask(t)
        assert np.array_equal(allowed, t.visible(np.arange(sq)[:, None], np.arange(sk)[None, :]))
        qs, kvs = np.arange(t.n_q), np.arange(t.n_kv)
        kv_b, kv_e = t.kv_range(qs)
        q_b, q_e = t.q_range(kvs)
        u_b, u_e = t.kv_unmasked(qs)
        qu_b, qu_e = t.q_unmasked(kvs)
        for q in range(t.n_q):
            for kv in range(t.n_kv):
                blk = allowed[q * bm:(q + 1) * bm, kv * bn:(kv + 1) * bn]
                full_tile = (kv + 1) * bn <= sk and blk.all()
                met = bool(blk.any())
                assert (kv_b[q] <= kv < kv_e[q]) == (q_b[kv] <= q < q_e[kv]) == met, (t, q, kv)
                assert t.needs_mask(q, kv) == (not full_tile) == (not (u_b[q] <= kv < u_e[q])) \
                    == (not (qu_b[kv] <= q < qu_e[kv])), (t, q, kv)
            assert t.kv_range(q) == (int(kv_b[q]), int(kv_e[q]))
            assert t.kv_unmasked(q) == (int(u_b[q]), int(u_e[q]))
        for kv in range(t.n_kv):
            assert t.q_range(kv) == (int(q_b[kv]), int(q_e[kv]))
            assert t.q_unmasked(kv) == (int(qu_b[kv]), int(qu_e[kv]))
        assert np.array_equal(t.needs_mask(qs[:, None], kvs[None, :]),
                              [[t.needs_mask(q, kv) for kv in kvs] for q in qs])


def test_tile_geometry_refuses_a_causal_flag():
    with pytest.raises(ValueError):
        TileGeometry(64, 64, 64, 64, True)
    assert TileGeometry.of_mask(64, 64, 64, 64, True) == TileGeometry(64, 64, 64, 64, -1, 0)


def test_block_sizes_and_from_shape():
    assert bwd_block_sizes(64) == (128, 128)
    assert bwd_block_sizes(128) == (64, 128)
    assert bwd_block_sizes(96) == (64, 128)
    assert bwd_block_sizes(100) == bwd_block_sizes(128)
    with pytest.raises(ValueError):
        bwd_block_sizes(512)
    g = Geometry.from_shape(batch=2, heads=16, seqlen_q=8192, headdim=128, causal=True)
    assert (g.block_m, g.block_n, g.n_q, g.n_kv, g.mask) == (64, 128, 128, 64, "causal")
    g = Geometry.from_shape(batch=1, heads=8, seqlen_q=1000, headdim=64, block_m=64)
    assert (g.block_m, g.block_n, g.n_q, g.n_kv) == (64, 128, 16, 8)


def test_geometry_checks_and_hash():
    with pytest.raises(ValueError):
        Geometry(1, 6, 4, 128, 128, 64, 64)
    with pytest.raises(ValueError):
        Geometry(1, 4, 4, 0, 128, 64, 64)
    with pytest.raises(ValueError):
        Geometry(1, 4, 4, 128, 128, 64, 64, "sliding")
    a = Geometry(1, 4, None, 128, 128, 64, 64)
    b = Geometry(1, 4, 4, 128, 128, 64, 64)
    assert a == b and hash(a) == hash(b) and a.heads_kv == 4 and a.group == 1
    assert Geometry(2, 8, 2, 128, 128, 64, 64).group == 4


def test_unbounded_side_as_a_bound_that_hides_nothing():
    """The local kernels replace an unbounded side (-1) by seqlen_k (left) or seqlen_q
    (right) (fwd_launch.cuh / bwd_launch.cuh): the same block ranges and unmasked
    ranges, so their decode of a schedule built with -1 agrees."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        sq, sk = (int(x) for x in rng.integers(1, 600, size=2))
        bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
        left, right = random_window(rng, sq, sk)
        t = TileGeometry(sq, sk, bm, bn, left, right)
        u = TileGeometry(sq, sk, bm, bn, sk if left < 0 else left, sq if right < 0 else right)
        qs, kvs = np.arange(t.n_q), np.arange(t.n_kv)
        for f, x in (("kv_range", qs), ("kv_unmasked", qs), ("q_range", kvs), ("q_unmasked", kvs)):
            for a, b in zip(getattr(t, f)(x), getattr(u, f)(x)):
                assert np.array_equal(a, b), (t, f)
        assert np.array_equal(t.visible(np.arange(sq)[:, None], np.arange(sk)[None, :]),
                              u.visible(np.arange(sq)[:, None], np.arange(sk)[None, :]))
