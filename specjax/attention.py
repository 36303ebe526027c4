"""Paged attention over the KV cache (see :mod:`specjax.kv_cache` for the layout).

:func:`paged_attention` dispatches on :func:`specjax.backends.attention_backend`:

* ``xla`` -- :func:`paged_attention_xla`, pure jnp, every platform, any row width.
* ``paged_cpu`` -- a model on one CPU device in the derived CPU weight layout (and a
  draft head beside it), every row kind: the C++ kernel
  ``models/cpu_kernels/paged_attention.cc`` (an XLA FFI custom call) reads each row's keys
  and values once, in place through the block table, for all its query tokens
  (SmolLM2-135M, context 256, 30 layers: 1.3 ms for 1 query token, 2.3 ms for 5; the XLA
  path 4.9 / 6.6 ms; benchmarks/README.md, "Verify cost on CPU").
* ``paged_decode_gpu`` -- one-token rows on GPU: the kernel body of JAX's Pallas
  GPU paged attention (``jax.experimental.pallas.ops.gpu.paged_attention``) in a
  ``pallas_call`` of our own whose BlockSpecs read this cache layout in place
  (``[num_slots, G, E]`` viewed as ``[num_blocks, block_size, G, E]``, one kv head
  per program): no cache copy.
* ``ragged_paged_tpu`` -- TPU, every row kind: JAX's ragged paged attention
  (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``). It wants K and V
  interleaved in one ``[num_blocks, block_size, 2G, E']`` array with E' a multiple
  of 128; :func:`ragged_paged_attention_tpu` builds that from the separate k/v
  caches on every call (a copy of the layer's cache: correct, not free; storing
  the cache in that layout removes it).

The dense reference is for tests. Shape letters as in :mod:`specjax.kv_cache`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.cpu_kernels import paged_attention as cpu_attention
from specjax import backends


def gather_kv(cache: jax.Array, block_tables: jax.Array, block_size: int) -> jax.Array:
    """Gather each row's keys (or values) in position order: ``[B, M*block_size, G, E]``."""
    blocks = jnp.maximum(block_tables, 0)  # [B, M]; unused entries read block 0, masked later
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    slots = (blocks[:, :, None] * block_size + offsets).reshape(blocks.shape[0], -1)  # [B, S]
    return cache[slots]


