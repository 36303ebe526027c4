"""Medusa heads (Cai et al. 2024): all K drafts from one evaluation of residual SiLU blocks.

Head ``i`` maps the target's final hidden state at the last accepted position to
a prediction of the token ``i + 2`` positions ahead (the target itself predicts
the next one), through the target's LM head. No KV cache of its own: after the
rejection sampler the drafts for the next step are read off the verify pass's
hidden states, so Medusa needs nothing beyond the one compiled step.
"""

from __future__ import annotations

import jax.numpy as jnp

from models.heads import HeadConfig, medusa_greedy_tokens, medusa_target_logits
from models.llama import LlamaConfig
from specjax.spec_decode.drafting import draft_keys, draw_draft
from specjax.spec_decode.heads import HeadProposer, HeadState, load_head_for
from specjax.spec_decode.proposer import BuildContext, register


class MedusaProposer(HeadProposer):
    """Drafts ``min(K, num_medusa_heads)`` tokens per step from the target's last accepted hidden state."""

    features = "hidden"

    def __init__(self, config: HeadConfig, params, *, target_config: LlamaConfig, num_speculative_tokens: int, mesh,
                 sampled_drafts: bool):
        super().__init__(config, params, num_speculative_tokens=num_speculative_tokens, mesh=mesh,
                         sampled_drafts=sampled_drafts)
        self.target_config = target_config

    def update(self, params, target_params, state: HeadState, batch, verified, *, k):
        rows = jnp.arange(verified.tokens.shape[0])
        accepted = jnp.where(batch.next_token >= 0, 0, verified.accepted)  # rows still prefilling: none
        h = verified.features[rows, batch.last_index + accepted]  # [B, D]
        if not self.sampled_drafts:
            drafts = medusa_greedy_tokens(params, target_params, h, config=self.config,
                                          target_config=self.target_config)  # [B, N] target ids
            return self.store(state, batch, drafts[:, : self.num_out], None)
        logits = medusa_target_logits(params, target_params, h, config=self.config,
                                      target_config=self.target_config)[:, : self.num_out]  # [B, K, V]
        key = draft_keys(self.next_step_keys(batch, verified))
        drawn = [draw_draft(logits[:, j], batch.temperature, batch.top_k, batch.top_p, key(j), probabilistic=True,
                            min_p=batch.min_p)
                 for j in range(self.num_out)]  # K is small and static: one draw per head
        drafts = jnp.stack([t for t, _ in drawn], axis=1)  # [B, K]
        return self.store(state, batch, drafts, None, jnp.stack([q for _, q in drawn], axis=1))


@register("medusa")
def build(ctx: BuildContext) -> MedusaProposer:
    config, params = load_head_for(ctx)
    k = ctx.spec.num_speculative_tokens
    if k > config.num_medusa_heads:
        raise ValueError(f"num_speculative_tokens={k} exceeds the Medusa head count {config.num_medusa_heads}")
    return MedusaProposer(config, params, target_config=ctx.target_config, num_speculative_tokens=k, mesh=ctx.mesh,
                          sampled_drafts=ctx.spec.draft_sample_method != "greedy")
