"""Causal paged attention on the CPU: the call wrapper, the validated entry, and an independent numpy reference.
The kernel body is ``attention.h`` (why it exists: its header comment and benchmarks/README.md, "Verify
cost on CPU"). Cache layout and shape letters as in :mod:`specjax.kv_cache`; semantics as
:func:`specjax.attention.paged_attention_xla`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.cpu_kernels import build
from models.cpu_kernels.build import available  # noqa: F401 (re-exported)

CACHE_DTYPES = (jnp.float32, jnp.bfloat16)
"""KV-cache dtypes the kernel reads (it computes in float32)."""


def paged_attention(
    q: jax.Array,  # [B, T, H, E]
    k_cache: jax.Array,  # [num_slots, G, E]
    v_cache: jax.Array,  # [num_slots, G, E]
    positions: jax.Array,  # int32 [B, T]
    block_tables: jax.Array,  # int32 [B, M]
    *,
    block_size: int,
    scale: float,
) -> jax.Array:
    """``[B, T, H, E]`` in q's dtype: the query at position p sees its row's keys 0..p; p < 0 gets zeros.

    CPU only (an XLA custom call); raises RuntimeError if the kernel could not be built here.
    """
    b, t, h, e = q.shape
    if k_cache.ndim != 3 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be alike [num_slots, G, E], got {k_cache.shape} {k_cache.dtype} "
                         f"and {v_cache.shape} {v_cache.dtype}")
    slots, g, ce = k_cache.shape
    if ce != e or h % g:
        raise ValueError(f"q [B, T, H, E] = {q.shape} does not fit caches [num_slots, G, E] = {k_cache.shape}")
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the caches must be float32 or bfloat16, got {k_cache.dtype}")
    if positions.shape != (b, t) or block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"positions must be [B, T] = {(b, t)} and block_tables [B, M], got {positions.shape} "
                         f"and {block_tables.shape}")
    if block_size <= 0 or slots % block_size:
        raise ValueError(f"block_size={block_size} must divide num_slots={slots}")
    if not available():
        raise RuntimeError("the CPU paged-attention kernel is not available here (see the log for why)")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    y = jax.ffi.ffi_call(build.ATTENTION_TARGET, out)(
        q.astype(jnp.float32), k_cache, v_cache, positions.astype(jnp.int32), block_tables.astype(jnp.int32),
        block_size=np.int64(block_size), scale=np.float32(scale))
    return y.astype(q.dtype)


def reference(q: Any, k_cache: Any, v_cache: Any, positions: Any, block_tables: Any, *, block_size: int,
              scale: float) -> np.ndarray:
    """float64 numpy, one query at a time: gather the row's keys 0..p through the table, softmax, weigh values."""
    q, positions, tables = np.asarray(q, np.float64), np.asarray(positions), np.asarray(block_tables)
    k = np.asarray(jnp.asarray(k_cache, jnp.float32), np.float64)
    v = np.asarray(jnp.asarray(v_cache, jnp.float32), np.float64)
    b, t, h, e = q.shape
    r = h // k.shape[1]
    out = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            p = int(positions[bi, ti])
            if p < 0:
                continue
            keys = np.arange(p + 1)
            slots = tables[bi, keys // block_size] * block_size + keys % block_size  # [S]
            for hi in range(h):
                s = k[slots, hi // r] @ q[bi, ti, hi] * scale  # [S]
                w = np.exp(s - s.max())
                out[bi, ti, hi] = (w / w.sum()) @ v[slots, hi // r]
    return out