def paged_attention(
    q: jax.Array,  # [B, T, H, E]
    k_cache: jax.Array,  # [num_slots, G, E]
    v_cache: jax.Array,  # [num_slots, G, E]
    positions: jax.Array,  # int32 [B, T]
    block_tables: jax.Array,  # int32 [B, M]
    *,
    block_size: int,
    scale: float,
    backend: str | None = None,
    cpu_layout: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Causal paged attention, ``[B, T, H, E]``: query at position p sees its row's keys s <= p.

    ``backend``: None picks :func:`specjax.backends.attention_backend` for this T and
    ``cpu_layout`` (the caller's weights are in ``models.cpu_layout``: one CPU device); or
    "xla" / "paged_decode_gpu" / "ragged_paged_tpu" / "paged_cpu". A Pallas backend that does
    not fit these shapes (see :func:`pallas_backend_fits`) falls back to the XLA path.
    ``interpret`` runs a Pallas backend in interpret mode (tests on CPU).
    """
    b, t, h, e = q.shape
    if backend is None:
        backend = backends.attention_backend(t, cpu_layout)
    if backend not in (backends.XLA, backends.PAGED_DECODE_GPU, backends.RAGGED_TPU, backends.PAGED_CPU):
        raise ValueError("backend must be one of xla / paged_decode_gpu / ragged_paged_tpu / paged_cpu, got "
                         f"{backend!r}")
    if backend == backends.PAGED_CPU:
        return cpu_attention.paged_attention(q, k_cache, v_cache, positions, block_tables, block_size=block_size,
                                             scale=scale)
    if backend != backends.XLA and not pallas_backend_fits(backend, q.shape, k_cache.shape, k_cache.dtype):
        backend = backends.XLA
    if backend == backends.PAGED_DECODE_GPU:
        return paged_decode_attention_gpu(q, k_cache, v_cache, positions, block_tables, block_size=block_size,
                                          scale=scale, interpret=interpret)
    if backend == backends.RAGGED_TPU:
        ragged = functools.partial(ragged_paged_attention_tpu, block_size=block_size, scale=scale,
                                   interpret=interpret)
        xla = functools.partial(paged_attention_xla, block_size=block_size, scale=scale)
        # The ragged kernel gets one query run per row (see there); other layouts take the XLA path.
        return jax.lax.cond(rows_are_single_runs(positions), ragged, xla,
                            q, k_cache, v_cache, positions, block_tables)
    return paged_attention_xla(q, k_cache, v_cache, positions, block_tables, block_size=block_size, scale=scale)


def pallas_backend_fits(backend: str, q_shape, cache_shape, cache_dtype) -> bool:
    """Static shape conditions of the JAX Pallas ops (otherwise the XLA path runs)."""
    _, t, h, e = q_shape
    g = cache_shape[1]
    if backend == backends.PAGED_DECODE_GPU:
        # A decode op; Triton blocks need power-of-two head dims.
        return t == 1 and e >= 16 and e & (e - 1) == 0
    if backend == backends.RAGGED_TPU:
        # K/V heads interleaved (2G) must tile the kernel's sublanes (see its get_min_heads_per_blk).
        packing = 4 // jnp.dtype(cache_dtype).itemsize
        combined = 2 * g
        return combined % packing == 0 and (combined // packing in (1, 2, 4, 8) or (combined // packing) % 8 == 0)
    return False


def paged_attention_xla(
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


# --------------------------------------------------------------------------- GPU: Pallas paged decode


def paged_decode_attention_gpu(
    q: jax.Array,  # [B, 1, H, E]
    k_cache: jax.Array,  # [num_slots, G, E]
    v_cache: jax.Array,  # [num_slots, G, E]
    positions: jax.Array,  # int32 [B, 1]
    block_tables: jax.Array,  # int32 [B, M]
    *,
    block_size: int,
    scale: float,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """One-token rows with JAX's Pallas GPU paged-attention kernel body, reading this cache in place.

    Grid per row: (kv head, query-head block of 16, key split); each program streams
    ``pages_per_compute_block`` blocks at a time with an online softmax, and the key splits
    are merged here (flash-decoding). The kernel does not scale q.k, so q is pre-scaled.
    """
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu.paged_attention import DEFAULT_MASK_VALUE, paged_attention_kernel

    b, t, h, e = q.shape
    if t != 1:
        raise ValueError(f"paged_decode_attention_gpu takes one query token per row, got T={t}")
    num_slots, g, _ = k_cache.shape
    r = h // g
    num_blocks = num_slots // block_size
    block_h = 16  # the kernel's query-row block (Triton dot needs >= 16 rows)
    rp = -(-r // block_h) * block_h
    ppcb = pages_per_compute_block or max(1, 64 // block_size)  # ~64 keys per step
    m = block_tables.shape[1]
    if k_splits is None:
        k_splits = max(1, min(16, -(-m // ppcb)))
    pages_per_split = -(-m // (k_splits * ppcb)) * ppcb
    tables = jnp.pad(jnp.maximum(block_tables, 0), ((0, 0), (0, pages_per_split * k_splits - m)))
    tables = tables.reshape(b, k_splits, pages_per_split)  # unused entries read block 0, masked by length
    lengths = (positions[:, 0] + 1).astype(jnp.int32)  # [B]: keys s < length are visible
    qs = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype).reshape(b, g, r, e)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, rp - r), (0, 0)))  # [B, G, Rp, E]
    pages = lambda c: c.reshape(num_blocks, block_size, g, e)  # noqa: E731  free view
    kernel = functools.partial(paged_attention_kernel, num_heads=r, pages_per_compute_block=ppcb,
                               mask_value=DEFAULT_MASK_VALUE, attn_logits_soft_cap=None)
    # kv head g of the [num_blocks, block_size, G, E] view: the G dim squeezed at index g.
    kv_spec = pl.BlockSpec((num_blocks, block_size, None, e), lambda hg, i, s: (0, 0, hg, 0))

    def one_row(q_row, table, length):  # [G, Rp, E], [k_splits, pages_per_split], [1]
        return pl.pallas_call(
            kernel,
            grid=(g, rp // block_h, k_splits),
            in_specs=[
                pl.BlockSpec((None, block_h, e), lambda hg, i, s: (hg, i, 0)),
                kv_spec, None, kv_spec, None,
                pl.BlockSpec((None, pages_per_split), lambda hg, i, s: (s, 0)),
                pl.BlockSpec((1,), lambda hg, i, s: (0,)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, block_h, e), lambda hg, i, s: (s, hg, i, 0)),
                pl.BlockSpec((None, None, block_h), lambda hg, i, s: (s, hg, i)),
                pl.BlockSpec((None, None, block_h), lambda hg, i, s: (s, hg, i)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((k_splits, g, rp, e), jnp.float32),
                jax.ShapeDtypeStruct((k_splits, g, rp), jnp.float32),
                jax.ShapeDtypeStruct((k_splits, g, rp), jnp.float32),
            ],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="specjax_paged_decode_attention",
        )(q_row, pages(k_cache), None, pages(v_cache), None, table, length)

    o, l, mx = jax.vmap(one_row)(qs, tables, lengths[:, None])  # [B, S, G, Rp, E], [B, S, G, Rp] x2
    # Merge the key splits (a split that saw no key has l = 0 and m = the float32 minimum).
    m_all = jnp.max(mx, axis=1, keepdims=True)
    corr = jnp.exp(mx - m_all)  # [B, S, G, Rp]
    denom = jnp.sum(l * corr, axis=1)  # [B, G, Rp]
    out = jnp.sum(o * corr[..., None], axis=1) / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)[..., None]
    return out[:, :, :r].reshape(b, 1, h, e).astype(q.dtype)


# --------------------------------------------------------------------------- TPU: ragged paged attention


def row_runs(positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's query run: the maximal consecutive-position run ending at its last maximal position.

    Returns (first token t0 [B], that token's position p0 [B]). Query t of the row then stands at
    position p0 - t0 + t; tokens before t0 or after the run's end are padding (outputs unspecified).
    """
    b, t = positions.shape
    cols = jnp.arange(t, dtype=jnp.int32)[None, :]
    last = (t - 1) - jnp.argmax(positions[:, ::-1], axis=1).astype(jnp.int32)  # last maximal position
    step_ok = jnp.concatenate([jnp.zeros((b, 1), bool), positions[:, 1:] == positions[:, :-1] + 1], axis=1)
    breaks = (~step_ok) & (cols <= last[:, None])  # [B, T]: a run starts here (at or before `last`)
    t0 = jnp.max(jnp.where(breaks, cols, 0), axis=1)
    p0 = jnp.take_along_axis(positions, t0[:, None], axis=1)[:, 0]
    return t0, p0


def rows_are_single_runs(positions: jax.Array) -> jax.Array:
    """Scalar bool: every token outside its row's run (see :func:`row_runs`) has position 0 (padding)."""
    t0, p0 = row_runs(positions)
    cols = jnp.arange(positions.shape[1], dtype=jnp.int32)[None, :]
    in_run = positions == (p0 - t0)[:, None] + cols
    return jnp.all(in_run | (positions == 0))


def ragged_paged_attention_tpu(
    q: jax.Array,  # [B, T, H, E]
    k_cache: jax.Array,  # [num_slots, G, E]
    v_cache: jax.Array,  # [num_slots, G, E]
    positions: jax.Array,  # int32 [B, T]
    block_tables: jax.Array,  # int32 [B, M]
    *,
    block_size: int,
    scale: float,
    interpret: bool = False,
    impl: Callable | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
) -> jax.Array:
    """Every row as one ragged sequence of T queries for JAX's TPU ragged paged attention.

    Row b's sequence has kv_len = p0 - t0 + T (:func:`row_runs`), so its query t is causal at
    p0 - t0 + t: exact for every token of the row's run. ``impl``: the attention function with
    ``ragged_paged_attention``'s signature (tests pass JAX's ``ref_ragged_paged_attention``);
    ``interpret`` runs the kernel under Pallas's TPU interpreter.
    """
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    b, t, h, e = q.shape
    num_slots, g, _ = k_cache.shape
    num_blocks = num_slots // block_size
    ep = -(-e // 128) * 128  # the kernel's lanes: head dim padded with zeros (no effect on q.k or p.v)
    kv = jnp.stack([k_cache, v_cache], axis=2).reshape(num_blocks, block_size, 2 * g, e)  # k_g at 2g, v_g at 2g+1
    kv = jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, ep - e)))
    queries = jnp.pad(q.reshape(b * t, h, e), ((0, 0), (0, 0), (0, ep - e)))
    t0, p0 = row_runs(positions)
    kv_lens = (p0 - t0 + t).astype(jnp.int32)  # [B]
    cu_q_lens = (jnp.arange(b + 1, dtype=jnp.int32) * t)
    kwargs = dict(sm_scale=scale)
    if impl is None:
        impl = rpa.ragged_paged_attention
        if interpret and num_kv_pages_per_block is None:
            # The tuned sizes are looked up by TPU generation, which a CPU does not have.
            num_kv_pages_per_block, num_queries_per_block = min(8, block_tables.shape[1]), 8
        kwargs.update(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block)
    args = (queries, kv, kv_lens, jnp.maximum(block_tables, 0).astype(jnp.int32), cu_q_lens,
            jnp.asarray([b], jnp.int32))
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode():
            out = impl(*args, **kwargs)
    else:
        out = impl(*args, **kwargs)
    return out[:, :, :e].reshape(b, t, h, e).astype(q.dtype)


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
