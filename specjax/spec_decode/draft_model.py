"""Draft-model proposer: a small LLM drafts K tokens in one jitted call.

The draft shares the target's vocabulary, or maps to it through a ``vocab_map``
(``use_heterogeneous_vocab``, see :mod:`specjax.spec_decode.vocab_map`).

The draft has its own paged KV cache with the target's block size and block
count, so the target's block tables and slot mapping address it unchanged.
Each step it first catches up on the committed tokens it has not seen (the
same catch-up tokens the target gets: 1 or 2 in steady state, a chunk during
prefill), then drafts autoregressively inside ``lax.fori_loop``: one dispatch
per engine step for the whole batch, not K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.llama import LlamaConfig, forward
from specjax.kv_cache import AttentionMetadata, KVCache
from specjax.sample.transforms import argmax_last, row_exponentials, sample_with_exponentials, transform_logits


_DRAFT_KEY_TAG = 0x44524654  # "DRFT"


def slots_for_positions(block_tables: jax.Array, positions: jax.Array, valid: jax.Array, block_size: int) -> jax.Array:
    """Flat KV slots of ``positions [B, L]`` through ``block_tables [B, M]``; -1 where not ``valid``."""
    block_idx = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    blocks = jnp.take_along_axis(block_tables, block_idx, axis=1)  # [B, L]
    slots = blocks * block_size + positions % block_size
    return jnp.where(valid & (blocks >= 0), slots, -1).astype(jnp.int32)


def draw_draft(
    logits: jax.Array, temperature, top_k, top_p, keys: jax.Array, *, probabilistic: bool
) -> tuple[jax.Array, jax.Array | None]:
    """One draft token per row of ``logits [B, V]`` and, when probabilistic, its distribution q [B, V].

    Greedy target rows always draft the argmax (greedy verification ignores q).
    q goes through the same transforms as the target (temperature, top-k, top-p),
    which exact random verification requires.
    """
    greedy = argmax_last(logits)  # [B]
    if not probabilistic:
        return greedy, None
    shaped = transform_logits(logits, temperature, top_k, top_p)  # [B, V]
    q = jax.nn.softmax(shaped, axis=-1)
    sampled = sample_with_exponentials(shaped, row_exponentials(keys, logits.shape[-1:]), logits=True)
    return jnp.where(temperature > 0, sampled, greedy), q


def draft_propose(
    draft_params,
    draft_cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    slot_mapping: jax.Array,
    block_tables: jax.Array,
    last_index: jax.Array,
    num_drafts: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    *,
    config: LlamaConfig,
    k: int,
    probabilistic: bool,
    vocab_map: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Catch up on ``tokens [B, C]`` then draft ``k`` tokens per row.

    num_drafts [B]: how many drafts each row will verify (<= k); KV is written
    only for draft positions that row needs. keys [B]: per-request keys; draft j
    draws from fold_in(fold_in(key, DRFT tag), j). Returns (draft ids int32 [B, K], q float32
    [B, K, V] or None, new draft cache).

    vocab_map (heterogeneous vocabularies, greedy only): (target_to_draft int32 [V_target],
    draft_to_target int32 [V_draft]) from :mod:`specjax.spec_decode.vocab_map`. ``tokens`` are then
    target ids, consumed as their draft ids; the draft argmaxes over the shared tokens only and the
    returned drafts are target ids.
    """
    b = tokens.shape[0]
    shared = None
    if vocab_map is not None:
        if probabilistic:
            raise ValueError("vocab_map (heterogeneous vocabularies) drafts greedily only, got probabilistic=True")
        target_to_draft, draft_to_target = vocab_map
        tokens = jnp.take(target_to_draft, tokens, axis=0)  # [B, C] draft ids
        shared = draft_to_target >= 0  # [V_draft]: only tokens the target also has may be drafted

    def draw(step_logits, key):  # [B, V] -> (ids [B], q [B, V] or None)
        if shared is not None:
            step_logits = jnp.where(shared, step_logits, -jnp.inf)
        return draw_draft(step_logits, temperature, top_k, top_p, key, probabilistic=probabilistic)

    md = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables)
    logits, _, draft_cache = forward(
        draft_params, tokens, positions, draft_cache, md, config=config, logits_indices=last_index[:, None]
    )  # [B, 1, V]
    # A tag of its own: with partitionable threefry, split(key)[i] == fold_in(key, i), so folding in small
    # ints would reuse the verifier's noise (it splits the same row key) and bias the output.
    draft_base = jax.vmap(lambda key: jax.random.fold_in(key, _DRAFT_KEY_TAG))(keys)
    draft_keys = lambda j: jax.vmap(lambda key: jax.random.fold_in(key, j))(draft_base)  # noqa: E731
    tok, q = draw(logits[:, 0], draft_keys(0))
    draft_ids = jnp.zeros((b, k), jnp.int32).at[:, 0].set(tok)  # [B, K]
    vocab = logits.shape[-1]
    draft_probs = jnp.zeros((b, k, vocab), jnp.float32).at[:, 0].set(q) if probabilistic else None
    last_pos = jnp.take_along_axis(positions, last_index[:, None], axis=1)[:, 0]  # [B]: position of x_{L-1}

    def body(j, carry):
        draft_ids, draft_probs, cache = carry
        prev = draft_ids[:, j - 1]  # [B]: d_j, fed at position last_pos + j
        pos = (last_pos + j)[:, None]  # [B, 1]
        slot = slots_for_positions(block_tables, pos, (j < num_drafts)[:, None], cache.block_size)
        step_md = AttentionMetadata(slot_mapping=slot, block_tables=block_tables)
        step_logits, _, cache = forward(draft_params, prev[:, None], pos, cache, step_md, config=config)
        tok, q = draw(step_logits[:, 0], draft_keys(j))
        draft_ids = draft_ids.at[:, j].set(tok)
        if probabilistic:
            draft_probs = draft_probs.at[:, j].set(q)
        return draft_ids, draft_probs, cache

    draft_ids, draft_probs, draft_cache = jax.lax.fori_loop(1, k, body, (draft_ids, draft_probs, draft_cache))
    if vocab_map is not None:
        draft_ids = jnp.take(draft_to_target, draft_ids, axis=0)  # [B, K] target ids (all shared: never -1)
    return draft_ids, draft_probs, draft_cache
