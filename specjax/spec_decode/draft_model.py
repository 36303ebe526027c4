"""Draft-model proposer: a small LLM drafts K tokens in one jitted call.

The draft shares the target's vocabulary, or maps to it through a ``vocab_map``
(``use_heterogeneous_vocab``, see :mod:`specjax.spec_decode.vocab_map`).

The draft has its own paged KV cache with the target's block size and block
count, so the target's block tables and slot mapping address it unchanged.
Each step it first catches up on the target's catch-up tokens plus the one
committed token before them (``StepBatch.prev_token``): when every draft of the
previous step was accepted, the last draft was never fed to the draft model, and
re-feeding the previous token (rewriting an identical KV entry otherwise) keeps
the draft's cache complete without any bookkeeping. Then it drafts
autoregressively inside ``lax.fori_loop``: the whole draft runs inside the
engine's one compiled step, K tokens per row.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.cpu_layout import model_q8_0
from models.llama import LlamaConfig, forward
from models.loading import load_blocks, load_model
from specjax.builtin import resolve_model
from specjax.kv_cache import AttentionMetadata, KVCache, slots_for_positions
from specjax.parallel.sharding import ShardingPlan, quantized_draft
from specjax.spec_decode.drafting import draft_keys, draw_draft
from specjax.spec_decode.proposer import BuildContext, Proposer, register


def draft_propose(
    draft_params,
    draft_cache: KVCache,
    batch,
    keys: jax.Array,
    *,
    config: LlamaConfig,
    k: int,
    probabilistic: bool,
    vocab_map: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Catch up on ``[prev_token, batch.tokens]`` then draft ``k`` tokens per row.

    ``batch`` is the step's ``StepBatch``: catch-up tokens [B, T], ``num_drafts`` [B] (how many drafts
    each row verifies, <= k; KV is written only for draft positions a row needs), per-row sampling
    parameters. keys [B]: per-request keys; draft j draws from fold_in(fold_in(key, DRFT tag), j).
    Returns (draft ids int32 [B, K], q float32 [B, K, V] or None, new draft cache).

    vocab_map (heterogeneous vocabularies, greedy only): (target_to_draft int32 [V_target],
    draft_to_target int32 [V_draft]) from :mod:`specjax.spec_decode.vocab_map`. Tokens are then
    target ids, consumed as their draft ids; the draft argmaxes over the shared tokens only and the
    returned drafts are target ids.
    """
    b = batch.tokens.shape[0]
    block_size = draft_cache.block_size
    # The catch-up window, one token wider on the left: [B, T+1].
    first_pos = batch.positions[:, :1]  # [B, 1]
    has_prev = (batch.prev_token >= 0)[:, None]  # [B, 1]
    prev_slot = slots_for_positions(batch.block_tables, jnp.maximum(first_pos - 1, 0), has_prev, block_size)
    tokens = jnp.concatenate([jnp.maximum(batch.prev_token, 0)[:, None], batch.tokens], axis=1)  # [B, T+1]
    positions = jnp.concatenate([jnp.maximum(first_pos - 1, 0), batch.positions], axis=1)  # [B, T+1]
    slot_mapping = jnp.concatenate([prev_slot, batch.slot_mapping], axis=1)  # [B, T+1]
    last_index = batch.last_index + 1  # [B]
    temperature, top_k, top_p = batch.temperature, batch.top_k, batch.top_p

    shared = None
    if vocab_map is not None:
        if probabilistic:
            raise ValueError("vocab_map (heterogeneous vocabularies) drafts greedily only, got probabilistic=True")
        target_to_draft, draft_to_target = vocab_map
        tokens = jnp.take(target_to_draft, tokens, axis=0)  # [B, T+1] draft ids
        shared = draft_to_target >= 0  # [V_draft]: only tokens the target also has may be drafted

    def draw(step_logits, key):  # [B, V] -> (ids [B], q [B, V] or None)
        if shared is not None:
            step_logits = jnp.where(shared, step_logits, -jnp.inf)
        return draw_draft(step_logits, temperature, top_k, top_p, key, probabilistic=probabilistic,
                          min_p=batch.min_p)

    md = AttentionMetadata(slot_mapping=slot_mapping, block_tables=batch.block_tables)
    logits, _, draft_cache = forward(
        draft_params, tokens, positions, draft_cache, md, config=config,
        logits_indices=last_index[:, None][:, :min(k, 1)],
    )  # [B, min(k, 1), V]
    if k == 0:  # a plain step: the draft only keeps its cache in step with the target's
        return jnp.zeros((b, 0), jnp.int32), None, draft_cache
    draft_key = draft_keys(keys)
    tok, q = draw(logits[:, 0], draft_key(0))
    draft_ids = jnp.zeros((b, k), jnp.int32).at[:, 0].set(tok)  # [B, K]
    vocab = logits.shape[-1]
    draft_probs = jnp.zeros((b, k, vocab), jnp.float32).at[:, 0].set(q) if probabilistic else None
    last_pos = jnp.take_along_axis(positions, last_index[:, None], axis=1)[:, 0]  # [B]: position of x_{L-1}
    num_drafts = batch.num_drafts

    def body(j, carry):
        draft_ids, draft_probs, cache = carry
        prev = draft_ids[:, j - 1]  # [B]: d_j, fed at position last_pos + j
        pos = (last_pos + j)[:, None]  # [B, 1]
        slot = slots_for_positions(batch.block_tables, pos, (j < num_drafts)[:, None], block_size)
        step_md = AttentionMetadata(slot_mapping=slot, block_tables=batch.block_tables)
        step_logits, _, cache = forward(draft_params, prev[:, None], pos, cache, step_md, config=config)
        tok, q = draw(step_logits[:, 0], draft_key(j))
        draft_ids = draft_ids.at[:, j].set(tok)
        if probabilistic:
            draft_probs = draft_probs.at[:, j].set(q)
        return draft_ids, draft_probs, cache

    draft_ids, draft_probs, draft_cache = jax.lax.fori_loop(1, k, body, (draft_ids, draft_probs, draft_cache))
    if vocab_map is not None:
        draft_ids = jnp.take(draft_to_target, draft_ids, axis=0)  # [B, K] target ids (all shared: never -1)
    return draft_ids, draft_probs, draft_cache


