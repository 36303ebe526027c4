"""Batched verification: one target forward over catch-up + draft tokens, then the rejection sampler.

Row b of a step feeds the target its c_b catch-up tokens (committed tokens whose
KV is not yet in the cache: 1 while decoding, a chunk while prefilling)
followed by its n_b drafts, left-aligned in ``[B, C + K]``. The logits at the
last catch-up token and at each draft give the K+1 rows the sampler verifies.
Rejected drafts' KV stays in the cache but beyond the committed length, so it is
never read and the next step overwrites it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.llama import LlamaConfig, forward_features
from specjax.kv_cache import AttentionMetadata, KVCache, slots_for_positions
from specjax.sample.rejection import rejection_sample_jit
from specjax.sample.transforms import shape_logits


def assemble_window(tokens, positions, slot_mapping, block_tables, last_index, draft_ids, num_drafts, block_size):
    """Catch-up ``tokens [B, C]`` followed by each row's drafts, left-aligned in ``[B, C+K]``.

    Returns (tokens, positions, slots (-1 = not written), logits indices [B, K+1]) of the window.
    """
    b, c = tokens.shape
    k = draft_ids.shape[1]
    catch_up = last_index + 1  # [B]
    j = jnp.arange(k, dtype=jnp.int32)
    rows = jnp.arange(b)[:, None]
    valid = j[None, :] < num_drafts[:, None]  # [B, K]
    draft_cols = jnp.where(valid, catch_up[:, None] + j, c + k)  # out of range = dropped
    all_tokens = jnp.pad(tokens, ((0, 0), (0, k))).at[rows, draft_cols].set(draft_ids, mode="drop")  # [B, C+K]
    all_positions = positions[:, :1] + jnp.arange(c + k, dtype=jnp.int32)  # [B, C+K]
    draft_slots = slots_for_positions(
        block_tables, jnp.take_along_axis(all_positions, jnp.minimum(draft_cols, c + k - 1), axis=1), valid,
        block_size,
    )  # [B, K]
    all_slots = jnp.pad(slot_mapping, ((0, 0), (0, k)), constant_values=-1)
    all_slots = all_slots.at[rows, draft_cols].set(draft_slots, mode="drop")  # [B, C+K]
    logits_indices = jnp.minimum(last_index[:, None] + jnp.arange(k + 1, dtype=jnp.int32), c + k - 1)  # [B, K+1]
    return all_tokens, all_positions, all_slots, logits_indices


def verify_forward(
    params,
    kv_cache: KVCache,
    window: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    block_tables: jax.Array,
    *,
    config: LlamaConfig,
    features: str | None = None,
    aux_layer_ids: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Target logits ``[B, K+1, V]`` over an :func:`assemble_window` window (tokens, positions, slots, indices).

    ``features`` (for draft heads, from the same pass): ``"hidden"`` returns the final-normed hidden
    states ``[B, W, D]`` of the whole window, ``"aux"`` the residual streams after ``aux_layer_ids``
    ``[B, W, A*D]``; None returns None in their place.
    """
    tokens, positions, slots, logits_indices = window
    md = AttentionMetadata(slot_mapping=slots, block_tables=block_tables)
    logits, hidden, aux, kv_cache = forward_features(
        params, tokens, positions, kv_cache, md, config=config, logits_indices=logits_indices,
        aux_layer_ids=aux_layer_ids if features == "aux" else (),
    )
    feats = {"hidden": hidden, "aux": aux, None: None}[features]
    return logits, feats, kv_cache  # [B, K+1, V], [B, W, F] | None


def verify_tokens(
    target_logits: jax.Array,
    draft_ids: jax.Array,
    num_drafts: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    conditional_rates: jax.Array | None,
    *,
    method: str,
    use_kernel: bool = False,
    min_p: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Committed tokens ``[B, K+1]`` and accepted counts ``[B]``.

    The logits are shaped once (temperature, then top-k/top-p only when a sampling row uses them) and the
    rejection sampler sees them with temperature 1 for sampling rows, so it is compiled once whatever the
    batch asks for; it takes its greedy-only path (one argmax pass) when no row samples.
    """
    random_rows = temperature > 0
    shaped = shape_logits(target_logits, temperature, top_k, top_p, min_p)  # [B, K+1, V]; greedy rows: raw
    return rejection_sample_jit(
        draft_ids, num_drafts, shaped, draft_probs, random_rows.astype(jnp.float32), None, None, keys,
        conditional_rates, method=method, use_kernel=use_kernel,
    )
