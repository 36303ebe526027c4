"""The C++ CPU kernels (models/cpu_kernels/*.cc) against their float64 numpy references.

Panel matmul: real shapes (SmolLM2-135M's projections and LM head), every row-group remainder, padded
panels, bfloat16 weights, leading batch dims. Paged attention: SmolLM2's heads (E 64, GQA 3:1) and GQA
8:1 at E 128, rows of 1, K+1 and a prefill chunk's query tokens over ragged contexts on shuffled blocks
with garbage in unused slots, padding tokens, bfloat16 caches, and agreement with the XLA path. Both:
the validated entries' refusals; the build cache; and what happens on a machine without a C++ compiler.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu_kernels import build
from models.cpu_kernels import paged_attention as pa
from models.cpu_kernels import panel_matmul as pm
from specjax import backends
from specjax.attention import paged_attention, paged_attention_xla
from test_attention_backends import make_batch

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU custom call")

# (N, K) of SmolLM2-135M: qkv [(9+2*3)*64, 576], o [576, 576], gate_up [2*1536, 576], down [576, 1536].
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _case(m, n, k, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return x, w, pm.pack(w, dtype)


def _check(y, x, w_p, n, rtol):
    ref = pm.reference(x, w_p, n)
    assert y.shape == ref.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize("n,k", SMOLLM2)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 9, 13, 16, 40])  # every remainder of 6- and 8-row groups
def test_matches_reference_at_smollm2_shapes(m, n, k):
    x, _, w_p = _case(m, n, k, seed=m * n + k)
    y = jax.jit(pm.panel_matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(w_p), n)
    _check(np.asarray(y), x, w_p, n, rtol=2e-5)


def test_lm_head_shape_and_leading_dims():
    x, _, w_p = _case(2 * 5, 49152, 576, seed=7)  # the tied head of SmolLM2 over a [B=2, T=5] verify
    y = pm.panel_matmul(jnp.asarray(x).reshape(2, 5, 576), jnp.asarray(w_p), 49152, out_dtype=jnp.float32)
    assert y.shape == (2, 5, 49152)
    _check(np.asarray(y).reshape(10, -1), x, w_p, 49152, rtol=2e-5)


@pytest.mark.parametrize("n,k", [(1, 3), (33, 17), (70, 24), (95, 100)])
def test_padded_panels_and_odd_contractions(n, k):
    x, w, w_p = _case(3, n, k, seed=n + k)
    c = pm.panel_width()
    assert w_p.shape == (-(-n // c), k, c)
    np.testing.assert_array_equal(pm.unpack(w_p, n), w)
    _check(np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(w_p), n)), x, w_p, n, rtol=2e-5)


@pytest.mark.parametrize("m", [1, 5, 11])
def test_bfloat16_weights_accumulate_in_float32(m):
    x, w, w_p = _case(m, 3072, 576, seed=m, dtype=jnp.bfloat16)
    assert w_p.dtype == jnp.bfloat16
    y = np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(w_p), 3072))
    _check(y, x, w_p, 3072, rtol=2e-5)  # exact against the bf16-rounded weights
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, atol=0.05)  # bf16 rounding of the weights


@pytest.mark.parametrize("m", [1, 5, 9])
def test_bfloat16_panels_give_the_float32_panels_products_bit_for_bit(m):
    """What ``models.cpu_layout.narrowed`` rests on: bfloat16 panels of weights that are all bfloat16 values
    widen back to those float32 values, so the products are those of float32 panels exactly (the shipped
    models' logits do not change with the narrowing). Columns 0..C-1 of a panel each get their own weight."""
    x, w, _ = _case(m, 1000, 320, seed=m)
    w = np.array(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))  # exactly bfloat16 values
    w[:, 0] = np.arange(1000) % 256  # distinct bfloat16 integers across each panel's columns, at x's first k
    got = np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(pm.pack(w, jnp.bfloat16)), 1000))
    np.testing.assert_array_equal(got, np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(pm.pack(w)), 1000)))
    _check(got, x, pm.pack(w), 1000, rtol=2e-5)


