"""The Pallas attention backends against the XLA path, on CPU.

* GPU: JAX's Pallas paged-attention kernel body in our pallas_call (interpret mode), one-token rows.
* TPU: our adapter to JAX's ragged paged attention (combined K/V layout, one ragged sequence per row),
  run with JAX's own reference implementation of that op in place of the kernel: the Pallas TPU
  interpreter of this jax cannot run the kernel (it reshapes a ref), so what is tested here is the
  adapter -- layout, padding of the head dim, metadata, causal offsets -- and, separately, that the
  real kernel call passes Mosaic lowering.

Shapes are real: head_dim 64 / 128, GQA 4:1 and 8:1, block sizes 16 / 32, rows of 1 and K+1 = 5 queries,
ragged context lengths over shuffled physical blocks, garbage in unused cache slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import backends
from specjax.attention import (
    paged_attention,
    paged_attention_xla,
    paged_decode_attention_gpu,
    ragged_paged_attention_tpu,
    row_runs,
    rows_are_single_runs,
)
from specjax.kv_cache import write_kv


def make_batch(rng, *, t, g, r, e, block_size, lengths, num_blocks=None, dtype=jnp.float32):
    """Ragged rows whose last t tokens are the queries; each row's keys scattered over shuffled blocks.

    Returns q [B, T, H, E], k/v caches [num_slots, G, E], positions [B, T], block tables [B, M].
    """
    b = len(lengths)
    m = max(-(-n // block_size) for n in lengths) + 1  # one spare (-1) table column
    num_blocks = num_blocks or sum(-(-n // block_size) for n in lengths) + 3
    perm = rng.permutation(num_blocks)
    tables = np.full((b, m), -1, np.int32)
    slots = np.full((b, m * block_size), -1, np.int32)
    used = 0
    for i, n in enumerate(lengths):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        p = np.arange(n)
        slots[i, :n] = tables[i, p // block_size] * block_size + p % block_size
    shape = (num_blocks * block_size, g, e)
    garbage = lambda: jnp.asarray(rng.normal(size=shape) * 50, dtype)  # noqa: E731  unwritten slots
    k_dense = jnp.asarray(rng.normal(size=(b, m * block_size, g, e)), dtype)
    v_dense = jnp.asarray(rng.normal(size=(b, m * block_size, g, e)), dtype)
    k_cache, v_cache = write_kv(garbage(), garbage(), k_dense, v_dense, jnp.asarray(slots))
    q = jnp.asarray(rng.normal(size=(b, t, g * r, e)), dtype)
    positions = np.stack([np.arange(n - t, n) for n in lengths]).astype(np.int32)
    return q, k_cache, v_cache, jnp.asarray(positions), jnp.asarray(tables)


# (head_dim, kv heads G, GQA ratio R, block size): the first two cover head_dim 64/128, GQA 4:1 and 8:1,
# blocks 16/32; the third crosses them for the GPU kernel's head blocking.
SHAPES = [(64, 2, 4, 16), (128, 1, 8, 32), (128, 2, 8, 16)]


@pytest.mark.parametrize("e,g,r,block_size", SHAPES, ids=[f"E{s[0]}-G{s[1]}-R{s[2]}-bs{s[3]}" for s in SHAPES])
def test_gpu_paged_decode_matches_xla(e, g, r, block_size):
    rng = np.random.default_rng(e + g + r + block_size)
    q, kc, vc, pos, tables = make_batch(rng, t=1, g=g, r=r, e=e, block_size=block_size, lengths=[37, 1, 150])
    kw = dict(block_size=block_size, scale=e**-0.5)
    ref = paged_attention_xla(q, kc, vc, pos, tables, **kw)
    out = paged_decode_attention_gpu(q, kc, vc, pos, tables, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_gpu_paged_decode_bfloat16_and_key_splits():
    """bf16 cache, several key splits per row (one of them past every row's length)."""
    rng = np.random.default_rng(3)
    q, kc, vc, pos, tables = make_batch(rng, t=1, g=2, r=4, e=128, block_size=16, lengths=[70, 9],
                                        dtype=jnp.bfloat16)
    kw = dict(block_size=16, scale=128**-0.5)
    ref = paged_attention_xla(q, kc, vc, pos, tables, **kw).astype(jnp.float32)
    out = paged_decode_attention_gpu(q, kc, vc, pos, tables, interpret=True, pages_per_compute_block=1,
                                     k_splits=3, **kw)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(ref), atol=3e-2)


def test_gpu_backend_dispatch_falls_back_for_wide_rows():
    rng = np.random.default_rng(4)
    q, kc, vc, pos, tables = make_batch(rng, t=5, g=1, r=4, e=64, block_size=16, lengths=[20, 33])
    kw = dict(block_size=16, scale=0.125)
    out = paged_attention(q, kc, vc, pos, tables, backend=backends.PAGED_DECODE_GPU, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_xla(q, kc, vc, pos, tables, **kw)))


