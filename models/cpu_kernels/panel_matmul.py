"""``x @ W.T`` on the CPU with ``W`` packed once into panels: the call wrapper, the validated entry,
the packing, and an independent numpy reference. The kernel body is ``panel_matmul.cc`` (why it exists: its
header comment and benchmarks/README.md, "Verify cost on CPU").

Panel layout of a ``[N, K]`` weight (``W[n, k]`` multiplies input feature k into output n), with
``C = panel_width()`` columns per panel (two of the machine's float vectors: 32 with AVX-512, 16 with AVX2)::

    w_p [P, K, C] with P = ceil(N / C):  w_p[p, k, j] = W[C p + j, k]   (rows past N are zero)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.cpu_kernels import build
from models.cpu_kernels.build import available  # noqa: F401 (re-exported)

DEFAULT_PANEL = 32
"""Panel width :func:`pack` uses where the kernel is not built (the layout is then only data)."""
DTYPES = (jnp.float32, jnp.bfloat16)
"""Weight dtypes the kernel reads (it always accumulates in float32)."""


def panel_width() -> int:
    """Columns per panel that the kernel built here reads (``build.panel_width``; DEFAULT_PANEL without it)."""
    return build.panel_width() or DEFAULT_PANEL


def pack(w: Any, dtype: Any = None, *, width: int | None = None) -> np.ndarray:
    """``[N, K]`` (output-major) weight -> panels ``[ceil(N/C), K, C]`` on the host, C = ``width`` (default
    :func:`panel_width`); ``dtype`` defaults to w's."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"pack wants a [N, K] weight, got shape {w.shape}")
    c = panel_width() if width is None else width
    if c <= 0:
        raise ValueError(f"width must be positive, got {c}")
    n, k = w.shape
    p = -(-n // c)
    padded = np.zeros((p * c, k), w.dtype)
    padded[:n] = w
    out = padded.reshape(p, c, k).transpose(0, 2, 1)  # [P, K, C]
    return np.ascontiguousarray(out if dtype is None else np.asarray(jnp.asarray(out).astype(dtype)))


def unpack(w_p: Any, n: int) -> np.ndarray:
    """Inverse of :func:`pack`: panels -> the ``[n, K]`` weight."""
    w_p = np.asarray(w_p)
    p, k, c = w_p.shape
    return np.ascontiguousarray(w_p.transpose(0, 2, 1).reshape(p * c, k)[:n])


def rows(w_p: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows ``W[idx]`` ``[..., K]`` read from the panels (an embedding lookup on a packed tied embedding), in
    float32 for bfloat16 panels (exact), else in the panels' dtype (:func:`rows_reference`).

    Ids are clipped into the panels, so a garbage id in a padding position reads a finite row (row 0 for a
    negative id, as ``jnp.take(mode="clip")``; an id past N may read a zero padding row instead of the last).
    bfloat16 panels go through the C++ row kernel (``panel_matmul.cc``, ``PanelRows``): XLA:CPU would widen
    the whole table to gather from it.
    """
    c = w_p.shape[2]
    if w_p.dtype == jnp.bfloat16 and available() and c == panel_width():
        out = jax.ShapeDtypeStruct((math.prod(idx.shape), w_p.shape[1]), jnp.float32)
        flat = jax.ffi.ffi_call(build.ROWS_TARGET, out)(idx.reshape(-1).astype(jnp.int32), w_p)  # [N, K]
        return flat.reshape(*idx.shape, w_p.shape[1])
    idx = jnp.clip(idx, 0, w_p.shape[0] * c - 1)
    out = w_p[idx // c, :, idx % c]  # [..., K]
    return out.astype(jnp.float32) if w_p.dtype == jnp.bfloat16 else out


def rows_reference(w_p: Any, idx: Any) -> np.ndarray:
    """float32 numpy :func:`rows` from the unpacked weight."""
    w_p = np.asarray(w_p).astype(np.float32)
    return unpack(w_p, w_p.shape[0] * w_p.shape[2])[np.clip(np.asarray(idx), 0, w_p.shape[0] * w_p.shape[2] - 1)]


def _call(x2: jax.Array, w_p: jax.Array) -> jax.Array:
    """pallas_call's counterpart: ``[M, K] f32 x [P, K, C] -> f32 [M, C P]`` through the XLA FFI."""
    out = jax.ShapeDtypeStruct((x2.shape[0], w_p.shape[0] * w_p.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(build.TARGET, out)(x2, w_p)


def panel_matmul(x: jax.Array, w_p: jax.Array, n: int, *, out_dtype: Any = None) -> jax.Array:
    """``x [..., K]`` times ``W.T`` for ``W [n, K]`` packed as ``w_p`` -> ``[..., n]`` in ``out_dtype`` (x's).

    Accumulates in float32. CPU only (an XLA custom call); raises RuntimeError if the kernel could not be
    built here (:func:`available` says so beforehand).
    """
    c = panel_width()
    if w_p.ndim != 3 or w_p.shape[2] != c:
        raise ValueError(f"w_p must be panels [P, K, {c}] (this machine's kernel width), got shape {w_p.shape}")
    if x.shape[-1] != w_p.shape[1]:
        raise ValueError(f"x's last dim {x.shape[-1]} != the panels' K {w_p.shape[1]}")
    if not 0 < n <= w_p.shape[0] * c or n <= (w_p.shape[0] - 1) * c:
        raise ValueError(f"n={n} does not fit {w_p.shape[0]} panels of {c} columns")
    if w_p.dtype not in DTYPES:
        raise ValueError(f"w_p must be float32 or bfloat16, got {w_p.dtype}")
    if not available():
        raise RuntimeError("the CPU panel-matmul kernel is not available here (see the log for why)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead, k = x.shape[:-1], x.shape[-1]
    y = _call(x.reshape(math.prod(lead), k).astype(jnp.float32), w_p)  # [M, C P]
    return y[:, :n].astype(out_dtype).reshape(*lead, n)  # [..., n]


def reference(x: Any, w_p: Any, n: int) -> np.ndarray:
    """float64 numpy ``x @ W.T`` from the unpacked weight (independent of the kernel's loop order)."""
    w = unpack(np.asarray(w_p).astype(np.float32), n)  # [n, K]
    x = np.asarray(x, np.float64)
    return x @ w.astype(np.float64).T
