"""Distribution tests: the rejection sampler's output is distributed as the target's.

Expected distributions are computed here in numpy (softmax, an independent
top-k/top-p, products of conditionals), never by the code under test. Drafts
are sampled in numpy. Each test vectorizes >= 20k rows in one jitted call.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from specjax.sample.rejection import rejection_sample_with_counts

pytestmark = pytest.mark.slow

P_MIN = 1e-3  # chi-square p-value bound (seeds are fixed)


def probs_np(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Target distribution of temperature -> top-k -> top-p over the last axis (tie-free logits)."""
    s = np.asarray(logits, np.float64) / temperature
    v = s.shape[-1]
    order = np.argsort(-s, axis=-1)
    ranks = np.argsort(order, axis=-1)
    keep = np.isfinite(s)
    if 0 < top_k < v:
        keep &= ranks < top_k
    w = np.where(keep, np.exp(s - np.max(np.where(keep, s, -np.inf), -1, keepdims=True)), 0.0)
    w /= w.sum(-1, keepdims=True)
    if top_p < 1.0:
        sorted_w = np.take_along_axis(w, order, -1)
        before = np.cumsum(sorted_w, -1) - sorted_w  # mass strictly before each sorted token
        keep_sorted = before < top_p
        keep &= np.take_along_axis(keep_sorted, ranks, -1)
        w = np.where(keep, w, 0.0)
        w /= w.sum(-1, keepdims=True)
    return w


def sample_np(rng, probs):
    """One categorical draw per row of probs [N, V]."""
    c = np.cumsum(probs, -1)
    u = rng.random(probs.shape[0]) * c[:, -1]
    return np.minimum((u[:, None] >= c).sum(-1), probs.shape[-1] - 1)


def assert_distribution(samples, expected, n_cells, tv_bound):
    """Chi-square (cells with expected count < 5 pooled) and total-variation checks."""
    n = samples.shape[0]
    counts = np.bincount(samples, minlength=n_cells).astype(np.float64)
    expected = np.asarray(expected, np.float64).ravel()
    assert counts[expected == 0].sum() == 0, "sampled a zero-probability outcome"
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv < tv_bound, f"total variation {tv:.4f} >= {tv_bound}"
    exp_counts = expected * n
    big = exp_counts >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp_counts[big], exp_counts[~big].sum())
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    p = stats.chisquare(obs, ex * obs.sum() / ex.sum()).pvalue
    assert p > P_MIN, f"chi-square p-value {p:.2e}"


# ---------------------------------------------------------------------------
# Three-token joint over a tiny "language": target and draft conditionals are
# tables indexed by the prefix. Rows committing fewer than three tokens are
# completed by sampling the target in numpy, so the joint of (y1, y2, y3) must
# equal P0[y1] P1[y1, y2] P2[y1, y2, y3] for any lossless verifier.
# ---------------------------------------------------------------------------

V4, K2, N_JOINT = 4, 2, 30_000


def make_world(case, rng):
    v = V4
    lt = [rng.normal(size=(v,)) * 1.5, rng.normal(size=(v, v)) * 1.5, rng.normal(size=(v, v, v)) * 1.5]
    ld = [lt[0] + rng.normal(size=(v,)), lt[1] + rng.normal(size=(v, v))]  # a correlated draft model
    filt = dict(temperature=1.0, top_k=0, top_p=1.0)
    if case == "zero_prob":
        lt[0][1] = -np.inf  # target forbids token 1 first ...
        lt[1][:, 2] = -np.inf  # ... and token 2 second
        ld[0][3] = -np.inf  # the draft never proposes 3 first (q = 0 where p > 0)
        ld[0][1] += 2.0  # and likes the forbidden token 1 (q > 0 where p = 0)
    if case == "divergent":
        ld = [-0.7 * lt[0], -0.7 * lt[1]]  # a draft that prefers what the target avoids
    if case == "filters":
        filt = dict(temperature=0.8, top_k=3, top_p=0.85)
    pt = [probs_np(x, **filt) for x in lt]
    qt = [probs_np(x, **filt) for x in ld]  # the same transforms on the draft, as the caller must
    return lt, pt, qt, filt


