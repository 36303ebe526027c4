"""The batched XLA path for token-wise verification gives exactly the per-row reference's outputs."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rejection import rejection_sample_reference, standard_verify_xla


def _case(seed, b, k, v, with_probs, filters):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32) * 2
    logits[0, 0, :3] = -np.inf  # masked tokens
    if b > 2:
        logits[2, 1] = np.nan  # a poisoned position must still give in-range ids
    # Drafts: half from the target's argmax (so some rows accept several), half random.
    draft = np.where(rng.random((b, k)) < 0.5, logits[:, :k].argmax(-1), rng.integers(0, v, (b, k))).astype(np.int32)
    num = rng.integers(0, k + 1, b).astype(np.int32)
    probs = None
    if with_probs:
        q = rng.random((b, k, v)).astype(np.float32) ** 3
        q[:, :, 0] = 0.0  # zero-probability draft tokens
        probs = jnp.asarray(q / q.sum(-1, keepdims=True))
    temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0, 1.5], b), jnp.float32)
    top_k = jnp.asarray(rng.integers(0, 5, b), jnp.int32) if filters else None
    top_p = jnp.asarray(rng.choice([1.0, 0.8], b), jnp.float32) if filters else None
    uniforms = jnp.asarray(rng.random((b, k)), jnp.float32)
    exps = jnp.asarray(rng.exponential(size=(b, v)), jnp.float32)
    return (jnp.asarray(draft), jnp.asarray(num), jnp.asarray(logits), probs, temperature, top_k, top_p, uniforms,
            exps)


@pytest.mark.parametrize("b,k,v,with_probs,filters", [
    (b, k, v, wp, f) for (b, k, v), wp, f in itertools.product([(3, 1, 8), (6, 4, 33), (16, 3, 257)],
                                                             [False, True], [False, True])
])
def test_xla_path_equals_reference(b, k, v, with_probs, filters):
    for seed in range(3):
        args = _case(seed, b, k, v, with_probs, filters)
        ref_out, ref_num = rejection_sample_reference(*args, method="standard")
        out, num = standard_verify_xla(*args)
        np.testing.assert_array_equal(np.asarray(num), np.asarray(ref_num))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
        assert ((np.asarray(out) >= -1) & (np.asarray(out) < v)).all()
