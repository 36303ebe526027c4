"""Fusion draft heads (EAGLE, EAGLE-3, MTP): one decoder layer over [token embedding; target feature].

Each head has a one-layer paged KV cache of its own, addressed by the target's
slots: head entry ``p`` = (token ``x_{p+1}``, target feature ``h_p``) lives at
position ``p``. After the rejection sampler, :func:`fusion_head_drafts` walks
the verified window: it writes the entries of every accepted position with the
true tokens (drafts that were accepted, then the corrected or bonus token; the
next prompt token for rows still prefilling) and true features, then chains
``num_speculative_tokens`` draft steps feeding the layer's own output back as
the next entry's feature. Chained steps write entries past the accepted end,
which the next window pass overwrites before anything reads them (each query
reads only positions <= its own). EAGLE-3's feature fuses the target's
low/mid/high layers (``aux_layer_ids``); EAGLE and MTP read the final hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.heads import FusionHead, HeadConfig, combine_hidden_states, head_embed, head_greedy_tokens, \
    head_target_logits
from models.llama import LlamaConfig, is_cpu_layout
from specjax.kv_cache import AttentionMetadata, KVCache, slots_for_positions
from specjax.spec_decode.drafting import draft_keys, draw_draft
from specjax.spec_decode.heads import HeadProposer, HeadState, load_head_for
from specjax.spec_decode.proposer import BuildContext, Verified, register


def fusion_head_drafts(
    head_params, target_params, head_cache: KVCache, batch, verified: Verified, *, config: HeadConfig,
    target_config: LlamaConfig, num_out: int, keys: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Drafts ``[B, num_out]`` for the next step of every row, their q, and the updated head cache.

    ``verified`` holds the window (catch-up tokens then drafts), its target features and the rejection
    sampler's result; ``batch.next_token`` is the prompt token after this chunk for rows still
    prefilling (-1 for rows that sampled). ``keys`` [B] (the rows' next-step keys): rows that sample draw
    their drafts from the head's distribution shaped as the target's and q ``[B, num_out, V]`` is returned;
    None drafts greedily (q None).
    """
    block_size = head_cache.block_size
    win_tokens, win_pos, win_slots = verified.tokens, verified.positions, verified.slot_mapping  # [B, W]
    out_tokens = verified.out_tokens  # [B, K+1]
    b, w = win_tokens.shape
    rows = jnp.arange(b)
    prefilling = batch.next_token >= 0
    accepted = jnp.where(prefilling, 0, verified.accepted)
    last_index = batch.last_index
    last = last_index + accepted  # [B]: window index of the last entry with a known next token

    # x_{p+1} of every entry: the window shifted left, then the sampled tokens from the last catch-up on.
    nxt = jnp.pad(win_tokens[:, 1:], ((0, 0), (0, 1)))  # [B, W]
    j = jnp.arange(out_tokens.shape[1], dtype=jnp.int32)
    cols = jnp.where(j[None, :] <= accepted[:, None], last_index[:, None] + j, w)  # [B, K+1], w = dropped
    nxt = nxt.at[rows[:, None], cols].set(out_tokens, mode="drop")
    nxt = nxt.at[rows, jnp.where(prefilling, last_index, w)].set(batch.next_token, mode="drop")
    entry_ok = jnp.arange(w)[None, :] <= last[:, None]  # entries past `last` have no true next token yet
    md = AttentionMetadata(slot_mapping=jnp.where(entry_ok, win_slots, -1), block_tables=batch.block_tables)
    head = FusionHead(config)
    feats = combine_hidden_states(head_params, verified.features, config=config)  # [B, W, D]

    def embed(tokens):  # int [B, T] -> [B, T, D]: the head's own table or the target's
        return head_embed(head_params, target_params, tokens, config=config)

    draw_key = None if keys is None else draft_keys(keys)

    def next_token(hidden, j):  # [B, 1, D] -> ([B] target ids, q [B, V] or None)
        if keys is None:  # a reduced draft vocabulary maps back through d2t
            return head_greedy_tokens(head_params, target_params, hidden, config=config,
                                      target_config=target_config)[:, 0], None
        logits = head_target_logits(head_params, target_params, hidden, config=config, target_config=target_config)
        return draw_draft(logits[:, 0], batch.temperature, batch.top_k, batch.top_p, draw_key(j), probabilistic=True,
                          min_p=batch.min_p)

    # The head lives on its target's device: a target in the CPU layout (one CPU device) lets the head's
    # attention take the C++ kernel as well.
    cpu_layout = is_cpu_layout(target_params)
    x, k_c, v_c = head.apply(
        {"params": head_params}, embed(nxt), feats, win_pos, head_cache.k[0], head_cache.v[0], md, block_size,
        cpu_layout,
    )  # x [B, W, D]
    g = x[rows, last]  # [B, D]: head hidden of the last true entry

    tok, q = next_token(g[:, None], 0)
    drafts = jnp.zeros((b, num_out), jnp.int32).at[:, 0].set(tok)
    qs = None if q is None else jnp.zeros((b, num_out, q.shape[-1]), jnp.float32).at[:, 0].set(q)  # [B, N, V]
    base = win_pos[rows, last]  # [B]
    limit = batch.block_tables.shape[1] * block_size

    def body(i, carry):
        drafts, qs, g, k_c, v_c = carry
        pos = (base + i)[:, None]  # [B, 1]: entry (d_i, g) sits one position past the previous one
        slot = slots_for_positions(batch.block_tables, pos, pos < limit, block_size)
        step_md = AttentionMetadata(slot_mapping=slot, block_tables=batch.block_tables)
        prev = jax.lax.dynamic_slice_in_dim(drafts, i - 1, 1, axis=1)  # [B, 1]: d_i
        x, k_c, v_c = head.apply({"params": head_params}, embed(prev), g[:, None], pos, k_c, v_c, step_md,
                                 block_size, cpu_layout)
        tok, q = next_token(x, i)
        return drafts.at[:, i].set(tok), None if qs is None else qs.at[:, i].set(q), x[:, 0], k_c, v_c

    # Only as many chained drafts as the next step may verify (each is a head forward and, for sampled rows, a
    # vocabulary-wide draw); the rest stay zero, and the host never verifies them.
    ahead = jnp.max(batch.draft_ahead)
    n_out = jnp.where(ahead > 0, jnp.minimum(ahead, num_out), num_out)
    drafts, qs, _, k_c, v_c = jax.lax.fori_loop(1, n_out, body, (drafts, qs, g, k_c, v_c))
    return drafts, qs, KVCache(k=(k_c,), v=(v_c,), block_size=block_size)


