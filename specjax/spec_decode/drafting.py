"""Drawing model drafts: greedy, or from the draft's own distribution shaped as the target's is.

Shared by every proposer that drafts from a model (draft models, draft heads).
Random verification is exact only when each draft is drawn from the q it hands
the verifier, and q must go through the same transforms as the target's
distribution (temperature, top-k, top-p), in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from specjax.sample import prng
from specjax.sample.transforms import argmax_last, row_exponentials, sample_with_exponentials, shape_logits

_DRAFT_KEY_TAG = 0x44524654  # "DRFT"


def draft_keys(keys: jax.Array) -> Callable[[int], jax.Array]:
    """``j -> [B]`` keys for draft j, from the rows' step keys ``[B]`` (the verifier's keys of the same step).

    A tag of its own first: with partitionable threefry, split(key)[i] == fold_in(key, i), so folding in
    small ints directly would reuse the verifier's noise (it splits the same row key) and bias the output.
    """
    base = prng.fold_in(keys, _DRAFT_KEY_TAG)
    return lambda j: prng.fold_in(base, j)


def draw_draft(
    logits: jax.Array, temperature, top_k, top_p, keys: jax.Array, *, probabilistic: bool, min_p=None
) -> tuple[jax.Array, jax.Array | None]:
    """One draft token per row of ``logits [B, V]`` and, when probabilistic, its distribution q [B, V].

    Greedy target rows always draft the argmax (greedy verification ignores q). When no row samples, q is
    zeros and the sampling work is skipped: the rejection sampler then takes its greedy-only path, which
    never reads q. (XLA:CPU ran that work as several multi-threaded passes over the vocabulary, ~35 us of a
    ~240 us draft of the shipped draft model at batch 1.)
    """
    greedy = argmax_last(logits)  # [B]
    if not probabilistic:
        return greedy, None

    def sampled() -> tuple[jax.Array, jax.Array]:
        shaped = shape_logits(logits, temperature, top_k, top_p, min_p)  # [B, V]
        q = jax.nn.softmax(shaped, axis=-1)
        drawn = sample_with_exponentials(shaped, row_exponentials(keys, logits.shape[-1:]), logits=True)
        return jnp.where(temperature > 0, drawn, greedy), q

    # (shape_logits returns float32, so q is float32 [B, V] either way.)
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: (greedy, jnp.zeros(logits.shape, jnp.float32)))
