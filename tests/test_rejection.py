"""Rejection sampler front end: exact vectors, validation, keys, and property tests.

Expected values are derived here from the inputs (numpy argmax, an independent
numpy top-k/top-p), never from running the code under test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specjax.sample.rejection import (
    conditional_acceptance_rates,
    rejection_sample,
    rejection_sample_jit,
    rejection_sample_with_counts,
    row_keys,
)
from specjax.sample.transforms import request_keys, sample_tokens

NEG_INF = float("-inf")


def logits_with_argmax(argmax_ids, vocab):
    """[B, T, V] logits whose argmax at [b, t] is argmax_ids[b][t]."""
    ids = np.asarray(argmax_ids)
    out = np.full(ids.shape + (vocab,), -2.0, np.float32)
    np.put_along_axis(out, ids[..., None], 3.0, axis=-1)
    return out


# Most tests share one shape and always pass top_k/top_p (possibly "off"), so the
# jitted sampler compiles once per (method, draft_probs given) for the whole file.
B, K, V = 4, 3, 8
OFF_K = np.zeros(B, np.int32)
OFF_P = np.ones(B, np.float32)


def run(draft, num, logits, q=None, *, temperature, top_k=OFF_K, top_p=OFF_P, key=None, method="standard",
        rates=(0.8, 0.5, 0.5)):
    out, acc = rejection_sample_with_counts(
        draft, num, logits, q, temperature=temperature, top_k=top_k, top_p=top_p,
        key=jax.random.key(0) if key is None else key, method=method, synthetic_acceptance_rates=rates)
    return np.asarray(out), np.asarray(acc)


# ---------------------------------------------------------------------------
# Greedy exact vectors (vLLM's greedy cases) for every method that verifies.
# ---------------------------------------------------------------------------

# Rows of (draft [K], num_draft, target argmax [K+1], expected output [K+1]).
GREEDY_ROWS = [
    ([1, 2, 3], 3, [1, 5, 3, 4], [1, 5, -1, -1]),  # mid mismatch (vLLM's vector)
    ([1, 2, 3], 3, [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted + bonus
    ([1, 2, 3], 3, [7, 2, 3, 4], [7, -1, -1, -1]),  # first mismatch
    ([1, 2, 3], 0, [6, 2, 3, 4], [6, -1, -1, -1]),  # no drafts: bonus at position 0
    ([1, 2, 6], 2, [1, 2, 7, 0], [1, 2, 7, -1]),  # drafts beyond n ignored, bonus at n
    ([3, 4, 0], 1, [3, 6, 6, 6], [3, 6, -1, -1]),  # single draft accepted
    ([5, 6, 0], 2, [0, 6, 6, 1], [0, -1, -1, -1]),  # later match does not matter
    ([5, 5, 5], 3, [5, 5, 5, 5], [5, 5, 5, 5]),  # repeated tokens
]


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("half", [0, 1])
def test_greedy_exact_vectors(method, half):
    rows = GREEDY_ROWS[half * B:(half + 1) * B]
    draft = np.array([r[0] for r in rows], np.int32)
    num = np.array([r[1] for r in rows], np.int32)
    logits = logits_with_argmax([r[2] for r in rows], V)
    expected = np.array([r[3] for r in rows])
    out, acc = run(draft, num, logits, temperature=np.zeros(B, np.float32), method=method)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(acc, (expected != -1).sum(1) - 1)


def test_output_dtype_and_plain_call():
    out = rejection_sample(np.array([[1, 2, 3]]), np.array([3]), logits_with_argmax([[1, 5, 3, 4]], 10),
                           temperature=np.zeros(1), key=jax.random.key(0))
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), [[1, 5, -1, -1]])


def test_greedy_ignores_temperature_topk_topp_and_neighbours():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    draft = np.argmax(logits[:, :K], -1).astype(np.int32)
    draft[1, 1] = (draft[1, 1] + 1) % V
    num = np.array([3, 3, 2, 1], np.int32)
    keys = jax.random.split(jax.random.key(3), B)
    base, _ = run(draft, num, logits, temperature=np.zeros(B), key=keys)
    mixed, _ = run(draft, num, logits, temperature=np.array([0.0, 0.0, 2.0, 0.7]),
                   top_k=np.array([1, 2, 3, 0]), top_p=np.array([0.1, 0.3, 1.0, 0.5]), key=keys)
    np.testing.assert_array_equal(mixed[:2], base[:2])
    np.testing.assert_array_equal(base[0], np.argmax(logits[0], -1))
    np.testing.assert_array_equal(base[1], list(np.argmax(logits[1, :2], -1)) + [-1, -1])


# ---------------------------------------------------------------------------
# Random rows: deterministic corner cases.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["standard", "block"])
def test_one_hot_target_accepts_exactly_its_token(method):
    # Target puts all mass on token 2 at every position.
    logits = np.full((B, K + 1, V), NEG_INF, np.float32)
    logits[:, :, 2] = 0.0
    draft = np.array([[2, 2, 2], [2, 4, 2], [5, 2, 2], [2, 2, 7]], np.int32)
    out, _ = run(draft, np.array([2, 2, 2, 3]), logits, temperature=np.ones(B), key=jax.random.key(1),
                 method=method)
    np.testing.assert_array_equal(out, [[2, 2, 2, -1], [2, 2, -1, -1], [2, -1, -1, -1], [2, 2, 2, -1]])


@pytest.mark.parametrize("method", ["standard", "block"])
def test_zero_draft_probability_is_never_accepted(method):
    logits = np.zeros((B, K + 1, V), np.float32)  # uniform target
    draft = np.full((B, K), 3, np.int32)
    q = np.full((B, K, V), 1.0 / (V - 1), np.float32)
    q[:, :, 3] = 0.0  # the draft token has q = 0
    for seed in range(4):
        out, acc = run(draft, np.array([1, 2, 3, 3]), logits, q, temperature=np.ones(B),
                       key=jax.random.key(seed), method=method)
        assert np.all(acc == 0)
        # The residual max(p - q, 0) is concentrated on token 3.
        assert np.all(out[:, 0] == 3) and np.all(out[:, 1:] == -1)


def test_zero_draft_row_matches_plain_sampler():
    """A row without drafts draws its bonus like sample_tokens with the row's sampling subkey."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(B, K + 1, V)).astype(np.float32) * 2
    temp = np.array([0.0, 1.0, 0.5, 1.5], np.float32)
    top_k = np.array([0, 5, 0, 3], np.int32)
    top_p = np.array([1.0, 0.9, 0.7, 1.0], np.float32)
    for seed in range(3):
        keys = jax.random.split(jax.random.key(seed), B)
        out, _ = run(rng.integers(0, V, (B, K)), np.zeros(B, np.int32), logits, temperature=temp,
                     top_k=top_k, top_p=top_p, key=keys)
        sample_keys = jax.vmap(jax.random.split)(keys)[:, 1]
        plain = sample_tokens(jnp.asarray(logits[:, 0]), jnp.asarray(temp), jnp.asarray(top_k),
                              jnp.asarray(top_p), sample_keys)
        np.testing.assert_array_equal(out[:, 0], np.asarray(plain))
        assert np.all(out[:, 1:] == -1)