def run_joint(case, method, seed):
    rng = np.random.default_rng(seed)
    lt, pt, qt, filt = make_world(case, rng)
    n = N_JOINT
    x1 = sample_np(rng, np.broadcast_to(qt[0], (n, V4)))
    x2 = sample_np(rng, qt[1][x1])
    draft = np.stack([x1, x2], 1).astype(np.int32)
    logits = np.stack([np.broadcast_to(lt[0], (n, V4)), lt[1][x1], lt[2][x1, x2]], 1).astype(np.float32)
    q = None if case == "one_hot" else np.stack([np.broadcast_to(qt[0], (n, V4)), qt[1][x1]], 1).astype(np.float32)
    num = rng.integers(0, K2 + 1, n).astype(np.int32) if case in ("draft_model", "one_hot") else np.full(n, K2)
    out, acc = rejection_sample_with_counts(
        draft, num, logits, q, temperature=np.full(n, filt["temperature"], np.float32),
        top_k=np.full(n, filt["top_k"], np.int32), top_p=np.full(n, filt["top_p"], np.float32),
        key=jax.random.key(seed), method=method)
    out, acc = np.asarray(out), np.asarray(acc)
    assert np.all(acc <= num)
    y = out[:, :3].copy()
    # Complete to three tokens with the target itself.
    need2 = acc + 1 < 2
    y[need2, 1] = sample_np(rng, pt[1][y[need2, 0]])
    need3 = acc + 1 < 3
    y[need3, 2] = sample_np(rng, pt[2][y[need3, 0], y[need3, 1]])
    joint = pt[0][:, None, None] * pt[1][:, :, None] * pt[2]  # [V, V, V]
    return y, acc, pt, joint, draft, num


CASES = ["draft_model", "one_hot", "zero_prob", "filters", "divergent"]


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("case", CASES)
def test_three_token_joint_is_target(method, case):
    y, acc, pt, joint, _, _ = run_joint(case, method, seed=100 * CASES.index(case) + len(method))
    assert_distribution(y[:, 0], pt[0], V4, tv_bound=0.015)  # first token
    cells = (y[:, 0] * V4 + y[:, 1]) * V4 + y[:, 2]
    assert_distribution(cells, joint, V4**3, tv_bound=0.03)


@pytest.mark.parametrize("case", ["draft_model", "one_hot", "zero_prob"])
def test_standard_second_token_given_acceptance(case):
    """Token-wise: once x1 is accepted, the next committed token is an exact draw from P1[x1]."""
    y, acc, pt, _, draft, num = run_joint(case, "standard", seed=17)
    sel = (acc >= 1) & (num >= 1)
    assert sel.sum() > 5000
    x1, y2 = draft[sel, 0], y[sel, 1]
    cells = x1 * V4 + y2
    # Expected joint of (x1, y2) among accepted rows: empirical x1 frequency times P1[x1].
    freq = np.bincount(x1, minlength=V4) / sel.sum()
    assert_distribution(cells, (freq[:, None] * pt[1]).ravel(), V4 * V4, tv_bound=0.03)


@pytest.mark.parametrize("method", ["standard", "block"])
def test_first_token_larger_vocab(method):
    """V = 16, K = 3, drafts from a draft model, -inf logits, zero q entries, temperature."""
    rng = np.random.default_rng(3)
    n, k, v, t = 24_000, 3, 16, 0.7
    lt = rng.normal(size=(k + 1, v)) * 1.5
    lt[0, :3] = -np.inf
    ld = lt[:k] + rng.normal(size=(k, v))
    ld[:, 5:8] = -np.inf
    p0 = probs_np(lt[0], t)
    q = probs_np(ld, t)  # [K, V]
    draft = np.stack([sample_np(rng, np.broadcast_to(q[i], (n, v))) for i in range(k)], 1).astype(np.int32)
    logits = np.broadcast_to(lt, (n, k + 1, v)).astype(np.float32)
    out, _ = rejection_sample_with_counts(draft, np.full(n, k, np.int32), logits,
                                          np.broadcast_to(q, (n, k, v)).astype(np.float32),
                                          temperature=np.full(n, t, np.float32), key=jax.random.key(3),
                                          method=method)
    assert_distribution(np.asarray(out)[:, 0], p0, v, tv_bound=0.02)


# ---------------------------------------------------------------------------
# Block verification accepts at least as much as token-wise verification.
# ---------------------------------------------------------------------------


