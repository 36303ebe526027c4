"""Logits transforms and categorical sampling shared by every sampler.

The plain sampler, the rejection sampler (target rows) and model drafts (draft
rows) all go through :func:`transform_logits`, so the acceptance test compares
distributions that were shaped identically. The order is fixed:
temperature -> top-k -> top-p (vLLM's order; tpu-inference's verifier applies
top-k/top-p before temperature, which makes spec and plain sampling disagree).

Shape letters: b rows, t positions in a row, v vocabulary.
Per-row parameters are ``[B]`` and broadcast over any middle axes, so logits may
be ``[B, V]`` or ``[B, T, V]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# One copy of the primitives, kept beside the kernels (pallas_kernels imports nothing from specjax).
from pallas_kernels.sampling_ops import (  # noqa: F401  (re-exported)
    apply_temperature,
    apply_top_k_top_p,
    argmax_last,
    sample_with_exponentials,
    transform_logits,
)
from specjax.sample import prng


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """-inf where p(x) < min_p * max p (on temperature-scaled ``logits [B, ..., V]``); min_p 0 = off."""
    m = min_p.reshape(min_p.shape + (1,) * (logits.ndim - 1))
    top = jnp.max(logits, axis=-1, keepdims=True)
    # p(x) / p_max = exp(l(x) - l_max): compare in log space, no normalizer needed.
    return jnp.where((m > 0) & (logits - top < jnp.log(jnp.maximum(m, 1e-30))), float("-inf"), logits)


def shape_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                 min_p: jax.Array | None = None) -> jax.Array:
    """Temperature -> min-p -> top-k -> top-p, with the filters run only when a sampling row asks for one.

    The decision is made at run time (``lax.cond`` over the filters alone), so one compiled sampler serves
    batches with and without them. Without min-p this is :func:`transform_logits`. Greedy rows keep their
    raw logits (the filters never remove the maximum, so their argmax is unchanged either way).
    Returns float32 ``[B, ..., V]``.
    """
    random_rows = temperature > 0
    filtering = jnp.any(random_rows & ((top_k > 0) | (top_p < 1.0)))
    scaled = apply_temperature(logits, temperature)
    if min_p is not None:
        min_p = jnp.where(random_rows, min_p, 0.0)
        scaled = jax.lax.cond(jnp.any(min_p > 0), lambda: apply_min_p(scaled, min_p), lambda: scaled)
    return jax.lax.cond(filtering, lambda: apply_top_k_top_p(scaled, top_k, top_p), lambda: scaled)


def row_exponentials(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Exp(1) noise of ``[B, *shape]`` with row b drawn from ``keys[b]`` alone.

    Drawing per row (not one draw for the whole batch) is what makes a seeded
    request's samples independent of its batch neighbours.
    """
    noise = prng.exponential(keys, shape)
    # exponential() returns exactly 0 with probability ~2**-23 per element; in the race that is
    # -log(0) = +inf, and -inf + inf = NaN for a masked token. Clamp to the smallest normal float.
    return jnp.maximum(noise, jnp.finfo(jnp.float32).tiny)


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array | None,
    top_p: jax.Array | None,
    keys: jax.Array,
) -> jax.Array:
    """Sample one token per row of ``logits [B, V]``; greedy rows take the argmax of the raw logits.

    keys: typed PRNG keys ``[B]`` (one per request; see :func:`request_keys`).
    Returns int32 [B].
    """
    greedy = argmax_last(logits)  # [B]
    shaped = transform_logits(logits, temperature, top_k, top_p)  # [B, V]
    sampled = sample_with_exponentials(shaped, row_exponentials(keys, logits.shape[-1:]), logits=True)
    return jnp.where(temperature > 0, sampled, greedy)


def request_keys(
    base_key: jax.Array, seeds: jax.Array, step_indices: jax.Array, streams: jax.Array | None = None
) -> jax.Array:
    """Per-request keys ``fold_in(fold_in(base_key', seed), step_index)`` for ``[B]`` seeds and steps.

    ``base_key' = fold_in(base_key, stream)`` per row when ``streams [B]`` is given (the engine keeps
    user seeds and engine-derived seeds on separate streams), else ``base_key``. step_index is the
    request's own output position (not the engine step), so a preempted-and-recomputed request, or
    one batched differently, draws the same noise.
    """
    keys = base_key if streams is None else prng.fold_in(base_key, streams)
    return prng.fold_in(prng.fold_in(keys, seeds), step_indices)