# ---------------------------------------------------------------------------
# Synthetic acceptance.
# ---------------------------------------------------------------------------


def test_conditional_rates():
    np.testing.assert_allclose(conditional_acceptance_rates([0.8, 0.4, 0.0]), [0.8, 0.5, 0.0])
    np.testing.assert_allclose(conditional_acceptance_rates([0.5, 0.0, 0.0]), [0.5, 0.0, 0.0])
    np.testing.assert_allclose(conditional_acceptance_rates([1.0, 1.0]), [1.0, 1.0])


def test_synthetic_acceptance_profile():
    b, k, v = 8000, 3, 16
    rates = np.array([0.9, 0.6, 0.3])
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    draft = rng.integers(0, v, (b, k)).astype(np.int32)
    temp = np.where(np.arange(b) % 2 == 0, 0.0, 1.0).astype(np.float32)
    out, acc = rejection_sample_with_counts(draft, np.full(b, k, np.int32), logits, temperature=temp,
                                            key=jax.random.key(0), method="synthetic",
                                            synthetic_acceptance_rates=rates)
    out, acc = np.asarray(out), np.asarray(acc)
    for i in range(1, k + 1):
        frac = np.mean(acc >= i)
        assert abs(frac - rates[i - 1]) < 4 * np.sqrt(rates[i - 1] * (1 - rates[i - 1]) / b) + 1e-3
    # Accepted prefix is the draft, whether or not the target agrees.
    rows = np.arange(b)
    for i in range(k):
        sel = acc > i
        np.testing.assert_array_equal(out[sel, i], draft[sel, i])
    # Greedy rows emit the target argmax after the accepted prefix.
    greedy = temp == 0
    np.testing.assert_array_equal(out[rows, acc][greedy], np.argmax(logits, -1)[rows, acc][greedy])