class FusionHeadProposer(HeadProposer):
    """EAGLE / EAGLE-3 / MTP: see the module docstring."""

    chained_drafts = True

    def __init__(self, config: HeadConfig, params, *, target_config: LlamaConfig, num_speculative_tokens: int, mesh,
                 sampled_drafts: bool):
        super().__init__(config, params, num_speculative_tokens=num_speculative_tokens, mesh=mesh,
                         sampled_drafts=sampled_drafts)
        self.target_config = target_config
        self.features = "aux" if config.method == "eagle3" else "hidden"
        self.aux_layer_ids = config.aux_layer_ids

    def kv_lookahead(self, k: int) -> int:
        return self.num_out  # chained drafts write head KV up to num_out entries past the verified ones

    def _kv(self, *, num_kv_blocks, block_size, kv_dtype) -> KVCache:
        return KVCache.allocate(num_layers=1, num_blocks=num_kv_blocks, block_size=block_size,
                                num_kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim,
                                dtype=kv_dtype, sharding=self._replicated)

    def update(self, params, target_params, state: HeadState, batch, verified, *, k):
        keys = self.next_step_keys(batch, verified) if self.sampled_drafts else None
        drafts, q, kv = fusion_head_drafts(params, target_params, state.kv, batch, verified, config=self.config,
                                           target_config=self.target_config, num_out=self.num_out, keys=keys)
        return self.store(state, batch, drafts, kv, q)


def _build(ctx: BuildContext) -> FusionHeadProposer:
    config, params = load_head_for(ctx)
    return FusionHeadProposer(config, params, target_config=ctx.target_config,
                              num_speculative_tokens=ctx.spec.num_speculative_tokens, mesh=ctx.mesh,
                              sampled_drafts=ctx.spec.draft_sample_method != "greedy")


for _method in ("eagle", "eagle3", "mtp"):
    register(_method)(_build)
