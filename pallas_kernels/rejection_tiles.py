"""Per-tile maths of the V-tiled rejection kernels, shared by the TPU and GPU kernel bodies.

Each function folds one vocabulary tile into a running state of per-position
columns (``[P, 1]``, positions on the sublane axis). The kernel bodies in
:mod:`pallas_kernels.rejection` only decide how tiles are fetched (a sequential
grid axis on TPU, a loop inside the program on GPU); what is computed per tile
is written once, here.

Arguments common to all: ``vidx [P, T]`` float32 global vocabulary index of
each lane (exact below 2**24), ``valid [P, T]`` bool (lane inside the
vocabulary and position inside the row), ``temp [1, 1]`` the row temperature
(<= 0: greedy, logits used raw).
"""

from __future__ import annotations

import jax.numpy as jnp

F32_MAX = float(jnp.finfo(jnp.float32).max)
NEG_INF = float("-inf")
BIG_INDEX = float(1 << 30)  # larger than any vocabulary index; exact in float32
# Exp(1) noise is exactly 0 with probability 2**-23 per element (-log1p(-u) at u == 0); 0 stands for E in
# [0, ~2**-23), so it is clamped to that interval's middle (the reference path clamps the same way).
MIN_EXPONENTIAL = 2.0**-24


def scaled_logits(x, temp, valid):
    """Sanitized float32 logits (NaN and lanes outside the row -> -inf) and s = min(x / T, F32_MAX)."""
    x = x.astype(jnp.float32)
    x = jnp.where(valid & (x == x), x, NEG_INF)  # x == x is False only for NaN
    s = jnp.minimum(x / jnp.where(temp > 0, temp, 1.0), F32_MAX)
    return x, s


def stats_init(rows: int):
    """(gmax, garg, smax, ssum, sdraft) of an empty prefix, each ``[rows, 1]`` float32."""
    col = lambda v: jnp.full((rows, 1), v, jnp.float32)  # noqa: E731
    return col(NEG_INF), col(0.0), col(NEG_INF), col(0.0), col(NEG_INF)


def stats_tile(state, x, draft, temp, vidx, valid):
    """Fold one ``[P, T]`` logits tile into the running statistics of every position.

    state = (gmax, garg, smax, ssum, sdraft), each [P, 1]:
      gmax/garg  max of the raw logits and its FIRST index (greedy token; 0 for an all -inf row)
      smax/ssum  online softmax of s = x / T: running max and sum of exp(s - smax)
      sdraft     s at the position's draft token (``draft [P, 1]`` float32, -1 = none)
    """
    gmax, garg, smax, ssum, sdraft = state
    x, s = scaled_logits(x, temp, valid)
    tmax = jnp.max(x, axis=1, keepdims=True)  # [P, 1]
    targ = jnp.min(jnp.where(x == tmax, vidx, BIG_INDEX), axis=1, keepdims=True)
    garg = jnp.where(tmax > gmax, targ, garg)  # strict: an equal later maximum keeps the first index
    gmax = jnp.maximum(gmax, tmax)
    new_max = jnp.maximum(smax, jnp.max(s, axis=1, keepdims=True))
    safe = jnp.where(new_max > NEG_INF, new_max, 0.0)  # exp(-inf - 0) = 0, never exp(nan)
    ssum = ssum * jnp.exp(smax - safe) + jnp.sum(jnp.exp(s - safe), axis=1, keepdims=True)
    onehot = vidx == draft  # [P, T]
    sdraft = jnp.maximum(sdraft, jnp.max(jnp.where(onehot, s, NEG_INF), axis=1, keepdims=True))
    return gmax, garg, new_max, ssum, sdraft


def qdraft_tile(qdraft, q, draft, vidx, valid):
    """Running q at the draft token: ``q [P, T]`` draft probabilities (NaN / negative -> 0)."""
    q = q.astype(jnp.float32)
    q = jnp.where(valid & (q > 0), q, 0.0)
    return jnp.maximum(qdraft, jnp.max(jnp.where(vidx == draft, q, 0.0), axis=1, keepdims=True))


def probs(s, m, z):
    """p = exp(s - m) / z with the row's final normalizers (m: -inf mapped to 0; z: 0 mapped to 1)."""
    return jnp.exp(s - m) / z


def residual_mass_tile(zres, x, q, m, z, big_p, temp, valid):
    """Block verification's Z_i += sum_x max(P_i p_i(x) - q_i(x), 0) over one ``[P, T]`` tile."""
    _, s = scaled_logits(x, temp, valid)
    q = jnp.where(valid & (q > 0), q.astype(jnp.float32), 0.0)
    r = jnp.maximum(big_p * probs(s, m, z) - q, 0.0)
    return zres + jnp.sum(jnp.where(valid, r, 0.0), axis=1, keepdims=True)


def race_init():
    """(rsum, best_r, idx_r, best_p, idx_p) of an empty prefix, each ``[1, 1]`` float32."""
    col = lambda v: jnp.full((1, 1), v, jnp.float32)  # noqa: E731
    return col(0.0), col(-1.0), col(0.0), col(-1.0), col(0.0)


def _running_argmax(best, idx, scores, vidx):
    tmax = jnp.max(scores, axis=1, keepdims=True)
    targ = jnp.min(jnp.where(scores == tmax, vidx, BIG_INDEX), axis=1, keepdims=True)
    return jnp.maximum(best, tmax), jnp.where(tmax > best, targ, idx)


def race_tile(state, x, q, e, m, z, scale, use_residual, temp, vidx, valid):
    """Exponential races of one row's ``[1, T]`` tile: the residual's and p's (its fallback).

    r = max(scale p - q, 0) where ``use_residual`` > 0 (a rejected draft), else p (the bonus);
    winners are argmax r / E and argmax p / E (first index on ties); rsum = sum r says whether the
    residual has mass (if not, the draw falls back to p). Scores of lanes outside the row are -1,
    below every real score (>= 0).
    """
    rsum, best_r, idx_r, best_p, idx_p = state
    _, s = scaled_logits(x, temp, valid)
    p = probs(s, m, z)
    q = jnp.where(valid & (q > 0), q.astype(jnp.float32), 0.0)
    r = jnp.where(use_residual > 0, jnp.maximum(scale * p - q, 0.0), p)
    r = jnp.where(valid, r, 0.0)
    rsum = rsum + jnp.sum(r, axis=1, keepdims=True)
    e = jnp.maximum(e.astype(jnp.float32), MIN_EXPONENTIAL)
    best_r, idx_r = _running_argmax(best_r, idx_r, jnp.where(valid, r / e, -1.0), vidx)
    best_p, idx_p = _running_argmax(best_p, idx_p, jnp.where(valid, p / e, -1.0), vidx)
    return rsum, best_r, idx_r, best_p, idx_p