@flax.struct.dataclass
class DraftState:
    """The draft model's device state."""

    kv: KVCache
    """The draft's paged KV cache (the target's block size and count; addressed by the target's slots)."""


class DraftModelProposer(Proposer):
    """A small LLM with the target's vocabulary (or a mapped one) drafts K tokens per step on device."""

    syncs = True

    def __init__(self, config: LlamaConfig, params, *, plan: ShardingPlan, probabilistic: bool,
                 vocab_map: tuple[np.ndarray, np.ndarray] | None = None):
        self.config = config
        self.plan = plan
        self.probabilistic = probabilistic
        self.sampled_drafts = probabilistic
        self._shardings = (plan.params(params, config), None if vocab_map is None else plan.replicated)
        self.params = jax.device_put((params, vocab_map), self._shardings)

    def param_shardings(self, plan):
        return self._shardings

    def init_state(self, *, num_slots, num_kv_blocks, block_size, kv_dtype, plan):
        c = self.config
        return DraftState(kv=KVCache.allocate(
            num_layers=c.num_hidden_layers, num_blocks=num_kv_blocks, block_size=block_size,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=kv_dtype, sharding=self.plan.kv(c),
        ))

    def state_shardings(self, plan):
        return DraftState(kv=self.plan.kv(self.config))

    def propose(self, params, target_params, state, batch, keys, *, k):
        draft_params, vocab_map = params
        drafts, q, kv = draft_propose(draft_params, state.kv, batch, keys, config=self.config, k=k,
                                      probabilistic=self.probabilistic, vocab_map=vocab_map)
        return drafts, q, DraftState(kv=kv)


@register("draft_model")
def build(ctx: BuildContext) -> DraftModelProposer:
    spec = ctx.spec
    draft_tp = spec.draft_tensor_parallel_size  # checked against the target's by LLM
    path = resolve_model(spec.model)
    config, params = load_model(path, dtype=ctx.dtype)
    vocab_map = None
    if spec.use_heterogeneous_vocab:
        from specjax.spec_decode.vocab_map import load_vocab_map

        vocab_map = load_vocab_map(ctx.tokenizer, path, target_vocab_size=ctx.target_config.vocab_size,
                                   draft_vocab_size=config.vocab_size).arrays
    elif config.vocab_size != ctx.target_config.vocab_size:
        raise ValueError(
            f"speculative_config.model vocab_size={config.vocab_size} differs from the target's "
            f"{ctx.target_config.vocab_size}; a draft with its own tokenizer needs use_heterogeneous_vocab=True"
        )
    plan = ShardingPlan(mesh=ctx.mesh, tp=ctx.tensor_parallel_size if draft_tp is None else draft_tp)
    if spec.quantization == "q8_0":
        params, blocks = quantized_draft(model_q8_0, params, config)
        params = plan.layout(params, config, quantized=blocks, int8_activations=True)
    else:  # large models on CPU: the catch-up forward's few rows stream each weight once
        params = plan.layout(params, config, quantized=load_blocks(path))
    return DraftModelProposer(config, params, plan=plan, vocab_map=vocab_map,
                              probabilistic=spec.draft_sample_method != "greedy" and vocab_map is None)