def test_bfloat16_activations_come_back_in_their_dtype():
    x, _, w_p = _case(4, 64, 32, seed=1)
    y = pm.panel_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w_p), 64)
    assert y.dtype == jnp.bfloat16
    ref = pm.reference(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), w_p, 64)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=1e-2)


def test_panel_width_is_two_machine_vectors():
    """The kernel reports its width; pack follows it unless told otherwise; unpack and rows read any width."""
    c = pm.panel_width()
    assert c == build.panel_width() and c in (8, 16, 32)
    w = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    assert pm.pack(w).shape == (-(-40 // c), 3, c)
    w_8 = pm.pack(w, width=8)
    assert w_8.shape == (5, 3, 8)
    np.testing.assert_array_equal(pm.unpack(w_8, 40), w)
    np.testing.assert_array_equal(np.asarray(pm.rows(jnp.asarray(w_8), jnp.asarray([0, 9, 39]))), w[[0, 9, 39]])
    with pytest.raises(ValueError, match="width"):
        pm.pack(w, width=0)


@pytest.mark.parametrize("v,k", [(4096, 320), (49152, 576)])  # the shipped target's and SmolLM2's tied tables
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_match_reference_and_a_loop_reads_only_the_rows_asked_for(v, k, dtype):
    """Embedding lookups from panels (bfloat16 ones through the row kernel), ids clipped; in a drafting loop
    the compiled program holds no float32 copy of a bfloat16 table (what XLA's own gather made)."""
    w = np.random.default_rng(v).standard_normal((v, k)).astype(np.float32)
    w_p = jnp.asarray(pm.pack(w, dtype))
    idx = jnp.asarray([[0, 1, v - 1, v // 2 + 3], [-5, 7, v + 100, 31]], jnp.int32)
    got = np.asarray(jax.jit(pm.rows)(w_p, idx))
    assert got.shape == (2, 4, k) and got.dtype == np.float32
    np.testing.assert_array_equal(got, pm.rows_reference(w_p, idx))
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(got[0, :2], np.asarray(jnp.asarray(w[:2]).astype(dtype), np.float32))

        def loop(w_p, idx):
            return jax.lax.fori_loop(0, 3, lambda i, acc: acc + pm.rows(w_p, idx + i).sum(), jnp.float32(0))

        text = jax.jit(loop).lower(w_p, idx).compile().as_text()
        assert build.ROWS_TARGET in text and f"f32[{w_p.shape[0]},{k},{w_p.shape[2]}]" not in text


def test_entry_refuses_bad_shapes_and_dtypes():
    c = pm.panel_width()
    x = jnp.ones((2, 16), jnp.float32)
    with pytest.raises(ValueError, match="panels"):  # packed for another machine's width
        pm.panel_matmul(x, jnp.ones((1, 16, 2 * c), jnp.float32), c)
    with pytest.raises(ValueError, match="last dim 16"):
        pm.panel_matmul(x, jnp.ones((1, 8, c), jnp.float32), c)
    with pytest.raises(ValueError, match=f"n={c + 8}"):
        pm.panel_matmul(x, jnp.ones((1, 16, c), jnp.float32), c + 8)
    with pytest.raises(ValueError, match="n=3"):  # a whole empty panel
        pm.panel_matmul(x, jnp.ones((2, 16, c), jnp.float32), 3)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pm.panel_matmul(x, jnp.ones((1, 16, c), jnp.float16), c)
    with pytest.raises(ValueError, match="shape"):
        pm.pack(np.ones((2, 3, 4)))


# --------------------------------------------------------------------------- GGUF blocks (Q4_1, Q8_0)


@functools.cache
def _quantized_case(kind: str, n: int, k: int, dot: bool = False):
    """A random [n, k] weight quantized by the gguf package: (its packed panels, in the layout for int8
    activations with ``dot``, the float32 weight the gguf package dequantizes the blocks to)."""
    import gguf

    from models.gguf_blocks import blocks_from_raw

    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    w = (np.random.default_rng(n + k).standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    b = blocks_from_raw(raw, qtype, (n, k))  # Q4_0 arrives as Q4_1 blocks with m = -8 d
    packed = pm.pack_q4_1(b.q, b.d, b.m, dot=dot) if b.kind == "q4_1" else pm.pack_q8_0(b.q, b.d, dot=dot)
    return packed, gguf.quants.dequantize(raw, qtype).astype(np.float32)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0"])
@pytest.mark.parametrize("n,k", SMOLLM2 + [(70, 64)])  # + a padded last panel
@pytest.mark.parametrize("m", [1, 5, 8, 9, 40])
def test_quantized_panels_give_the_float_weights_products_exactly(kind, n, k, m):
    """Panels of GGUF blocks dequantize to what the gguf package gives (its own dequantizer), and the kernel's
    products on them are bit for bit those of float32 panels of those weights, close to the float64 reference."""
    packed, w = _quantized_case(kind, n, k)
    assert packed.dtype == (np.int8 if kind == "q8_0" else np.uint8)
    assert packed.shape == (-(-n // pm.panel_width()), k // 32, pm.RECORD_BYTES[packed.dtype] * pm.panel_width())
    np.testing.assert_array_equal(pm.dequantize(packed, n), w)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)).astype(np.float32))
    y = np.asarray(jax.jit(pm.panel_matmul, static_argnums=2)(x, jnp.asarray(packed), n))
    np.testing.assert_array_equal(y, np.asarray(pm.panel_matmul(x, jnp.asarray(pm.pack(w)), n)))
    _check(y, x, pm.pack(w), n, rtol=2e-5)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_of_quantized_panels_are_the_dequantized_rows(kind):
    packed, w = _quantized_case(kind, 4096, 320)
    idx = jnp.asarray([[0, 1, 4095, 2051], [-5, 7, 9000, 31]], jnp.int32)
    got = np.asarray(jax.jit(pm.rows)(jnp.asarray(packed), idx))
    np.testing.assert_array_equal(got, w[np.clip(np.asarray(idx), 0, 4095)])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0"])
@pytest.mark.parametrize("n,k", SMOLLM2 + [(70, 64)])
@pytest.mark.parametrize("m", [1, 5, 9, 40, 64])  # 64 rows of K = 1536: quantized on the thread pool
def test_int8_activation_products_match_their_reference(kind, n, k, m):
    """Panels in the layout for int8 activations hold the same blocks (the gguf package's weights); the kernel's
    products are the numpy reference's arithmetic (x quantized per block of 32, integer sums, float scales) up to
    float32 rounding, and within a few per cent of the exact float product (the quantization of x)."""
    packed, w = _quantized_case(kind, n, k, dot=True)
    assert packed.dtype == (np.int32 if kind == "q8_0" else np.uint32)
    assert pm.panel_shape(packed) == (-(-n // pm.panel_width()), k, pm.panel_width())
    np.testing.assert_array_equal(pm.dequantize(packed, n), w)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = np.asarray(jax.jit(pm.panel_matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(packed), n))
    ref = pm.dot_reference(x, packed, n)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(y - exact).max() < 0.03 * np.abs(exact).max()


def test_int8_activation_products_are_exact_at_the_extremes_of_both_bytes():
    """Weights at q = -128, -127 and 127 against activations all at +-127 (every block's |x| equal): the byte
    products' pair sums are as large as int8 x int8 gets, where a 16-bit pair sum saturates (AVX2's vpmaddubsw on
    the unsigned q + 128 would); the integer sums must still be exact: the kernel equals the reference's float64
    arithmetic, and for Q4_1 (q 0 and 15) alike."""
    rng = np.random.default_rng(5)
    n, k, m = 48, 256, 5
    signs = rng.choice([-1.0, 1.0], size=(m, k)).astype(np.float32)
    x = signs * rng.uniform(0.5, 2.0, size=(m, k // 32, 1)).repeat(32, axis=2).reshape(m, k).astype(np.float32)
    q8 = rng.choice(np.array([-128, -127, 127], np.int8), size=(n, k))
    q8[:, :32] = 127  # a whole block at the positive extreme against rows of one sign
    x[0, :32] = np.abs(x[0, :32])
    d = rng.uniform(0.01, 0.02, size=(n, k // 32)).astype(np.float16)
    q4 = rng.choice(np.array([0, 15], np.uint8), size=(n, k))
    for packed in (pm.pack_q8_0(q8, d, dot=True), pm.pack_q4_1(q4, d, -8 * d, dot=True)):
        y = np.asarray(pm.panel_matmul(jnp.asarray(x), jnp.asarray(packed), n))
        ref = pm.dot_reference(x, packed, n)
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    # The all-127 block against row 0's positive block: 32 * 127 * 127 = 516128 in its integer sum.
    xq, _ = pm.quantize_rows(x[:1])
    assert (xq[0, :32] == 127).all()


def test_int8_activation_rows_do_not_depend_on_the_other_rows():
    """Each row is quantized alone and summed in integers: a row of a 9-row call (a verify) equals the 1-row call
    on it (a plain step) bit for bit, which keeps speculation exact for a model run this way."""
    for kind in ("q4_1", "q8_0"):
        packed, _ = _quantized_case(kind, 3072, 576, dot=True)
        x = jnp.asarray(np.random.default_rng(3).standard_normal((9, 576)).astype(np.float32))
        many = np.asarray(pm.panel_matmul(x, jnp.asarray(packed), 3072))
        for i in (0, 4, 8):
            one = pm.panel_matmul(x[i:i + 1], jnp.asarray(packed), 3072)
            np.testing.assert_array_equal(many[i], np.asarray(one)[0])


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q4_1", "q8_0", "q4_1_dot", "q8_0_dot"])
def test_the_streaming_prefetch_computes_the_same_products(kind):
    """``stream`` (weights beyond the last-level cache) changes only the prefetch: every row count, across row
    groups, gives the same bits as without it, and the reference's values."""
    n, k = 200, 576
    if kind in ("float32", "bfloat16"):
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        packed = pm.pack(w, jnp.bfloat16 if kind == "bfloat16" else None)
    else:
        packed, _ = _quantized_case(kind.removesuffix("_dot"), n, k, dot=kind.endswith("_dot"))
    reference = pm.dot_reference if kind.endswith("_dot") else pm.reference
    for m in (1, 5, 9, 17):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)).astype(np.float32))
        streamed = np.asarray(pm.panel_matmul(x, jnp.asarray(packed), n, stream=True))
        np.testing.assert_array_equal(streamed, np.asarray(pm.panel_matmul(x, jnp.asarray(packed), n)))
        ref = reference(np.asarray(x), packed, n)
        np.testing.assert_allclose(streamed, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_quantize_rows_on_a_vector_worked_by_hand():
    """Block max 127 gives scale 1: q rounds x to nearest, ties to even; a zero block gives q 0, scale 0; a block
    with max 2 multiplies x by 63.5 (all values below exact in binary)."""
    x = np.zeros((1, 96), np.float32)
    x[0, :6] = [127, -63.5, 0.5, -0.5, 2.4, 1.49]
    x[0, 64:68] = [-2, 1, -0.5, 0.25]  # x 63.5 = -127, 63.5, -31.75, 15.875
    q, dx = pm.quantize_rows(x)
    assert q[0, :6].tolist() == [127, -64, 0, 0, 2, 1] and not q[0, 6:64].any()
    assert q[0, 64:68].tolist() == [-127, 64, -32, 16] and not q[0, 68:].any()
    np.testing.assert_allclose(dx[0], [1, 0, 2 / 127], rtol=1e-7)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_of_int8_activation_panels_are_the_dequantized_rows(kind):
    packed, w = _quantized_case(kind, 4096, 320, dot=True)
    idx = jnp.asarray([[0, 1, 4095, 2051], [-5, 7, 9000, 31]], jnp.int32)
    got = np.asarray(jax.jit(pm.rows)(jnp.asarray(packed), idx))
    np.testing.assert_array_equal(got, w[np.clip(np.asarray(idx), 0, 4095)])


def test_quantized_packing_refuses_what_the_kernel_cannot_read_exactly():
    q = np.zeros((4, 64), np.uint8)
    half = np.ones((4, 2), np.float16)
    with pytest.raises(ValueError, match="d must hold float16"):
        pm.pack_q4_1(q, np.full((4, 2), 0.1, np.float32), half)
    with pytest.raises(ValueError, match="m must hold float16"):
        pm.pack_q4_1(q, half, np.full((4, 2), 1e-9, np.float32))
    with pytest.raises(ValueError, match="divisible by 32"):
        pm.pack_q8_0(np.zeros((4, 48), np.int8), np.ones((4, 1), np.float16))
    packed = jnp.asarray(pm.pack_q8_0(np.zeros((4, 64), np.int8), half))
    with pytest.raises(ValueError, match="last dim 32"):
        pm.panel_matmul(jnp.ones((1, 32)), packed, 4)


# --------------------------------------------------------------------------- paged attention

# (head_dim E, kv heads G, GQA ratio R, block size): SmolLM2-135M's attention; GQA 8:1 at E 128; odd sizes.
ATTENTION_SHAPES = [(64, 3, 3, 16), (128, 2, 8, 32), (12, 1, 2, 8)]


def _attention_check(q, kc, vc, pos, tables, block_size, real=None, atol=2e-5):
    kw = dict(block_size=block_size, scale=q.shape[-1] ** -0.5)
    out = np.asarray(jax.jit(functools.partial(pa.paged_attention, **kw))(q, kc, vc, pos, tables))
    ref = pa.reference(q, kc, vc, pos, tables, **kw)
    real = np.ones(pos.shape, bool) if real is None else real
    assert out.shape == q.shape
    np.testing.assert_allclose(out[real], ref[real], rtol=atol, atol=atol)
    return out


@pytest.mark.parametrize("t", [1, 5, 9, 40])
@pytest.mark.parametrize("e,g,r,block_size", ATTENTION_SHAPES, ids=[f"E{s[0]}-G{s[1]}-R{s[2]}-bs{s[3]}"
                                                                    for s in ATTENTION_SHAPES])
def test_attention_matches_reference(t, e, g, r, block_size):
    """Ragged contexts (one row shorter than a softmax chunk, one spanning several) on shuffled blocks."""
    rng = np.random.default_rng(100 * t + e + g + r)
    q, kc, vc, pos, tables = make_batch(rng, t=t, g=g, r=r, e=e, block_size=block_size, lengths=[t + 3, 150, 300])
    out = _attention_check(q, kc, vc, pos, tables, block_size)
    kw = dict(block_size=block_size, scale=e**-0.5)
    np.testing.assert_allclose(out, np.asarray(paged_attention_xla(q, kc, vc, pos, tables, **kw)), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("t", [1, 5])
def test_attention_split_over_threads(t):
    """Batch 1 (and 3): when the rows alone do not fill the pool's threads (here, 2 threads or more), the kernel
    splits each row's keys over them (long contexts; it combines the parts' softmax sums) or its kv heads (short
    ones); a padding row and padding tokens in such a batch still get zeros."""
    rng = np.random.default_rng(11 + t)
    e, g, r, bs = 64, 3, 3, 16
    for length in (1000, 40):
        q, kc, vc, pos, tables = make_batch(rng, t=t, g=g, r=r, e=e, block_size=bs, lengths=[length])
        _attention_check(q, kc, vc, pos, tables, bs)
    q, kc, vc, pos, tables = make_batch(rng, t=t, g=g, r=r, e=e, block_size=bs, lengths=[700, 300, 200])
    pos = np.asarray(pos).copy()
    tables = np.asarray(tables).copy()
    pos[2] = -1
    tables[2] = -1
    pos[1, -1] = -1
    out = _attention_check(q, kc, vc, jnp.asarray(pos), jnp.asarray(tables), bs, real=pos >= 0)
    assert not np.any(out[pos < 0])


def test_attention_padding_tokens_and_rows():
    """Engine layouts: a prefill chunk padded with position -1 tokens (zeros out, like the XLA path), a draft
    catch-up row whose first token is a dummy at position 0, an all-padding row with a -1 block table."""
    rng = np.random.default_rng(5)
    e, g, r, bs = 64, 3, 3, 16
    q, kc, vc, _, tables = make_batch(rng, t=6, g=g, r=r, e=e, block_size=bs, lengths=[40, 40, 20])
    tables = np.asarray(tables).copy()
    tables[2] = -1
    pos = np.array([[30, 31, 32, 33, -1, -1], [0, 0, 1, 2, 3, 4], [-1] * 6], np.int32)
    out = _attention_check(q, kc, vc, jnp.asarray(pos), jnp.asarray(tables), bs, real=pos >= 0)
    assert not np.any(out[pos < 0])
    xla = paged_attention_xla(q, kc, vc, jnp.asarray(pos), jnp.asarray(tables), block_size=bs, scale=e**-0.5)
    np.testing.assert_allclose(out, np.asarray(xla), rtol=2e-5, atol=2e-5)


def test_attention_bfloat16_cache_and_query():
    rng = np.random.default_rng(6)
    q, kc, vc, pos, tables = make_batch(rng, t=5, g=3, r=3, e=64, block_size=16, lengths=[70, 9],
                                        dtype=jnp.bfloat16)
    out = pa.paged_attention(q, kc, vc, pos, tables, block_size=16, scale=0.125)
    assert out.dtype == jnp.bfloat16
    ref = pa.reference(q.astype(jnp.float32), kc, vc, pos, tables, block_size=16, scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)  # bf16 rounding of the output only


def test_attention_dispatch_follows_the_cpu_layout(monkeypatch):
    """paged_attention runs the kernel for a caller in the CPU layout (and not under SPECJAX_ATTENTION_BACKEND=xla):
    the compiled program calls the custom-call target exactly then."""
    rng = np.random.default_rng(7)
    q, kc, vc, pos, tables = make_batch(rng, t=5, g=3, r=3, e=64, block_size=16, lengths=[30])
    monkeypatch.delenv(backends.ATTENTION_ENV, raising=False)

    def hlo(cpu_layout):
        fn = functools.partial(paged_attention, block_size=16, scale=0.125, cpu_layout=cpu_layout)
        return jax.jit(fn).lower(q, kc, vc, pos, tables).as_text()

    assert build.ATTENTION_TARGET in hlo(True) and build.ATTENTION_TARGET not in hlo(False)
    monkeypatch.setenv(backends.ATTENTION_ENV, "xla")
    assert build.ATTENTION_TARGET not in hlo(True)


def test_attention_entry_refuses_bad_shapes():
    q = jnp.ones((1, 2, 4, 8), jnp.float32)
    cache = jnp.ones((32, 2, 8), jnp.float32)
    pos, tables = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="alike"):
        pa.paged_attention(q, cache, cache[:16], pos, tables, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        pa.paged_attention(q, jnp.ones((32, 3, 8)), jnp.ones((32, 3, 8)), pos, tables, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pa.paged_attention(q, cache.astype(jnp.float16), cache.astype(jnp.float16), pos, tables, block_size=16,
                           scale=1.0)
    with pytest.raises(ValueError, match="positions must be"):
        pa.paged_attention(q, cache, cache, pos[:, :1], tables, block_size=16, scale=1.0)
    with pytest.raises(ValueError, match="block_size=5"):
        pa.paged_attention(q, cache, cache, pos, tables, block_size=5, scale=1.0)


# --------------------------------------------------------------------------- build


def test_build_is_cached_per_machine():
    assert pm.available() and build.load() == build.TARGET
    libs = list(build.cache_dir().glob("specjax_cpu_kernels-*.so"))
    assert libs, build.cache_dir()


def test_without_a_compiler_the_kernel_is_off_and_the_layout_stays_checkpoint(tmp_path):
    """A fresh process with no compiler on PATH and an empty cache: load() says None, ``auto`` keeps the
    checkpoint layout, ``cpu`` refuses naming the missing kernel."""
    script = textwrap.dedent("""
        import jax
        from models.cpu_kernels import build
        from specjax.backends import use_cpu_weight_layout
        assert build.load() is None
        import os
        cpus = jax.devices("cpu")[:1]
        os.environ["SPECJAX_WEIGHT_LAYOUT"] = "auto"
        assert not use_cpu_weight_layout(cpus)
        os.environ["SPECJAX_WEIGHT_LAYOUT"] = "cpu"
        try:
            use_cpu_weight_layout(cpus)
        except ValueError as e:
            assert "panel-matmul kernel" in str(e), e
        else:
            raise AssertionError("no ValueError")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path), SPECJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert "no C++ compiler" in proc.stderr