def test_synthetic_extremes():
    logits = np.zeros((B, K + 1, V), np.float32)
    draft = np.ones((B, K), np.int32)
    full, acc = run(draft, np.full(B, K), logits, temperature=np.ones(B), method="synthetic", rates=[1.0, 1.0, 1.0])
    assert np.all(full[:, :K] == 1) and np.all(acc == K)
    none, acc = run(draft, np.full(B, K), logits, temperature=np.ones(B), method="synthetic", rates=[0.0, 0.0, 0.0])
    # Rejected at 0: the recovered token comes from max(p - onehot(1), 0), never the draft.
    assert np.all(none[:, 1:] == -1) and np.all(none[:, 0] != 1) and np.all(acc == 0)


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


def _good_args():
    b, k, v = 2, 3, 8
    return dict(
        draft_token_ids=np.zeros((b, k), np.int32),
        num_draft_tokens=np.array([3, 1], np.int32),
        target_logits=np.zeros((b, k + 1, v), np.float32),
        draft_probs=None,
        temperature=np.ones(b, np.float32),
        key=jax.random.key(0),
    )


BAD = [
    ("draft_token_ids", dict(draft_token_ids=np.zeros((2,), np.int32))),
    ("target_logits", dict(target_logits=np.zeros((2, 3, 8), np.float32))),  # K+1 mismatch
    ("target_logits", dict(target_logits=np.zeros((3, 4, 8), np.float32))),  # batch mismatch
    ("num_draft_tokens", dict(num_draft_tokens=np.array([4, 0], np.int32))),
    ("num_draft_tokens", dict(num_draft_tokens=np.array([-1, 0], np.int32))),
    ("num_draft_tokens", dict(num_draft_tokens=np.array([1, 1, 1], np.int32))),
    ("draft_token_ids", dict(draft_token_ids=np.array([[0, 8, 0], [0, 0, 0]], np.int32))),
    ("draft_token_ids", dict(draft_token_ids=np.array([[0, 0, 0], [-1, 0, 0]], np.int32))),
    ("draft_probs", dict(draft_probs=np.zeros((2, 3, 7), np.float32))),
    ("temperature", dict(temperature=np.array([1.0, -0.5], np.float32))),
    ("temperature", dict(temperature=np.ones(3, np.float32))),
    ("top_k", dict(top_k=np.array([1, -2], np.int32))),
    ("top_p", dict(top_p=np.array([0.0, 0.5], np.float32))),
    ("top_p", dict(top_p=np.array([1.5, 0.5], np.float32))),
    ("method", dict(method="typical")),
    ("synthetic_acceptance_rates", dict(method="synthetic")),
    ("synthetic_acceptance_rates", dict(method="synthetic", synthetic_acceptance_rates=[0.5, 0.4])),
    ("synthetic_acceptance_rates", dict(method="synthetic", synthetic_acceptance_rates=[0.5, 0.6, 0.1])),
    ("synthetic_acceptance_rates", dict(method="synthetic", synthetic_acceptance_rates=[1.2, 0.6, 0.1])),
    ("synthetic_acceptance_rates", dict(method="synthetic", synthetic_acceptance_rates=[0.5, 0.4, -0.1])),
    ("key", dict(key=jax.random.split(jax.random.key(0), 3))),
]


@pytest.mark.parametrize("name,override", BAD, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD)])
def test_invalid_inputs_raise(name, override):
    args = _good_args() | override
    with pytest.raises(ValueError, match=name):
        rejection_sample(
            args.pop("draft_token_ids"), args.pop("num_draft_tokens"), args.pop("target_logits"),
            args.pop("draft_probs"), **args)


def test_padding_draft_ids_beyond_num_are_not_checked():
    draft = np.array([[0, 1, 2], [3, -1, -1], [-1, -1, -1], [1, 2, 99]], np.int32)
    out, _ = run(draft, np.array([3, 1, 0, 2]), np.zeros((B, K + 1, V), np.float32), temperature=np.ones(B))
    assert out.shape == (B, K + 1)


# ---------------------------------------------------------------------------
# NaN / inf robustness.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method,with_q", [("standard", False), ("block", True), ("synthetic", False),
                                           ("standard", True)])
def test_nan_and_inf_logits_give_in_range_ids(method, with_q):
    rng = np.random.default_rng(1)
    for trial in range(2):
        logits = rng.normal(size=(B, K + 1, V)).astype(np.float32)
        logits[0] = np.nan if trial == 0 else NEG_INF
        logits[1, 0, 3] = np.nan
        logits[2, :, :5] = np.nan
        logits[3, 1, 4] = np.inf
        q = rng.dirichlet(np.ones(V), (B, K)).astype(np.float32) if with_q else None
        if with_q:
            q[2] = np.nan
        temp = np.array([1.0, 0.0, 1.0, 0.5], np.float32)
        out, _ = run(rng.integers(0, V, (B, K)), np.full(B, K), logits, q, temperature=temp,
                     top_p=np.full(B, 0.9, np.float32), method=method)
        assert np.all((out == -1) | ((out >= 0) & (out < V)))
        assert np.all(out[:, 0] >= 0)
        if method != "synthetic":
            # Row 1 is greedy: position 0's argmax ignores the NaN.
            assert out[1, 0] == np.argmax(np.where(np.isnan(logits[1, 0]), -np.inf, logits[1, 0]))


