"""``x @ W.T`` on the CPU with ``W`` packed once into panels: the call wrapper, the validated entry,
the packing, and an independent numpy reference. The kernel body is ``panels.h`` (why it exists: its
header comment and benchmarks/README.md, "Verify cost on CPU").

Panel layout of a ``[N, K]`` weight (``W[n, k]`` multiplies input feature k into output n), with
``C = panel_width()`` columns per panel (two of the machine's float vectors: 32 with AVX-512, 16 with AVX2)::

    w_p [P, K, C] with P = ceil(N / C):  w_p[p, k, j] = W[C p + j, k]   (rows past N are zero)

A weight quantized as a GGUF file stores it (Q4_1, Q8_0, and Q4_0 as Q4_1 with ``m = -8 d``: blocks of 32 along K
with float16 scales) can keep its blocks: panels of records ``[P, K / 32, R]``, one record per 32 k of a panel's C
columns (:func:`pack_q4_1`, :func:`pack_q8_0`). The kernel dequantizes each weight as the gguf package does, so its
products, and the model's logits, are those of the float32 weights the file dequantizes to, while a step streams 5
(Q4_1) or 8.5 (Q8_0) bits per weight instead of 32.
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
"""Float weight dtypes the kernel reads (it always accumulates in float32)."""
QUANT_BLOCK = 32
"""k per quantized record (a GGUF block)."""
RECORD_BYTES = {np.dtype(np.uint8): 20, np.dtype(np.int8): 34, np.dtype(np.uint32): 20, np.dtype(np.int32): 34}
"""Quantized panels by dtype -> record bytes per panel column: uint8 Q4_1 (float16 d and m, 32 nibbles), int8
Q8_0 (float16 d, 32 int8): GGUF's own 5 and 8.5 bits per weight; uint32 / int32 the same blocks laid out for
integer dot products (:data:`DOT_DTYPES`)."""
DOT_DTYPES = (np.dtype(np.uint32), np.dtype(np.int32))
"""Quantized panels the kernel multiplies with int8-quantized activations (``dot=True`` in :func:`pack_q4_1`,
:func:`pack_q8_0`; :func:`dot_reference`): uint32 Q4_1, int32 Q8_0."""


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


def is_quantized(w_p: Any) -> bool:
    """Whether panels ``w_p`` hold quantized records (:data:`RECORD_BYTES`) rather than float weights."""
    return np.dtype(w_p.dtype) in RECORD_BYTES


def panel_shape(w_p: Any) -> tuple[int, int, int]:
    """``(P, K, C)`` of panels in any format."""
    p, r, last = w_p.shape
    if is_quantized(w_p):
        dtype = np.dtype(w_p.dtype)
        return p, r * QUANT_BLOCK, last * dtype.itemsize // RECORD_BYTES[dtype]
    return p, r, last


def is_dot(w_p: Any) -> bool:
    """Whether quantized panels ``w_p`` are in the integer dot-product layout (:data:`DOT_DTYPES`)."""
    return np.dtype(w_p.dtype) in DOT_DTYPES


def _half(s: Any, name: str) -> np.ndarray:
    """Scales as float16, refusing values that are not float16 (the kernel's exactness rests on it)."""
    s = np.asarray(s)
    h = s.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), s.astype(np.float32), equal_nan=True):
        raise ValueError(f"{name} must hold float16 values (GGUF block scales), got {s.dtype} values that are not")
    return h


def _matrix(q: Any, dtype: Any) -> np.ndarray:
    q = np.asarray(q, dtype)
    if q.ndim != 2 or q.shape[1] % QUANT_BLOCK:
        raise ValueError(f"quantized panels need a [N, K] q with K divisible by {QUANT_BLOCK}, got shape {q.shape}")
    return q


