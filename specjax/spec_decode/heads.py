"""What the draft heads (EAGLE, EAGLE-3, MTP in :mod:`.eagle`; Medusa in :mod:`.medusa`) share.

A head needs the target's feature at the last accepted position, which only
exists once a step's verify pass has run. So a head drafts at the *end* of step
s, for step s+1 (``drafts_ahead``), inside the same compiled step: its drafts
stay on device in ``HeadState.drafts``, one row per persistent request slot,
and step s+1 gathers them by slot. The host only tracks whether a slot's drafts
are current (the row sampled in its last step); it never sees them.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from models.heads import HeadConfig, head_to_cpu_layout, load_head
from specjax.backends import use_cpu_weight_layout
from specjax.builtin import resolve_model
from specjax.kv_cache import KVCache
from specjax.parallel.sharding import quantized_draft
from specjax.sample.transforms import request_keys
from specjax.spec_decode.proposer import BuildContext, Proposer


@flax.struct.dataclass
class HeadState:
    """A draft head's device state."""

    kv: KVCache | None
    """The head's one-layer paged KV (fusion heads; addressed by the target's slots), or None (Medusa)."""
    drafts: jax.Array
    """int32 [S, num_speculative_tokens]: each slot's drafts for its next step (valid per the host's flag)."""
    q: jax.Array | None
    """float32 [S, num_speculative_tokens, V]: the distributions sampled drafts were drawn from (rows that
    sample), or None when the head drafts greedily only."""


class HeadProposer(Proposer):
    """Base of the head methods: weights replicated on every device, pending drafts kept per slot."""

    syncs = True

    drafts_ahead = True

    def __init__(self, config: HeadConfig, params, *, num_speculative_tokens: int, mesh, sampled_drafts: bool):
        self.config = config
        self.num_out = num_speculative_tokens
        self.sampled_drafts = sampled_drafts
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.params = jax.device_put(params, self._replicated)

    def param_shardings(self, plan):
        return self._replicated

    def _kv(self, *, num_kv_blocks, block_size, kv_dtype) -> KVCache | None:
        return None

    def init_state(self, *, num_slots, num_kv_blocks, block_size, kv_dtype, plan):
        drafts = jnp.zeros((num_slots, self.num_out), jnp.int32, device=self._replicated)
        q = None
        if self.sampled_drafts:
            q = jnp.zeros((num_slots, self.num_out, self.config.vocab_size), jnp.float32, device=self._replicated)
        return HeadState(kv=self._kv(num_kv_blocks=num_kv_blocks, block_size=block_size, kv_dtype=kv_dtype),
                         drafts=drafts, q=q)

    def state_shardings(self, plan):
        return self._replicated

    def propose(self, params, target_params, state, batch, keys, *, k):
        slots = jnp.clip(batch.slots, 0, state.drafts.shape[0] - 1)
        q = None if state.q is None else state.q[slots, :k]  # [B, K, V]
        return state.drafts[slots, :k], q, state  # [B, K]; rows without current drafts verify none

    def store(self, state: HeadState, batch, drafts: jax.Array, kv: KVCache | None, q=None) -> HeadState:
        """Write ``drafts [B, num_out]`` (and ``q [B, num_out, V]``) to each row's slot (padding: nowhere)."""
        num_slots = state.drafts.shape[0]
        slots = jnp.where(batch.slots >= 0, batch.slots, num_slots)
        q_all = None if state.q is None else state.q.at[slots].set(q, mode="drop")
        return HeadState(kv=kv, drafts=state.drafts.at[slots].set(drafts, mode="drop"), q=q_all)

    def next_step_keys(self, batch, verified) -> jax.Array:
        """Typed keys [B] of each row's next step (the drafts made now are verified then)."""
        return request_keys(jax.random.key(0), batch.seeds, batch.sample_indices + verified.accepted + 1,
                            streams=batch.seed_streams)


def load_head_for(ctx: BuildContext) -> tuple[HeadConfig, dict]:
    """The head at ``speculative_config.model``, checked against the method and the target."""
    spec = ctx.spec
    config, params = load_head(resolve_model(spec.model), dtype=ctx.jnp_dtype, target_config=ctx.target_config)
    if config.method != spec.method:
        raise ValueError(f"speculative_config.model {spec.model!r} is a {config.method} head, but method={spec.method!r}")
    config.check_target(ctx.target_config)
    if use_cpu_weight_layout(ctx.mesh.devices.flat):  # beside a target in the CPU layout (the same choice)
        params = (quantized_draft(head_to_cpu_layout, params, config, q8_0=True) if spec.quantization == "q8_0"
                  else head_to_cpu_layout(params, config))
    return config, params