def _ragged_with_reference(q, kc, vc, pos, tables, **kw):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    return ragged_paged_attention_tpu(q, kc, vc, pos, tables, impl=ref_ragged_paged_attention, **kw)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("e,g,r,block_size", SHAPES[:2], ids=[f"E{s[0]}-G{s[1]}-R{s[2]}-bs{s[3]}" for s in SHAPES[:2]])
def test_tpu_ragged_adapter_matches_xla(t, e, g, r, block_size):
    rng = np.random.default_rng(10 * t + e + g + r + block_size)
    q, kc, vc, pos, tables = make_batch(rng, t=t, g=g, r=r, e=e, block_size=block_size, lengths=[37, t, 150])
    kw = dict(block_size=block_size, scale=e**-0.5)
    ref = paged_attention_xla(q, kc, vc, pos, tables, **kw)
    out = _ragged_with_reference(q, kc, vc, pos, tables, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_tpu_ragged_adapter_padded_rows():
    """Engine layouts: a prefill chunk padded with position-0 tokens, a draft-model catch-up row whose
    first token is a dummy at position 0, and an all-padding row. Only real tokens are compared."""
    rng = np.random.default_rng(7)
    e, g, r, bs, t = 64, 2, 4, 16, 6
    q, kc, vc, _, tables = make_batch(rng, t=t, g=g, r=r, e=e, block_size=bs, lengths=[40, 40, 20])
    pos = np.array([[30, 31, 32, 33, 0, 0],  # 4 real tokens, then padding
                    [0, 0, 1, 2, 3, 4],  # dummy catch-up token, then positions 0..4
                    [0, 0, 0, 0, 0, 0]], np.int32)  # a padding row
    real = np.array([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], bool)
    pos = jnp.asarray(pos)
    assert bool(rows_are_single_runs(pos))
    np.testing.assert_array_equal(np.asarray(row_runs(pos)[0]), [0, 1, 5])
    kw = dict(block_size=bs, scale=e**-0.5)
    ref = np.asarray(paged_attention_xla(q, kc, vc, pos, tables, **kw))
    out = np.asarray(_ragged_with_reference(q, kc, vc, pos, tables, **kw))
    np.testing.assert_allclose(out[real], ref[real], rtol=2e-5, atol=2e-5)


def test_tpu_ragged_dispatch_takes_xla_for_other_layouts():
    """Two separate runs of real positions in a row: not one ragged sequence, so the XLA branch runs
    (interpret=True keeps the untaken kernel branch compilable on CPU)."""
    rng = np.random.default_rng(8)
    q, kc, vc, _, tables = make_batch(rng, t=4, g=1, r=4, e=64, block_size=16, lengths=[30, 30])
    pos = jnp.asarray([[3, 4, 10, 11], [26, 27, 28, 29]], jnp.int32)
    assert not bool(rows_are_single_runs(pos))
    kw = dict(block_size=16, scale=0.125)
    out = paged_attention(q, kc, vc, pos, tables, backend=backends.RAGGED_TPU, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_xla(q, kc, vc, pos, tables, **kw)))


def test_default_backend_on_cpu_is_xla():
    rng = np.random.default_rng(9)
    q, kc, vc, pos, tables = make_batch(rng, t=1, g=1, r=4, e=64, block_size=16, lengths=[12])
    kw = dict(block_size=16, scale=0.125)
    out = jax.jit(functools.partial(paged_attention, **kw))(q, kc, vc, pos, tables)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_xla(q, kc, vc, pos, tables, **kw)))


def _zeros(b, t, h, g, e, num_blocks, block_size, m, dtype=jnp.bfloat16):
    return (jnp.zeros((b, t, h, e), dtype), jnp.zeros((num_blocks * block_size, g, e), dtype),
            jnp.zeros((num_blocks * block_size, g, e), dtype), jnp.zeros((b, t), jnp.int32),
            jnp.zeros((b, m), jnp.int32))


def test_gpu_paged_decode_lowers_for_triton():
    """A Llama-3.2-1B-shaped decode (H 32, G 8, E 64) passes Pallas's Triton lowering."""
    fn = jax.jit(functools.partial(paged_attention, block_size=16, scale=0.125, backend=backends.PAGED_DECODE_GPU))
    text = fn.trace(*_zeros(8, 1, 32, 8, 64, 256, 16, 64)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("t", [1, 5])
def test_tpu_ragged_lowers_for_mosaic(t):
    """Our call of JAX's ragged kernel (E 64 padded to 128, G 8) passes Mosaic lowering for a v5e."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry") or not hasattr(tpu_info, "get_tpu_info_for_chip"):
        pytest.skip("this jax has no hook to name a TPU generation off-TPU")
    tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        # Tuned block sizes are looked up by TPU generation at trace time; name them here.
        fn = jax.jit(functools.partial(ragged_paged_attention_tpu, block_size=16, scale=0.125,
                                       num_kv_pages_per_block=8, num_queries_per_block=8))
        text = fn.trace(*_zeros(8, t, 32, 8, 64, 256, 16, 64)).lower(lowering_platforms=("tpu",)).as_text()
    finally:
        del tpu_info.registry["cpu"]
    assert text.count("tpu_custom_call") == 1
