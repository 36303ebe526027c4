"""Head proposers (EAGLE, EAGLE-3, MTP, Medusa): draft from the target's own hidden states.

A head needs the target's feature at the last accepted position, which only
exists once this step's verify pass has run. So a head drafts at the *end* of
a step, for the next one: after the rejection sampler, one jitted pass
(:func:`head_propose`) walks the verified window and drafts K tokens per row;
the host keeps them (:class:`HeadProposer`) and the next step verifies them as
it verifies host drafts. No extra target pass, one extra dispatch per step.

Fusion heads (EAGLE/EAGLE-3/MTP) have a one-layer paged KV cache of their own,
addressed by the target's slots: head entry ``p`` = (token ``x_{p+1}``, target
feature ``h_p``) lives at position ``p``. The window pass writes the entries
of every accepted position with the true tokens (drafts that were accepted,
then the corrected or bonus token) and true features; the chained draft steps
write entries past the accepted end, which the next window pass overwrites
before anything reads them (each query reads only positions <= its own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.heads import FusionHead, HeadConfig, combine_hidden_states, head_hidden_to_logits, medusa_hidden
from models.llama import LlamaConfig, lm_head_logits
from specjax.kv_cache import AttentionMetadata, KVCache
from specjax.sample.transforms import argmax_last
from specjax.spec_decode.draft_model import slots_for_positions
from specjax.spec_decode.proposer import EMPTY_DRAFTS, check_batch
from specjax.spec_decode.verify import assemble_window


def _embed(target_params, tokens: jax.Array) -> jax.Array:  # int [B, T] -> [B, T, D]
    return jnp.take(target_params["embed_tokens"]["embedding"], tokens, axis=0, mode="clip")


def head_propose(
    head_params,
    target_params,
    head_cache: KVCache | None,
    features: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    slot_mapping: jax.Array,
    block_tables: jax.Array,
    last_index: jax.Array,
    draft_ids: jax.Array,
    num_drafts: jax.Array,
    out_tokens: jax.Array,
    accepted: jax.Array,
    next_prompt: jax.Array,
    *,
    config: HeadConfig,
    target_config: LlamaConfig,
    num_out: int,
) -> tuple[jax.Array, KVCache | None]:
    """Drafts ``[B, num_out]`` for the next step of every row, and the updated head cache.

    features [B, C+K, F]: the verify pass's features of the window (catch-up ``tokens [B, C]`` then
    ``draft_ids [B, K]``, of which ``num_drafts [B]`` are real). out_tokens [B, K+1] / accepted [B]:
    the rejection sampler's result. next_prompt [B]: for rows still prefilling, the prompt token after
    this chunk; -1 for rows that sampled.
    """
    block_size = head_cache.block_size if head_cache is not None else 1
    win_tokens, win_pos, win_slots, _ = assemble_window(
        tokens, positions, slot_mapping, block_tables, last_index, draft_ids, num_drafts, block_size
    )  # [B, W] each
    b, w = win_tokens.shape
    rows = jnp.arange(b)
    prefilling = next_prompt >= 0
    accepted = jnp.where(prefilling, 0, accepted)
    last = last_index + accepted  # [B]: window index of the last entry with a known next token
    if config.method == "medusa":
        h = features[rows, last]  # [B, D]
        logits = lm_head_logits(target_params, medusa_hidden(head_params, h, config=config), config=target_config)
        return argmax_last(logits)[:, :num_out].astype(jnp.int32), None  # [B, num_out]

    # x_{p+1} of every entry: the window shifted left, then the sampled tokens from the last catch-up on.
    nxt = jnp.pad(win_tokens[:, 1:], ((0, 0), (0, 1)))  # [B, W]
    j = jnp.arange(out_tokens.shape[1], dtype=jnp.int32)
    cols = jnp.where(j[None, :] <= accepted[:, None], last_index[:, None] + j, w)  # [B, K+1], w = dropped
    nxt = nxt.at[rows[:, None], cols].set(out_tokens, mode="drop")
    nxt = nxt.at[rows, jnp.where(prefilling, last_index, w)].set(next_prompt, mode="drop")
    entry_ok = jnp.arange(w)[None, :] <= last[:, None]  # entries past `last` have no true next token yet
    md = AttentionMetadata(slot_mapping=jnp.where(entry_ok, win_slots, -1), block_tables=block_tables)
    head = FusionHead(config)
    feats = combine_hidden_states(head_params, features, config=config)  # [B, W, D]
    x, k_c, v_c = head.apply(
        {"params": head_params}, _embed(target_params, nxt), feats, win_pos, head_cache.k[0], head_cache.v[0], md,
        block_size,
    )  # x [B, W, D]
    g = x[rows, last]  # [B, D]: head hidden of the last true entry
    draft = argmax_last(head_hidden_to_logits(head_params, target_params, g[:, None], config=config,
                                              target_config=target_config)[:, 0])  # [B]
    drafts = jnp.zeros((b, num_out), jnp.int32).at[:, 0].set(draft)
    base = win_pos[rows, last]  # [B]
    limit = block_tables.shape[1] * block_size

    def body(i, carry):
        drafts, g, k_c, v_c = carry
        pos = (base + i)[:, None]  # [B, 1]: entry (d_i, g) sits one position past the previous one
        slot = slots_for_positions(block_tables, pos, pos < limit, block_size)
        step_md = AttentionMetadata(slot_mapping=slot, block_tables=block_tables)
        prev = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)  # [B, 1]: d_i
        x, k_c, v_c = head.apply({"params": head_params}, _embed(target_params, prev), g[:, None], pos, k_c, v_c,
                                 step_md, block_size)
        g = x[:, 0]
        tok = argmax_last(head_hidden_to_logits(head_params, target_params, x, config=config,
                                                target_config=target_config)[:, 0])
        return drafts.at[:, i].set(tok), g, k_c, v_c

    drafts, _, k_c, v_c = jax.lax.fori_loop(1, num_out, body, (drafts, g, k_c, v_c))
    return drafts, KVCache(k=(k_c,), v=(v_c,), block_size=block_size)


class HeadProposer:
    """Host side: keeps each request's drafts from the step that produced them until the next step.

    Drafts are valid only for the token count they were made at: a request that was preempted,
    or whose drafts belong to an older state, gets none (and the next window pass makes new ones).
    """

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, np.ndarray]] = {}

    def store(self, request_id: str, num_tokens: int, drafts: np.ndarray) -> None:
        self._drafts[request_id] = (num_tokens, np.asarray(drafts, np.int32))

    def propose(self, request_ids, token_ids, max_drafts) -> list[np.ndarray]:
        check_batch(request_ids, token_ids, max_drafts)
        out = []
        for rid, toks, m in zip(request_ids, token_ids, max_drafts):
            entry = self._drafts.get(rid)
            out.append(entry[1][:m] if entry is not None and entry[0] == len(toks) and m > 0 else EMPTY_DRAFTS)
        return out

    def finish(self, request_id: str, prompt_token_ids, output_token_ids) -> None:
        self._drafts.pop(request_id, None)