def _records(n: int, k: int, c: int, scales: list[np.ndarray], rows: np.ndarray, unit: int = 1) -> np.ndarray:
    """Records ``[P, K / 32, bytes]`` (uint8) of panels of C columns: per scale ``[N, K / 32]`` (float16) the C
    columns' values, then ``rows [N, K / 32, J unit]`` (bytes) as J rows of C units of ``unit`` bytes (column c =
    weight row C p + c)."""
    p, b = -(-n // c), k // QUANT_BLOCK

    def by_panel(x: np.ndarray) -> np.ndarray:  # [N, B, ...] -> [P, C, B, ...], rows past N zero
        out = np.zeros((p * c, *x.shape[1:]), x.dtype)
        out[:n] = x
        return out.reshape(p, c, *x.shape[1:])

    parts = [by_panel(s.reshape(n, b)).transpose(0, 2, 1).copy().view(np.uint8) for s in scales]  # [P, B, 2 C]
    rows = by_panel(rows).reshape(p, c, b, -1, unit)  # [P, C, B, J, unit]
    parts.append(rows.transpose(0, 2, 3, 1, 4).reshape(p, b, -1))  # [P, B, J C unit]: J rows of C units
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def pack_q4_1(q: Any, d: Any, m: Any, *, width: int | None = None, dot: bool = False) -> np.ndarray:
    """Q4_1 weight ``W[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]`` (``q`` in 0..15; ``d``, ``m`` float16
    values; W as the gguf package dequantizes it, in float32) -> uint8 panels ``[P, K / 32, 20 C]``.

    Record of panel p, block b: d of its C columns (float16), m likewise, then 16 rows of C bytes, byte c of row j
    = q at k = 32 b + 2 j (low nibble) | q at k + 1 (high nibble) of column c.

    ``dot``: the layout for integer dot products with int8 activations instead (uint32 ``[P, K / 32, 5 C]``): after
    the scales, 4 rows of C words, byte i of column c's word in row g = q at k = 32 b + 8 g + i (low nibble) | q at
    k + 4 (high nibble)."""
    q = _matrix(q, np.uint8)
    n, k = q.shape
    c = panel_width() if width is None else width
    scales = [_half(d, "d"), _half(m, "m")]
    if dot:
        quads = q.reshape(n, k // QUANT_BLOCK, 4, 2, 4)  # [N, B, g, low / high, i]
        words = (quads[..., 0, :] & 15) | (quads[..., 1, :] << 4)  # [N, B, 4, 4]
        return _records(n, k, c, scales, words.reshape(n, k // QUANT_BLOCK, 16), unit=4).view(np.uint32)
    pairs = q.reshape(n, k // QUANT_BLOCK, QUANT_BLOCK // 2, 2)
    nibbles = (pairs[..., 0] & 15) | (pairs[..., 1] << 4)  # [N, B, 16]
    return _records(n, k, c, scales, nibbles)


def pack_q8_0(q: Any, d: Any, *, width: int | None = None, dot: bool = False) -> np.ndarray:
    """Q8_0 weight ``W[n, k] = d[n, k // 32] * q[n, k]`` (``q`` int8, ``d`` float16 values) -> int8 panels
    ``[P, K / 32, 34 C]``: per record d of the C columns (float16), then 32 rows of C int8 (k ascending).

    ``dot``: the layout for integer dot products with int8 activations instead (int32 ``[P, K / 32, 34 C / 4]``):
    after the scales, 8 rows of C words, byte i of column c's word in row g = q + 128 (unsigned) at
    k = 32 b + 4 g + i."""
    q = _matrix(q, np.int8)
    n, k = q.shape
    c = panel_width() if width is None else width
    if dot:
        shifted = (q.astype(np.int16) + 128).astype(np.uint8).reshape(n, k // QUANT_BLOCK, QUANT_BLOCK)
        return _records(n, k, c, [_half(d, "d")], shifted, unit=4).view(np.int32)
    rows = q.reshape(n, k // QUANT_BLOCK, QUANT_BLOCK).view(np.uint8)
    return _records(n, k, c, [_half(d, "d")], rows).view(np.int8)


def blocks(w_p: Any, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The GGUF blocks of quantized panels' first ``n`` columns, read with numpy: (q ``[n, K / 32, 32]`` float32,
    d ``[n, K / 32, 1]`` float32, m likewise for Q4_1, else None)."""
    w_p = np.asarray(w_p)
    p, k, c = panel_shape(w_p)
    raw = w_p.view(np.uint8).reshape(p, k // QUANT_BLOCK, -1)  # [P, B, bytes]

    def scale(i: int) -> np.ndarray:  # [n, B, 1] float32
        f = np.ascontiguousarray(raw[..., 2 * c * i: 2 * c * (i + 1)]).view(np.float16)  # [P, B, C]
        return f.transpose(0, 2, 1).reshape(p * c, -1, 1)[:n].astype(np.float32)

    unit = 4 if is_dot(w_p) else 1

    def rows(first: int) -> np.ndarray:  # [n, B, bytes] uint8, a column's bytes in the layout's order
        r = raw[..., first:].reshape(p, k // QUANT_BLOCK, -1, c, unit)  # [P, B, J, C, unit]
        return r.transpose(0, 3, 1, 2, 4).reshape(p * c, k // QUANT_BLOCK, -1)[:n]

    if RECORD_BYTES[np.dtype(w_p.dtype)] == 20:  # Q4_1
        nib = rows(4 * c)
        if unit == 4:  # [n, B, g, i] -> k = 8 g + i (low nibbles), 8 g + 4 + i (high)
            q = np.stack([nib.reshape(n, -1, 4, 4) & 15, nib.reshape(n, -1, 4, 4) >> 4], axis=-2)
        else:
            q = np.stack([nib & 15, nib >> 4], axis=-1)
        return q.reshape(n, -1, QUANT_BLOCK).astype(np.float32), scale(0), scale(1)
    q8 = rows(2 * c).astype(np.int16) - 128 if unit == 4 else rows(2 * c).view(np.int8)
    return q8.astype(np.float32), scale(0), None  # Q8_0


def dequantize(w_p: Any, n: int) -> np.ndarray:
    """float32 ``[n, K]`` weight of quantized panels, computed with numpy as the gguf package does (reference)."""
    q, d, m = blocks(w_p, n)
    return (d * q if m is None else (d * q) + m).reshape(n, -1)


def unpack(w_p: Any, n: int) -> np.ndarray:
    """Inverse of :func:`pack`: panels -> the ``[n, K]`` weight (float32 for quantized panels, :func:`dequantize`)."""
    w_p = np.asarray(w_p)
    if is_quantized(w_p):
        return dequantize(w_p, n)
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
    _, k, c = panel_shape(w_p)
    if is_quantized(w_p) or (w_p.dtype == jnp.bfloat16 and available() and c == panel_width()):
        if not available():
            raise RuntimeError("quantized panels need the CPU kernels, which are not available here")
        out = jax.ShapeDtypeStruct((math.prod(idx.shape), k), jnp.float32)
        flat = jax.ffi.ffi_call(build.ROWS_TARGET, out)(idx.reshape(-1).astype(jnp.int32), w_p)  # [N, K]
        return flat.reshape(*idx.shape, k)
    idx = jnp.clip(idx, 0, w_p.shape[0] * c - 1)
    out = w_p[idx // c, :, idx % c]  # [..., K]
    return out.astype(jnp.float32) if w_p.dtype == jnp.bfloat16 else out


def rows_reference(w_p: Any, idx: Any) -> np.ndarray:
    """float32 numpy :func:`rows` from the unpacked weight."""
    p, _, c = panel_shape(w_p)
    return unpack(w_p, p * c).astype(np.float32)[np.clip(np.asarray(idx), 0, p * c - 1)]


def _call(x2: jax.Array, w_p: jax.Array, stream: bool) -> jax.Array:
    """pallas_call's counterpart: ``[M, K] f32 x [P, K, C] -> f32 [M, C P]`` through the XLA FFI."""
    out = jax.ShapeDtypeStruct((x2.shape[0], w_p.shape[0] * panel_width()), jnp.float32)
    return jax.ffi.ffi_call(build.TARGET, out)(x2, w_p, stream=np.bool_(stream))


def panel_matmul(x: jax.Array, w_p: jax.Array, n: int, *, out_dtype: Any = None, stream: bool = False) -> jax.Array:
    """``x [..., K]`` times ``W.T`` for ``W [n, K]`` packed as ``w_p`` -> ``[..., n]`` in ``out_dtype`` (x's).

    Accumulates in float32. ``stream``: the model's weights exceed the last-level cache, so the kernel prefetches
    for a stream from memory (``panels.h``; the same products either way). CPU only (an XLA custom call); raises
    RuntimeError if the kernel could not be built here (:func:`available` says so beforehand).
    """
    if w_p.dtype not in DTYPES and not is_quantized(w_p):
        raise ValueError(f"w_p must be float32 or bfloat16 panels or quantized records, got {w_p.dtype}")
    c = panel_width()
    if w_p.ndim != 3 or panel_shape(w_p)[2] != c or w_p.shape[2] * np.dtype(w_p.dtype).itemsize % c:
        raise ValueError(f"w_p must be panels [P, K, {c}] or records [P, K / {QUANT_BLOCK}, R * {c}] (this "
                         f"machine's kernel width), got shape {w_p.shape}")
    p, k, _ = panel_shape(w_p)
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != the panels' K {k}")
    if not 0 < n <= p * c or n <= (p - 1) * c:
        raise ValueError(f"n={n} does not fit {p} panels of {c} columns")
    if not available():
        raise RuntimeError("the CPU panel-matmul kernel is not available here (see the log for why)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead, k = x.shape[:-1], x.shape[-1]
    y = _call(x.reshape(math.prod(lead), k).astype(jnp.float32), w_p, stream)  # [M, C P]
    return y[:, :n].astype(out_dtype).reshape(*lead, n)  # [..., n]


def quantize_rows(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """``x [M, K]`` float32 as the kernel quantizes it for :data:`DOT_DTYPES` panels: per row and block of 32,
    ``dx = max |x| / 127`` and ``q = rint(x * (127 / max |x|))`` (to nearest, ties to even, in float32) ->
    (q ``[M, K]`` int8, dx ``[M, K / 32]`` float32)."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(x.shape[0], -1, QUANT_BLOCK)  # [M, B, 32]
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    v = blocks * inv  # float32, as the kernel rounds it
    q = np.clip(np.rint(v), -127, 127).astype(np.int8)
    return q.reshape(x.shape), (amax[..., 0] / np.float32(127)).astype(np.float32)


def dot_reference(x: Any, w_p: Any, n: int) -> np.ndarray:
    """float64 numpy of what the kernel computes for :data:`DOT_DTYPES` panels: ``x`` quantized by
    :func:`quantize_rows`, each block's ``d dx sum(q xq)`` (+ ``m sum(x)`` for Q4_1), summed over blocks."""
    x = np.asarray(x, np.float32)
    q, d, m = (None if a is None else a.astype(np.float64) for a in blocks(w_p, n))  # [n, B, 32], [n, B, 1] x2
    xq, dx = quantize_rows(x)
    xqb = xq.reshape(x.shape[0], -1, QUANT_BLOCK).astype(np.float64)  # [M, B, 32]
    out = np.einsum("mbk,nbk->mnb", xqb, q) * d[None, :, :, 0] * dx[:, None, :]  # [M, n, B]
    if m is not None:
        out += x.reshape(x.shape[0], -1, QUANT_BLOCK).astype(np.float64).sum(-1)[:, None, :] * m[None, :, :, 0]
    return out.sum(-1)


def reference(x: Any, w_p: Any, n: int) -> np.ndarray:
    """float64 numpy ``x @ W.T`` from the unpacked weight (independent of the kernel's loop order)."""
    w = unpack(w_p, n).astype(np.float32)  # [n, K]
    x = np.asarray(x, np.float64)
    return x @ w.astype(np.float64).T
