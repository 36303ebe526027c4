"""specjax.attention: paged_attention vs the dense reference; specjax.kv_cache: write_kv's -1 slots."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.attention import dense_causal_attention_reference, paged_attention  # noqa: E402
from specjax.kv_cache import write_kv  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_BLOCKS = 6  # 24 key positions per row
E = 8

_paged = jax.jit(paged_attention, static_argnames=("block_size", "scale"))
_dense = jax.jit(dense_causal_attention_reference)


def _scatter_rows(rng, lengths, g, k_dense=None, v_dense=None):
    """Contiguous K/V per row (random unless given), scattered into a paged cache via shuffled block tables.

    Returns (k_cache, v_cache, block_tables [B, M], k_dense, v_dense [B, S, G, E]).
    """
    b = len(lengths)
    s = MAX_BLOCKS * BLOCK_SIZE
    if k_dense is None:
        k_dense = rng.standard_normal((b, s, g, E)).astype(np.float32)
        v_dense = rng.standard_normal((b, s, g, E)).astype(np.float32)
    perm = rng.permutation(NUM_BLOCKS)
    tables = np.full((b, MAX_BLOCKS), -1, np.int32)  # -1: unused table entries
    slots = np.full((b, s), -1, np.int32)  # -1: positions beyond the row's length are never written
    used = 0
    for i, n in enumerate(lengths):
        nb = -(-n // BLOCK_SIZE)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(n)
        slots[i, :n] = tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    # Large garbage in the cache: unwritten / foreign slots must never be attended to.
    k_cache = jnp.asarray(rng.standard_normal((NUM_BLOCKS * BLOCK_SIZE, g, E)).astype(np.float32) * 100)
    v_cache = jnp.asarray(rng.standard_normal((NUM_BLOCKS * BLOCK_SIZE, g, E)).astype(np.float32) * 100)
    k_cache, v_cache = write_kv(k_cache, v_cache, jnp.asarray(k_dense), jnp.asarray(v_dense), jnp.asarray(slots))
    return k_cache, v_cache, jnp.asarray(tables), k_dense, v_dense


# (T, G, R): decode / verification / prefill-chunk widths crossed with MHA, GQA and MQA ratios.
@pytest.mark.parametrize("t, g, r", [(1, 2, 2), (1, 1, 4), (3, 2, 1), (3, 2, 3), (8, 1, 1), (8, 2, 4)])
def test_paged_attention_matches_dense_reference(t, g, r):
    rng = np.random.default_rng(100 * t + 10 * g + r)
    lengths = [9, 24, t, 14]  # ragged; every row holds at least its t query tokens
    k_cache, v_cache, tables, k_dense, v_dense = _scatter_rows(rng, lengths, g)
    h = g * r
    q = jnp.asarray(rng.standard_normal((len(lengths), t, h, E)).astype(np.float32))
    # The t queries are the last t tokens of each row (prefill chunk / verification / decode).
    positions = jnp.asarray([np.arange(n - t, n) for n in lengths], jnp.int32)  # [B, T]
    out = _paged(q, k_cache, v_cache, positions, tables, block_size=BLOCK_SIZE, scale=E**-0.5)
    ref = _dense(q, jnp.asarray(k_dense), jnp.asarray(v_dense), positions)
    assert out.shape == (len(lengths), t, h, E) and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_paged_attention_independent_of_physical_placement():
    """Same logical sequences under two different shuffles of physical blocks -> same outputs."""
    lengths, g, h, t = [7, 13], 2, 4, 3
    data_rng = np.random.default_rng(42)
    k_dense = data_rng.standard_normal((2, MAX_BLOCKS * BLOCK_SIZE, g, E)).astype(np.float32)
    v_dense = data_rng.standard_normal((2, MAX_BLOCKS * BLOCK_SIZE, g, E)).astype(np.float32)
    q = jnp.asarray(data_rng.standard_normal((2, t, h, E)).astype(np.float32))
    positions = jnp.asarray([np.arange(n - t, n) for n in lengths], jnp.int32)
    results, tables = [], []
    for seed in (0, 1):
        kc, vc, tb, _, _ = _scatter_rows(np.random.default_rng(seed), lengths, g, k_dense, v_dense)
        tables.append(np.asarray(tb))
        results.append(np.asarray(_paged(q, kc, vc, positions, tb, block_size=BLOCK_SIZE, scale=E**-0.5)))
    assert not np.array_equal(tables[0], tables[1])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-6)


def test_write_kv_minus_one_slots_write_nothing():
    num_slots, g = 12, 2
    rng = np.random.default_rng(0)
    k_cache = jnp.asarray(rng.standard_normal((num_slots, g, E)).astype(np.float32))
    v_cache = jnp.asarray(rng.standard_normal((num_slots, g, E)).astype(np.float32))
    k_new = jnp.asarray(rng.standard_normal((2, 3, g, E)).astype(np.float32))
    v_new = jnp.asarray(rng.standard_normal((2, 3, g, E)).astype(np.float32))
    slots = jnp.asarray([[5, -1, 0], [-1, -1, 7]], jnp.int32)
    k2, v2 = write_kv(k_cache, v_cache, k_new, v_new, slots)
    expect_k, expect_v = np.array(k_cache), np.array(v_cache)
    for (b, t), s in np.ndenumerate(np.asarray(slots)):
        if s >= 0:
            expect_k[s], expect_v[s] = k_new[b, t], v_new[b, t]
    np.testing.assert_array_equal(np.asarray(k2), expect_k)
    np.testing.assert_array_equal(np.asarray(v2), expect_v)
    # In particular the last slot (where a wrapped -1 would land) is untouched.
    np.testing.assert_array_equal(np.asarray(k2[-1]), np.asarray(k_cache[-1]))
    np.testing.assert_array_equal(np.asarray(v2[-1]), np.asarray(v_cache[-1]))


def test_write_kv_all_padding_is_identity_under_jit_with_donation():
    num_slots, g = 8, 1
    k_cache = jnp.arange(num_slots * g * E, dtype=jnp.float32).reshape(num_slots, g, E)
    v_cache = -k_cache
    expect_k, expect_v = np.asarray(k_cache).copy(), np.asarray(v_cache).copy()
    new = jnp.ones((1, 4, g, E), jnp.float32)
    fn = jax.jit(write_kv, donate_argnums=(0, 1))
    k2, v2 = fn(k_cache, v_cache, new, new, jnp.full((1, 4), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(k2), expect_k)
    np.testing.assert_array_equal(np.asarray(v2), expect_v)


def test_paged_attention_bfloat16_cache():
    rng = np.random.default_rng(5)
    lengths, g, r, t = [10, 6], 2, 2, 3
    k_cache, v_cache, tables, k_dense, v_dense = _scatter_rows(rng, lengths, g)
    q = jnp.asarray(rng.standard_normal((2, t, g * r, E)).astype(np.float32))
    positions = jnp.asarray([np.arange(n - t, n) for n in lengths], jnp.int32)
    out = _paged(
        q.astype(jnp.bfloat16), k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16), positions, tables,
        block_size=BLOCK_SIZE, scale=E**-0.5,
    )
    ref = _dense(q, jnp.asarray(k_dense), jnp.asarray(v_dense), positions)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=0.1)