def mean_accepted(p, q, method, seed, n=20_000):
    """p [K+1, V], q [K, V] context-free per position; drafts x_i ~ q_i."""
    rng = np.random.default_rng(seed)
    k, v = q.shape
    draft = np.stack([sample_np(rng, np.broadcast_to(q[i], (n, v))) for i in range(k)], 1).astype(np.int32)
    with np.errstate(divide="ignore"):
        logits = np.broadcast_to(np.log(p), (n, k + 1, v)).astype(np.float32)
    _, acc = rejection_sample_with_counts(draft, np.full(n, k, np.int32), logits,
                                          np.broadcast_to(q, (n, k, v)).astype(np.float32),
                                          temperature=np.ones(n, np.float32), key=jax.random.key(seed),
                                          method=method)
    acc = np.asarray(acc, np.float64)
    return acc.mean(), acc.std() / np.sqrt(n)


def test_block_accepts_at_least_tokenwise_random():
    rng = np.random.default_rng(0)
    k, v = 4, 6
    for trial in range(3):
        p = rng.dirichlet(np.ones(v) * 0.7, k + 1)
        q = rng.dirichlet(np.ones(v) * 0.7, k)
        std_mean, std_se = mean_accepted(p, q, "standard", seed=10 + trial)
        blk_mean, blk_se = mean_accepted(p, q, "block", seed=20 + trial)
        # Token-wise theory: accept position i w.p. beta_i = sum_x min(p_i, q_i), independently here.
        beta = np.minimum(p[:k], q).sum(-1)
        theory = np.cumprod(beta).sum()
        assert abs(std_mean - theory) < 4 * std_se + 1e-3
        assert blk_mean >= std_mean - 3 * np.hypot(std_se, blk_se), (trial, blk_mean, std_mean)


def test_block_strictly_better_on_paper_example():
    """p = (1/3, 2/3), q = (2/3, 1/3) at every position (the example of Sun et al.)."""
    k = 4
    p = np.tile([1 / 3, 2 / 3], (k + 1, 1))
    q = np.tile([2 / 3, 1 / 3], (k, 1))
    std_mean, std_se = mean_accepted(p, q, "standard", seed=1)
    blk_mean, blk_se = mean_accepted(p, q, "block", seed=2)
    theory = sum((2 / 3) ** i for i in range(1, k + 1))
    assert abs(std_mean - theory) < 4 * std_se + 1e-3
    assert blk_mean > std_mean + 5 * np.hypot(std_se, blk_se), (blk_mean, std_mean)


def block_outcome_np(p, q, draft):
    """Exact law of (tau, Y) for one draft block, straight from the paper's algorithm.

    p [g+1, V], q [g, V], draft [g]. Returns probs [g+1, V] over (tau, committed extra token).
    """
    g, v = q.shape
    big_p = [1.0]
    for i in range(g):
        big_p.append(min(1.0, big_p[-1] * p[i, draft[i]] / q[i, draft[i]]))
    h = np.zeros(g + 1)
    for i in range(1, g):
        z = np.maximum(big_p[i] * p[i] - q[i], 0).sum()
        h[i] = z / (z + 1 - big_p[i]) if z + 1 - big_p[i] > 0 else 1.0
    h[g] = big_p[g]
    out = np.zeros((g + 1, v))
    for tau in range(g + 1):
        # tau is the largest i with eta_i < h_i: eta_tau hits, every later one misses.
        pr = (h[tau] if tau > 0 else 1.0) * np.prod(1 - h[tau + 1:])
        if tau == g:
            r = p[g]
        else:
            r = np.maximum(big_p[tau] * p[tau] - q[tau], 0)
            r = r / r.sum() if r.sum() > 0 else p[tau]
        out[tau] = pr * r
    return out


def test_block_outcome_law_for_a_fixed_draft():
    """For one fixed draft block, the empirical (tau, Y) matches the paper's exact law."""
    rng = np.random.default_rng(8)
    n, g, v = 30_000, 3, 5
    p = rng.dirichlet(np.ones(v), g + 1)
    q = rng.dirichlet(np.ones(v), g)
    draft = np.array([np.argmax(q[i] * (p[i] < q[i])) for i in range(g)])  # drafts the target under-weights
    expected = block_outcome_np(p, q, draft)
    logits = np.broadcast_to(np.log(p), (n, g + 1, v)).astype(np.float32)
    out, acc = rejection_sample_with_counts(
        np.broadcast_to(draft, (n, g)).astype(np.int32), np.full(n, g, np.int32), logits,
        np.broadcast_to(q, (n, g, v)).astype(np.float32), temperature=np.ones(n, np.float32),
        key=jax.random.key(8), method="block")
    out, acc = np.asarray(out), np.asarray(acc)
    cells = acc * v + out[np.arange(n), acc]
    assert_distribution(cells, expected, (g + 1) * v, tv_bound=0.02)
