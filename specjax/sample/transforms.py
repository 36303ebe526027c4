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


def shape_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """:func:`transform_logits` whose top-k/top-p sort runs only when a sampling row asks for it.

    The decision is made at run time (``lax.cond`` over the sort alone), so one compiled sampler serves
    batches with and without filters. Greedy rows keep their raw logits (top-k/top-p never remove
    the maximum, so their argmax is unchanged either way). Returns float32 ``[B, ..., V]``.
    """
    filtering = jnp.any((temperature > 0) & ((top_k > 0) | (top_p < 1.0)))
    scaled = apply_temperature(logits, temperature)
    return jax.lax.cond(filtering, lambda: apply_top_k_top_p(scaled, top_k, top_p), lambda: scaled)


def row_exponentials(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Exp(1) noise of ``[B, *shape]`` with row b drawn from ``keys[b]`` alone.

    Drawing per row (not one draw for the whole batch) is what makes a seeded
    request's samples independent of its batch neighbours.
    """
    noise = jax.vmap(lambda k: jax.random.exponential(k, shape, jnp.float32))(keys)
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
    if streams is None:
        return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(base_key, s), i))(seeds, step_indices)
    return jax.vmap(
        lambda st, s, i: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base_key, st), s), i)
    )(streams, seeds, step_indices)
