"""The plain sampler: temperature / top-k / top-p transforms and exponential-race sampling.

Expected distributions are computed here in numpy from the definitions, never by
calling the code under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.sample.transforms import request_keys, sample_tokens, transform_logits

N_SAMPLES = 40_000


def _expected(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference distribution by the textbook definition (temperature, then top-k, then top-p)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    if 0 < top_k < len(p):
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1.0:
        cum = 0.0
        nucleus = np.zeros_like(keep)
        for idx in order:
            if p[idx] == 0:
                break
            nucleus[idx] = True
            cum += p[idx]
            if cum >= top_p:
                break
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def _draw(logits: np.ndarray, temperature: float, top_k: int, top_p: float, n: int = N_SAMPLES) -> np.ndarray:
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, logits.shape[0]))
    keys = request_keys(jax.random.key(7), jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
    fn = jax.jit(sample_tokens)
    tokens = fn(
        rows,
        jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32),
        jnp.full((n,), top_p, jnp.float32),
        keys,
    )
    return np.bincount(np.asarray(tokens), minlength=logits.shape[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6), (0.9, 5, 0.8), (1.0, -1, 1.0)],
)
def test_sampled_distribution_matches_definition(temperature, top_k, top_p):
    rng = np.random.default_rng(123)
    logits = rng.normal(size=8) * 1.5
    logits[2] = -np.inf  # a token that must never appear
    counts = _draw(logits, temperature, top_k, top_p)
    expected = _expected(logits, temperature, top_k, top_p)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the allowed set"
    chi2 = stats.chisquare(counts[support], expected[support] * counts.sum())
    assert chi2.pvalue > 1e-3, (counts, expected)
    tv = 0.5 * np.abs(counts / counts.sum() - expected).sum()
    assert tv < 0.02


def test_greedy_rows_take_raw_argmax_and_ignore_filters():
    logits = jnp.asarray([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]], jnp.float32)
    keys = request_keys(jax.random.key(0), jnp.arange(2, dtype=jnp.uint32), jnp.zeros(2, jnp.int32))
    out = sample_tokens(logits, jnp.zeros(2), jnp.asarray([1, 1], jnp.int32), jnp.asarray([0.1, 0.1]), keys)
    np.testing.assert_array_equal(np.asarray(out), [1, 0])


def test_top_k_top_p_mask_shapes_and_membership():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 16)).astype(np.float32)  # [B, T, V]
    top_k = np.asarray([0, 4, 2], np.int32)
    top_p = np.asarray([0.5, 1.0, 0.9], np.float32)
    out = np.asarray(transform_logits(jnp.asarray(logits), jnp.ones(3), jnp.asarray(top_k), jnp.asarray(top_p)))
    for b in range(3):
        for t in range(5):
            kept = np.isfinite(out[b, t])
            ref = _expected(logits[b, t].astype(np.float64), 1.0, int(top_k[b]), float(top_p[b])) > 0
            np.testing.assert_array_equal(kept, ref)


@pytest.mark.parametrize("scale, cases, fast", [
    (4.0, [(5, 1.0), (0, 0.9), (50, 0.95), (0, 0.99), (3, 0.2), (0, 0.5)], True),  # every row closes early
    (4.0, [(0, 0.5), (300, 1.0), (400, 0.7), (3, 0.2)], False),  # top-k past the candidates
    (0.3, [(0, 0.9), (50, 0.95), (0, 0.99), (3, 0.2)], False),  # flat rows: the nucleus runs past them
])
def test_top_k_top_p_past_the_candidates_matches_the_definition(scale, cases, fast):
    """V = 1000 > TOP_CANDIDATES: thresholds from the largest candidates when every row's filters close within
    them, else one full sort for the batch; either way the kept set is the textbook one."""
    from pallas_kernels.sampling_ops import TOP_CANDIDATES, _top_k_top_p_sorted

    rng = np.random.default_rng(len(cases))
    vocab = 1000
    logits = jnp.asarray((scale * rng.normal(size=(len(cases), 2, vocab))).astype(np.float32))  # [B, T, V]
    top_k = jnp.asarray([k for k, _ in cases], jnp.int32)
    top_p = jnp.asarray([p for _, p in cases], jnp.float32)
    _, closed = _top_k_top_p_sorted(logits, jax.lax.top_k(logits, TOP_CANDIDATES)[0], top_k, top_p)
    assert bool(jnp.all(closed)) == fast  # the path this case is meant to cover
    out = np.asarray(jax.jit(transform_logits)(logits, jnp.ones(len(cases)), top_k, top_p))
    for b, (k, p) in enumerate(cases):
        for t in range(2):
            ref = _expected(np.asarray(logits[b, t], np.float64), 1.0, k, p) > 0
            np.testing.assert_array_equal(np.isfinite(out[b, t]), ref, err_msg=str(cases[b]))


def test_seeded_rows_are_batch_invariant():
    """A row's sample depends only on its own key, not on its neighbours or its row index."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(6, 32)), jnp.float32)
    seeds = jnp.asarray([11, 12, 13, 14, 15, 16], jnp.uint32)
    steps = jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32)
    keys = request_keys(jax.random.key(3), seeds, steps)
    full = np.asarray(sample_tokens(logits, jnp.ones(6), None, None, keys))
    perm = np.asarray([4, 0, 5])
    sub_keys = request_keys(jax.random.key(3), seeds[perm], steps[perm])
    sub = np.asarray(sample_tokens(logits[perm], jnp.ones(3), None, None, sub_keys))
    np.testing.assert_array_equal(sub, full[perm])



def test_zero_exponential_noise_never_picks_a_masked_token(monkeypatch):
    """exponential() can return exactly 0 (p ~ 2**-23); the race must not turn that into NaN or a masked token."""
    monkeypatch.setattr(jax.random, "exponential", lambda key, shape, dtype: jnp.zeros(shape, dtype))
    logits = jnp.asarray([[0.0, -jnp.inf, 1.0, -jnp.inf]] * 4, jnp.float32)
    keys = request_keys(jax.random.key(0), jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32))
    tokens = np.asarray(sample_tokens(logits, jnp.ones(4), None, None, keys))
    assert set(tokens.tolist()) <= {0, 2}


def test_draft_draws_skip_the_sampler_only_when_no_row_samples():
    from specjax.spec_decode.drafting import draw_draft

    logits = jax.random.normal(jax.random.key(1), (3, 50)) * 3.0
    keys = request_keys(jax.random.key(0), jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3, jnp.int32))
    top_k, top_p = jnp.zeros(3, jnp.int32), jnp.ones(3)
    draw = jax.jit(lambda t: draw_draft(logits, t, top_k, top_p, keys, probabilistic=True))
    ids, q = draw(jnp.zeros(3))  # all greedy: argmax drafts, no distribution (the verifier ignores it)
    np.testing.assert_array_equal(np.asarray(ids), np.argmax(np.asarray(logits), axis=-1))
    assert not np.asarray(q).any()
    temperature = jnp.asarray([0.0, 0.7, 1.0])
    ids, q = draw(temperature)  # one greedy row beside two sampling rows: q is each sampling row's softmax
    assert int(ids[0]) == int(np.argmax(np.asarray(logits[0])))
    expected = jax.nn.softmax(np.asarray(logits[1:]) / np.asarray(temperature[1:, None]), axis=-1)
    np.testing.assert_allclose(np.asarray(q[1:]), np.asarray(expected), rtol=1e-5, atol=1e-7)
    assert all(0 <= int(i) < 50 for i in np.asarray(ids))
