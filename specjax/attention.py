"""Paged attention over the KV cache (see :mod:`specjax.kv_cache` for the layout).

``paged_attention`` is the XLA path every platform can run; the dense
reference is for tests. Shape letters as in :mod:`specjax.kv_cache`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def gather_kv(cache: jax.Array, block_tables: jax.Array, block_size: int) -> jax.Array:
    """Gather each row's keys (or values) in position order: ``[B, M*block_size, G, E]``."""
    blocks = jnp.maximum(block_tables, 0)  # [B, M]; unused entries read block 0, masked later
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    slots = (blocks[:, :, None] * block_size + offsets).reshape(blocks.shape[0], -1)  # [B, S]
    return cache[slots]


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    *,
    block_size: int,
    scale: float,
    keys_per_chunk: int = 64,
) -> jax.Array:
    """Causal attention of ``q: [B, T, H, E]`` over each row's paged keys, pure jnp.

    Query token at position p sees exactly the key positions s <= p of its row.
    The current step's K/V must already be written. Works for any T >= 1:
    decode (T=1), chunked prefill and multi-token verification alike.

    Keys are visited in chunks of ``keys_per_chunk`` with an online softmax, in a
    loop whose trip count is the batch's longest context, not max_model_len: a
    short batch gathers a few blocks instead of every block-table column, with
    no extra compiled shapes. Returns ``[B, T, H, E]`` in q's dtype.
    """
    b, t, h, e = q.shape
    g = k_cache.shape[1]
    r = h // g
    blocks_per_chunk = max(1, min(keys_per_chunk // block_size, block_tables.shape[1]))
    num_chunks = -(-block_tables.shape[1] // blocks_per_chunk)
    tables = jnp.pad(
        block_tables, ((0, 0), (0, num_chunks * blocks_per_chunk - block_tables.shape[1])), constant_values=-1
    )  # [B, num_chunks * blocks_per_chunk]
    chunk_len = blocks_per_chunk * block_size
    qg = q.reshape(b, t, g, r, e)
    needed = jnp.max(positions) // chunk_len + 1  # chunks holding any visible key, for the whole batch

    def body(i, carry):
        m, l, acc = carry  # [B, G, R, T], [B, G, R, T], [B, G, R, T, E] (float32)
        chunk = jax.lax.dynamic_slice_in_dim(tables, i * blocks_per_chunk, blocks_per_chunk, axis=1)
        keys = gather_kv(k_cache, chunk, block_size)  # [B, S, G, E] with S = chunk_len
        values = gather_kv(v_cache, chunk, block_size)  # [B, S, G, E]
        scores = jnp.einsum("btgre,bsge->bgrts", qg, keys, preferred_element_type=jnp.float32) * scale
        key_pos = i * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [S]
        visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        # Rows with nothing visible yet keep m = -inf; use 0 there so exp() gives 0, not NaN.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])  # [B, G, R, T, S]
        correction = jnp.exp(m - m_safe)
        l = l * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bgrts,bsge->bgrte", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        acc = acc * correction[..., None] + pv
        return m_new, l, acc

    init = (
        jnp.full((b, g, r, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, g, r, t), jnp.float32),
        jnp.zeros((b, g, r, t, e), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, jnp.minimum(needed, num_chunks), body, init)
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]  # [B, G, R, T, E]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e).astype(q.dtype)


def dense_causal_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Dense reference for tests: ``q [B,T,H,E]`` over contiguous ``k, v [B,S,G,E]``, mask s <= position."""
    b, t, h, e = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, h // g, e).astype(jnp.float32)
    scores = jnp.einsum("btgre,bsge->bgrts", qg, k.astype(jnp.float32)) / math.sqrt(e)
    visible = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    out = jnp.einsum("bgrts,bsge->btgre", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
    return out.reshape(b, t, h, e)
