"""Pallas rejection kernels (interpret mode on CPU) == their jnp references, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rejection import rejection_sample_kernel, rejection_sample_reference
from specjax.sample.rejection import conditional_acceptance_rates, rejection_sample_with_counts

# (B, K, V, logits dtype, method, draft_probs given, top-k/top-p given): a covering subset of the product.
CASES = [
    (1, 1, 16, jnp.float32, "standard", False, False),
    (3, 3, 128, jnp.float32, "standard", True, True),
    (3, 3, 16, jnp.bfloat16, "standard", False, True),
    (2, 4, 128, jnp.bfloat16, "standard", True, False),
    (1, 1, 128, jnp.bfloat16, "block", True, False),
    (3, 3, 16, jnp.float32, "block", False, True),
    (2, 4, 16, jnp.float32, "block", True, True),
    (3, 2, 16, jnp.bfloat16, "synthetic", False, False),
]


def make_inputs(b, k, v, dtype, with_q, with_filters, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, k + 1, v)) * 2.0
    logits[0, 0, : v // 4] = -np.inf  # zero-probability tokens
    if b > 1:
        logits[1, -1, 1] = np.nan  # must be sanitized identically
    q = rng.dirichlet(np.ones(v) * 0.3, (b, k)).astype(np.float32) if with_q else None
    # Drafts: mostly the target's mode so that acceptance, mid rejection and bonus all occur.
    draft = np.where(rng.random((b, k)) < 0.7, np.argmax(np.nan_to_num(logits[:, :k], nan=-np.inf), -1),
                     rng.integers(0, v, (b, k))).astype(np.int32)
    num = rng.integers(0, k + 1, b).astype(np.int32)
    num[-1] = k
    temp = rng.choice([0.0, 0.6, 1.0, 1.7], b).astype(np.float32)
    temp[0] = 1.0
    top_k = rng.integers(0, v // 2, b).astype(np.int32) if with_filters else None
    top_p = rng.choice([0.5, 0.9, 1.0], b).astype(np.float32) if with_filters else None
    uniforms = rng.random((b, k), dtype=np.float32)
    exps = rng.exponential(size=(b, v)).astype(np.float32)
    return (jnp.asarray(draft), jnp.asarray(num), jnp.asarray(logits, dtype), None if q is None else jnp.asarray(q),
            jnp.asarray(temp), None if top_k is None else jnp.asarray(top_k),
            None if top_p is None else jnp.asarray(top_p), jnp.asarray(uniforms), jnp.asarray(exps))


@pytest.mark.parametrize("b,k,v,dtype,method,with_q,with_filters", CASES,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-{jnp.dtype(c[3]).name}-{c[4]}-q{int(c[5])}-f{int(c[6])}"
                              for c in CASES])
def test_kernel_matches_reference(b, k, v, dtype, method, with_q, with_filters):
    rates = jnp.asarray(conditional_acceptance_rates(np.linspace(0.9, 0.4, k))) if method == "synthetic" else None
    for seed in range(3):
        args = make_inputs(b, k, v, dtype, with_q, with_filters, seed) + (rates,)
        out_k, num_k = rejection_sample_kernel(*args, method=method, interpret=True)
        out_r, num_r = rejection_sample_reference(*args, method=method)
        np.testing.assert_array_equal(np.asarray(out_k), np.asarray(out_r))
        np.testing.assert_array_equal(np.asarray(num_k), np.asarray(num_r))
        assert out_k.shape == (b, k + 1) and num_k.shape == (b,)
        out = np.asarray(out_k)
        assert np.all((out == -1) | ((out >= 0) & (out < v)))


def test_front_end_kernel_path_matches_jnp_path():
    b, k, v = 4, 3, 32
    draft, num, logits, q, temp, top_k, top_p, _, _ = make_inputs(b, k, v, jnp.float32, True, True, 7)
    kw = dict(temperature=temp, top_k=top_k, top_p=top_p, key=jax.random.key(11), method="block")
    out_k, acc_k = rejection_sample_with_counts(draft, num, logits, q, use_kernel=True, interpret=True, **kw)
    out_r, acc_r = rejection_sample_with_counts(draft, num, logits, q, use_kernel=False, **kw)
    np.testing.assert_array_equal(np.asarray(out_k), np.asarray(out_r))
    np.testing.assert_array_equal(np.asarray(acc_k), np.asarray(acc_r))


def test_kernel_checks_shapes():
    args = list(make_inputs(2, 3, 16, jnp.float32, False, False, 0)) + [None]
    args[7] = args[7][:, :2]  # uniforms [B, K-1]
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample_kernel(*args, method="standard", interpret=True)