# ---------------------------------------------------------------------------
# Keys: determinism, key forms, batch invariance, use inside jit.
# ---------------------------------------------------------------------------


def _random_batch(seed, b=B, k=K, v=V):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(b, k + 1, v)) * 1.5).astype(np.float32)
    q = rng.dirichlet(np.ones(v) * 0.5, (b, k)).astype(np.float32)
    draft = np.array([[rng.choice(v, p=q[i, j] / q[i, j].sum()) for j in range(k)] for i in range(b)], np.int32)
    num = rng.integers(1, k + 1, b).astype(np.int32)
    temp = np.array([0.0, 1.0, 0.7, 1.3], np.float32)[:b]
    return draft, num, logits, q, temp


@pytest.mark.parametrize("method", ["standard", "block"])
def test_key_forms_and_batch_invariance(method):
    draft, num, logits, q, temp = _random_batch(0)
    key = jax.random.key(42)
    kw = dict(temperature=temp, method=method)
    out, _ = run(draft, num, logits, q, key=key, **kw)
    np.testing.assert_array_equal(out, run(draft, num, logits, q, key=key, **kw)[0])
    per_row = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(B, dtype=jnp.uint32))
    np.testing.assert_array_equal(out, run(draft, num, logits, q, key=per_row, **kw)[0])
    raw = np.asarray(jax.random.key_data(per_row))  # uint32 [B, 2]
    np.testing.assert_array_equal(out, run(draft, num, logits, q, key=raw, **kw)[0])
    raw_single = np.asarray(jax.random.key_data(key))  # uint32 [2]
    np.testing.assert_array_equal(out, run(draft, num, logits, q, key=raw_single, **kw)[0])
    # Rows 2 and 0 placed in another batch (new positions, new neighbours) with their own keys.
    d2, n2, l2, q2, t2 = _random_batch(1)
    d2[[1, 3]], n2[[1, 3]], l2[[1, 3]], q2[[1, 3]], t2[[1, 3]] = draft[[2, 0]], num[[2, 0]], logits[[2, 0]], \
        q[[2, 0]], temp[[2, 0]]
    keys2 = jax.random.split(jax.random.key(5), B).at[jnp.array([1, 3])].set(per_row[jnp.array([2, 0])])
    out2, _ = run(d2, n2, l2, q2, temperature=t2, key=keys2, method=method)
    np.testing.assert_array_equal(out2[[1, 3]], out[[2, 0]])
    # Another key changes some random row over a few tries.
    assert any(not np.array_equal(run(draft, num, logits, q, key=jax.random.key(43 + s), **kw)[0], out)
               for s in range(5))


def test_jit_inner_matches_front_end():
    draft, num, logits, q, temp = _random_batch(1)
    keys = request_keys(jax.random.key(7), jnp.arange(B), jnp.full((B,), 3))

    @jax.jit
    def step(logits, keys):
        return rejection_sample_jit(jnp.asarray(draft), jnp.asarray(num), logits, jnp.asarray(q),
                                    jnp.asarray(temp), jnp.asarray(OFF_K), jnp.asarray(OFF_P), keys,
                                    method="standard", use_kernel=False)

    out, acc = step(jnp.asarray(logits), keys)
    ref, ref_acc = run(draft, num, logits, q, temperature=temp, key=keys)
    np.testing.assert_array_equal(np.asarray(out), ref)
    np.testing.assert_array_equal(np.asarray(acc), ref_acc)
    assert row_keys(jax.random.key(0), 3).shape == (3,)


# ---------------------------------------------------------------------------
# Property tests.
# ---------------------------------------------------------------------------


def allowed_tokens(logits_row, temperature, top_k, top_p):
    """Independent numpy support of temperature -> top-k -> top-p (ties kept), with slack at the top-p edge."""
    s = logits_row.astype(np.float64) / temperature
    finite = s > -np.inf
    if not finite.any():
        return None
    v = s.shape[0]
    keep = finite.copy()
    if 0 < top_k < v:
        kth = np.sort(s)[::-1][top_k - 1]
        keep &= s >= kth
    if top_p < 1.0:
        masked = np.where(keep, s, -np.inf)
        w = np.exp(masked - masked.max())
        w /= w.sum()
        mass_greater = np.array([w[masked > masked[x]].sum() for x in range(v)])
        keep &= mass_greater < top_p + 1e-4
    return keep


