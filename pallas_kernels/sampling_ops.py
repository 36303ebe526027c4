"""Logits transforms and the exponential-race draw: the sampling primitives every sampler shares.

They live here, beside the kernels, so :mod:`pallas_kernels` needs nothing from
:mod:`specjax`; :mod:`specjax.sample.transforms` re-exports them (one copy).
The order of transforms is fixed: temperature -> top-k -> top-p (vLLM's order;
tpu-inference's verifier applies top-k/top-p before temperature, which makes
spec and plain sampling disagree).

Per-row parameters are ``[B]`` and broadcast over any middle axes, so logits may
be ``[B, V]`` or ``[B, T, V]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = float("-inf")


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """Reshape a ``[B]`` parameter so it broadcasts against ``[B, ..., V]``."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def apply_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Divide logits by the row temperature; greedy rows (temperature 0) are left as is.

    Greedy rows are decided by argmax on the raw logits, so they must not be
    divided by zero (or by a sentinel such as -1, which flips the argmax).
    """
    t = _per_row(temperature.astype(jnp.float32), logits.ndim)
    return logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)


TOP_CANDIDATES = 256
"""How many largest logits per row the top-k / top-p filters look at before falling back to a full sort.

XLA:CPU sorts a [5, 32000] float array in ~80 ms but takes its 256 largest (``lax.top_k``) in ~1 ms
(2026-12-03, 2-core x86_64). A row whose top-k is larger, or whose top-p nucleus is not closed within
these candidates, sends the batch to the full sort; the kept set is the same either way."""


def _top_k_top_p_sorted(logits: jax.Array, sorted_desc: jax.Array, top_k, top_p) -> tuple[jax.Array, jax.Array]:
    """(threshold [B, ..., 1], closed bool [B, ..., 1]) from ``sorted_desc``: the largest ``n`` logits of each
    row, descending (all of them, or a prefix). ``closed``: the threshold is the full-sort one."""
    vocab, n, nd = logits.shape[-1], sorted_desc.shape[-1], logits.ndim
    threshold = jnp.full(logits.shape[:-1] + (1,), _NEG_INF, logits.dtype)
    closed = jnp.ones(threshold.shape, bool)
    if top_k is not None:
        k = _per_row(top_k.astype(jnp.int32), nd)
        k_on = (k > 0) & (k < vocab)
        k_idx = jnp.clip(k - 1, 0, n - 1)
        kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k_idx, threshold.shape), axis=-1)
        threshold = jnp.where(k_on, kth, threshold)
        closed = closed & ~(k_on & (k > n))
    if top_p is not None:
        p = _per_row(top_p.astype(jnp.float32), nd)
        # Top-p acts on the distribution that survived top-k.
        survivors = jnp.where(sorted_desc >= threshold, sorted_desc, _NEG_INF)
        if n == vocab:
            probs = jax.nn.softmax(survivors, axis=-1)  # [B, ..., V], descending
        else:  # a prefix of the row: the normalizer sums the whole row
            top = sorted_desc[..., :1]
            z = jnp.sum(jnp.where(logits >= threshold, jnp.exp(logits - top), 0.0), axis=-1, keepdims=True)
            probs = jnp.exp(survivors - top) / z  # [B, ..., n]
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Keep a token while the mass strictly before it is < top_p; the first always stays.
        below = jnp.sum(mass_before < p, axis=-1, keepdims=True)
        num_kept = jnp.maximum(below, 1)
        pth = jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)
        p_on = p < 1.0
        threshold = jnp.where(p_on, jnp.maximum(threshold, pth), threshold)
        # With every candidate still below top_p the nucleus may go on past them (unless top-k closed it).
        k_closed = (threshold > _NEG_INF) & (sorted_desc[..., -1:] < threshold)
        closed = closed & ~(p_on & (below >= n) & (n < vocab) & ~k_closed)
    return threshold, closed


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array | None, top_p: jax.Array | None) -> jax.Array:
    """Mask logits outside the top-k set and then outside the top-p nucleus with -inf.

    top_k: int32 [B]; <= 0 or >= V means off. top_p: float [B]; >= 1 means off.
    Tokens tied with the threshold logit are kept (so the kept set may exceed k by
    ties; never falls short). The thresholds come from the ``TOP_CANDIDATES``
    largest logits of each row (``lax.top_k``); only when some row needs more does
    the batch take one full descending sort (decided at run time).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]

    def full():
        return _top_k_top_p_sorted(logits, -jnp.sort(-logits, axis=-1), top_k, top_p)[0]

    if vocab <= TOP_CANDIDATES:
        threshold = full()
    else:
        # The barrier keeps XLA:CPU from fusing top_k into its consumers (measured 16x slower fused).
        candidates = jax.lax.optimization_barrier(jax.lax.top_k(logits, TOP_CANDIDATES)[0])  # [B, ..., C], descending
        threshold, closed = _top_k_top_p_sorted(logits, candidates, top_k, top_p)
        threshold = jax.lax.cond(jnp.all(closed), lambda: threshold, full)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def transform_logits(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array | None = None,
    top_p: jax.Array | None = None,
) -> jax.Array:
    """Temperature, then top-k, then top-p. Returns float32 logits with -inf outside the support."""
    return apply_top_k_top_p(apply_temperature(logits, temperature), top_k, top_p)


def argmax_last(x: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (first maximum, int32), in two single-output reductions.

    XLA:CPU lowers jnp.argmax to a variadic (value, index) reduce that runs ~4x
    slower than a max followed by a min over a float iota; over [B, K+1, V]
    logits that difference is most of the sampler's time. Exact for V < 2**24.
    A row with NaN returns an in-range index (V - 1) instead of the NaN's.
    """
    vocab = x.shape[-1]
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == m, iota, float(vocab)), axis=-1)
    return jnp.minimum(first, vocab - 1).astype(jnp.int32)


def sample_with_exponentials(probs_or_logits: jax.Array, exponentials: jax.Array, *, logits: bool) -> jax.Array:
    """Exponential race: argmax_x p(x) / E_x with E_x ~ Exp(1) is a draw from p.

    Needs no sort and no cumsum. With logits, the same race is
    argmax_x (l(x) - log E_x) (Gumbel-max). Returns int32 indices over the last axis.
    """
    if logits:
        scores = probs_or_logits - jnp.log(exponentials)
    else:
        scores = probs_or_logits / exponentials
    return argmax_last(scores)
