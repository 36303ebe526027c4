"""The sampler's unrolled Threefry (specjax.sample.prng) against jax.random, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sample import prng


def _raw(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _keys(n, impl=None):
    base = jax.random.key(7, impl=impl)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n, dtype=jnp.uint32))


@pytest.mark.parametrize("impl", [None, "rbg"])  # the default threefry (unrolled) and another (jax.random)
def test_fold_in_and_split_match_jax_random(impl):
    keys = _keys(6, impl)
    data = jnp.asarray([0, 1, 5, 2**31 + 3, 0xFFFFFFFF, 44], jnp.uint32)
    assert np.array_equal(_raw(prng.fold_in(keys, data)), _raw(jax.vmap(jax.random.fold_in)(keys, data)))
    one = jax.random.key(3, impl=impl)  # one key, [5] data: broadcast
    assert np.array_equal(_raw(prng.fold_in(one, jnp.arange(5))),
                          _raw(jax.vmap(lambda i: jax.random.fold_in(one, i))(jnp.arange(5, dtype=jnp.uint32))))
    first, second = prng.split2(keys)
    both = jax.vmap(jax.random.split)(keys)
    assert np.array_equal(_raw(first), _raw(both[:, 0])) and np.array_equal(_raw(second), _raw(both[:, 1]))


@pytest.mark.parametrize("impl", [None, "rbg"])
@pytest.mark.parametrize("shape", [(5,), (4097,), (3, 7), (49152,)])
def test_uniform_and_exponential_match_jax_random(impl, shape):
    keys = _keys(3, impl)
    ref_u = jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys)
    ref_e = jax.vmap(lambda k: jax.random.exponential(k, shape, jnp.float32))(keys)
    got_u, got_e = jax.jit(lambda k: (prng.uniform(k, shape), prng.exponential(k, shape)))(keys)
    assert got_u.shape == got_e.shape == (3, *shape)
    assert np.array_equal(_raw(got_u), _raw(ref_u)) and np.array_equal(_raw(got_e), _raw(ref_e))


def test_the_compiled_noise_has_no_loop_on_cpu():
    # The point of the module: XLA:CPU gets jax.random's Threefry as a while loop, ours as straight-line code.
    keys = _keys(4)
    ours = jax.jit(lambda k: prng.exponential(prng.fold_in(k, 3), (4096,))).lower(keys).compile().as_text()
    theirs = jax.jit(lambda k: jax.vmap(lambda kk: jax.random.exponential(jax.random.fold_in(kk, 3), (4096,)))(k))
    assert " while(" in theirs.lower(keys).compile().as_text()
    assert " while(" not in ours
