"""The sampler's random numbers: JAX's Threefry-2x32, bit for bit, without XLA:CPU's rolled loop.

On CPU, JAX lowers its Threefry hash as a five-iteration while loop (it keeps compile times short). XLA:CPU
fuses nothing across that loop and copies its state every iteration, and a sampled speculative step hashes
many times: folding keys per row, per draft and per verified position, and drawing noise over the vocabulary
for every draft and the verifier. In a traced EAGLE-3 K = 2 sampled batch-1 step on the shipped pair, the
loops' state copies alone took ~0.24 ms of ~2.2 ms. The functions here compute the same hash unrolled, in
element-wise jnp ops that XLA fuses: drawing Exp(1) noise over 4096 tokens for 32 rows took 0.33 ms against
1.35 ms with ``jax.random.exponential`` (one jitted call each, this project's 2-vCPU CPU).

They are bit-identical to ``jax.random`` (``fold_in``, ``split``, ``uniform``, ``exponential``) for its default
``threefry2x32`` keys under ``jax_threefry_partitionable`` (JAX's default; tested), so seeded outputs do not
change. Keys of another implementation, the non-partitionable layout, other platforms (GPU and TPU lower
JAX's hash unrolled already) and processes with several devices go through ``jax.random`` itself: with 8
forced host devices on 2 cores, a tensor-parallel (tp 4) greedy run with the unrolled hash stopped in a
collective rendezvous (XLA's 600 s timeout) in 1 of 2 runs beside a busy process, against 0 of 3 with
``jax.random``, though both programs hold the same collectives (the loops' removal changes how XLA:CPU's
thunks interleave; not understood yet).
Every function takes typed keys of any batch shape ``[...]`` and works element-wise over it (no vmap needed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

UNROLLED = True
"""Off: every function calls ``jax.random`` (read when a step is traced; for ``benchmarks/bench_noise.py``'s A/B
only)."""

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 hash (20 rounds) of counters ``(x0, x1)`` under key ``(k0, k1)``, element-wise with
    broadcasting; uint32 throughout."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


@functools.cache
def _one_cpu_device() -> bool:
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def _unrolled(keys: jax.Array) -> bool:
    """Use the unrolled hash for these keys: it reproduces ``jax.random`` for them, on one CPU device (see the
    module docstring)."""
    return (UNROLLED and _one_cpu_device() and str(jax.random.key_impl(keys)) == "threefry2x32"
            and bool(jax.config.jax_threefry_partitionable))


def _halves(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    data = jax.random.key_data(keys)  # uint32 [..., 2]
    return data[..., 0], data[..., 1]


def fold_in(keys: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in(key, d)`` for each key of ``keys [...]`` and ``data`` (int, broadcast against the
    keys' shape; taken as uint32): typed keys of the broadcast shape."""
    data = jnp.asarray(data).astype(jnp.uint32)
    if not _unrolled(keys):
        shape = jnp.broadcast_shapes(keys.shape, data.shape)
        flat = jax.vmap(jax.random.fold_in)(jnp.broadcast_to(keys, shape).reshape(-1),
                                            jnp.broadcast_to(data, shape).reshape(-1))
        return flat.reshape(shape)
    k0, k1 = _halves(keys)
    y0, y1 = _threefry2x32(k0, k1, jnp.zeros_like(data), data)  # the seed of a uint32 d is (0, d)
    return jax.random.wrap_key_data(jnp.stack(jnp.broadcast_arrays(y0, y1), axis=-1), impl="threefry2x32")


def split2(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``jax.random.split(key)`` for each key of ``keys [...]``: its two halves, typed keys ``[...]`` each."""
    if not _unrolled(keys):
        both = jax.vmap(jax.random.split)(keys.reshape(-1))  # [N, 2]
        return both[:, 0].reshape(keys.shape), both[:, 1].reshape(keys.shape)
    return fold_in(keys, 0), fold_in(keys, 1)  # (partitionable threefry: split(key)[i] == fold_in(key, i))


def _bits(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 ``[..., *shape]``: ``jax.random.bits(key, shape)`` for each key (unrolled keys only)."""
    size = int(np.prod(shape))
    if size >= 2**32:
        raise ValueError(f"shape: at most 2**32 - 1 values a key, got {shape}")
    k0, k1 = _halves(keys)
    k0 = k0.reshape(k0.shape + (1,) * len(shape))
    k1 = k1.reshape(k1.shape + (1,) * len(shape))
    counts = jax.lax.iota(jnp.uint32, size).reshape(shape)  # the flat index's low word (its high word is 0)
    b0, b1 = _threefry2x32(k0, k1, jnp.zeros_like(counts), counts)
    return b0 ^ b1


def uniform(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 ``[..., *shape]`` in [0, 1): ``jax.random.uniform(key, shape)`` for each key of ``keys [...]``."""
    if not _unrolled(keys):
        flat = jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys.reshape(-1))
        return flat.reshape(keys.shape + tuple(shape))
    # 23 random mantissa bits under exponent 0: a float in [1, 2), minus 1 (as jax.random.uniform does).
    one = np.float32(1.0).view(np.uint32)
    floats = jax.lax.bitcast_convert_type((_bits(keys, shape) >> np.uint32(9)) | one, jnp.float32) - np.float32(1.0)
    return jnp.maximum(np.float32(0.0), floats)


def exponential(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 ``[..., *shape]`` Exp(1) noise: ``jax.random.exponential(key, shape)`` for each key of
    ``keys [...]``."""
    if not _unrolled(keys):
        flat = jax.vmap(lambda k: jax.random.exponential(k, shape, jnp.float32))(keys.reshape(-1))
        return flat.reshape(keys.shape + tuple(shape))
    return -jnp.log1p(-uniform(keys, shape))