LOGIT_VALUES = [NEG_INF, -3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 2.0, 3.5]
B_, K_, V_ = B, K, V


@st.composite
def verify_inputs(draw):
    logits = draw(hnp.arrays(np.float32, (B_, K_ + 1, V_), elements=st.sampled_from(LOGIT_VALUES)))
    draft = draw(hnp.arrays(np.int32, (B_, K_), elements=st.integers(0, V_ - 1)))
    num = draw(hnp.arrays(np.int32, (B_,), elements=st.integers(0, K_)))
    temp = draw(hnp.arrays(np.float32, (B_,), elements=st.sampled_from([0.0, 0.3, 1.0, 2.5])))
    top_k = draw(hnp.arrays(np.int32, (B_,), elements=st.integers(0, V_)))
    top_p = draw(hnp.arrays(np.float32, (B_,), elements=st.sampled_from([0.2, 0.5, 0.9, 1.0])))
    with_q = draw(st.booleans())
    q = None
    if with_q:
        w = draw(hnp.arrays(np.float32, (B_, K_, V_), elements=st.sampled_from([0.0, 0.5, 1.0, 3.0])))
        w[..., 0] += 0.1  # never all zero
        q = w / w.sum(-1, keepdims=True)
    method = draw(st.sampled_from(["standard", "block", "synthetic"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return logits, draft, num, temp, top_k, top_p, q, method, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(verify_inputs())
def test_properties(inputs):
    logits, draft, num, temp, top_k, top_p, q, method, seed = inputs
    out, acc = rejection_sample_with_counts(draft, num, logits, q, temperature=temp, top_k=top_k, top_p=top_p,
                                            key=jax.random.key(seed), method=method,
                                            synthetic_acceptance_rates=[0.8, 0.5, 0.5])
    out, acc = np.asarray(out), np.asarray(acc)
    assert out.shape == (B_, K_ + 1) and acc.shape == (B_,)
    for b in range(B_):
        a = acc[b]
        assert 0 <= a <= num[b]
        np.testing.assert_array_equal(out[b, :a], draft[b, :a])  # prefix = accepted drafts
        assert 0 <= out[b, a] < V_  # exactly a + 1 tokens ...
        assert np.all(out[b, a + 1:] == -1)  # ... then placeholders only
        if temp[b] == 0 and method != "synthetic":
            greedy = np.argmax(logits[b], -1)
            mismatch = np.nonzero(draft[b, :num[b]] != greedy[:num[b]])[0]
            assert a == (mismatch[0] if mismatch.size else num[b])
            np.testing.assert_array_equal(out[b, :a + 1], greedy[:a + 1])
        elif temp[b] > 0:
            for i in range(a + 1):
                keep = allowed_tokens(logits[b, i], temp[b], top_k[b], top_p[b])
                accepted_draft = i < a
                if keep is not None and (method != "synthetic" or not accepted_draft):
                    assert keep[out[b, i]], (b, i, out[b], keep)
                if accepted_draft and method != "synthetic" and q is not None:
                    assert q[b, i, out[b, i]] > 0
            if method == "standard" and q is None and a < num[b] and allowed_tokens(
                    logits[b, a], temp[b], top_k[b], top_p[b]) is not None:
                # One-hot q: the recovered token excludes the rejected draft (unless p was all on it).
                keep = allowed_tokens(logits[b, a], temp[b], top_k[b], top_p[b])
                if keep.sum() > 1 or not keep[draft[b, a]]:
                    assert out[b, a] != draft[b, a]


def test_all_greedy_fast_path_matches_full_path():
    from pallas_kernels.rejection import greedy_verify_reference, rejection_sample_reference

    rng = np.random.default_rng(4)
    logits = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    logits[1, 2, 3] = np.nan
    draft = np.where(rng.random((B, K)) < 0.7, np.argmax(logits[:, :K], -1), 0).astype(np.int32)
    num = np.array([0, 1, 2, 3], np.int32)
    fast = greedy_verify_reference(jnp.asarray(draft), jnp.asarray(num), jnp.asarray(logits))
    full = rejection_sample_reference(jnp.asarray(draft), jnp.asarray(num), jnp.asarray(logits), None,
                                      jnp.zeros(B), None, None, jnp.zeros((B, K)), jnp.ones((B, V)))
    np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(full[0]))
    np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(full[1]))
