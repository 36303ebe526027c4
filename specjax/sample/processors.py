"""Logits processors (logit bias, banned tokens, min_tokens, penalties) and logprobs, exact under speculation.

Every verified position ``j`` of a row sees the logits its plain-decoding twin
would see: its context is the committed history plus the drafts before ``j``,
so output-token counts and the output index (for ``min_tokens``) are taken at
``j``. The order is vLLM's: logit bias (banned ``bad_words`` are a bias of
-inf) -> min_tokens (stop tokens -inf while fewer than ``min_tokens`` tokens
are out) -> repetition penalty (tokens seen in prompt or output) -> frequency
and presence penalties (output counts); then greedy rows take the argmax and
sampling rows go on to temperature, min-p, top-k and top-p.

The counts live on device, per slot, in :class:`SamplingState` (part of the
decode state): each step first absorbs its catch-up tokens (a slot starts
over when the host says ``reset``; tokens already counted are skipped, so
re-reading the last committed token never counts twice), then, after the
sampler, the tokens it committed. Each piece runs only when a row of the step
uses it (``lax.cond`` on the batch), so plain requests pay nothing.

Shape letters: b rows, t positions of a row's window (K+1, or 1), v vocabulary,
s slots, n logit-bias entries, m stop ids, k drafts.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

_NEG_INF = float("-inf")


@flax.struct.dataclass
class SamplingState:
    """Per-slot token statistics the penalties need."""

    counts: jax.Array
    """int32 [S, V]: how often each token appears in the slot's committed output."""
    prompt_mask: jax.Array
    """bool [S, V]: the token appears in the slot's prompt."""
    counted_upto: jax.Array
    """int32 [S]: positions below this are already in ``counts`` / ``prompt_mask``."""

    @classmethod
    def zeros(cls, num_slots: int, vocab: int, device=None) -> "SamplingState":
        return cls(counts=jnp.zeros((num_slots, vocab), jnp.int32, device=device),
                   prompt_mask=jnp.zeros((num_slots, vocab), bool, device=device),
                   counted_upto=jnp.zeros((num_slots,), jnp.int32, device=device))


def _uses_penalties(batch) -> jax.Array:
    return (batch.presence_penalty != 0) | (batch.frequency_penalty != 0) | (batch.repetition_penalty != 1)


def _slot_index(batch, num_slots: int) -> jax.Array:
    return jnp.where(batch.slots >= 0, batch.slots, num_slots)  # padding rows: out of range (dropped)


def absorb_context(state: SamplingState, batch) -> SamplingState:
    """Reset newly assigned slots, then count this step's catch-up tokens not counted yet."""
    def update():
        s = state.counts.shape[0]
        slot = _slot_index(batch, s)  # [B]
        rows = jnp.clip(slot, 0, s - 1)
        fresh = batch.reset | ~_uses_penalties(batch)  # rows without penalties keep empty statistics
        counts = jnp.where(fresh[:, None], 0, state.counts[rows])  # [B, V]
        prompt_mask = jnp.where(fresh[:, None], False, state.prompt_mask[rows])  # [B, V]
        upto = jnp.where(fresh, 0, state.counted_upto[rows])  # [B]
        real = batch.slot_mapping >= 0  # [B, T]
        new = real & (batch.positions >= upto[:, None]) & _uses_penalties(batch)[:, None]
        in_prompt = batch.positions < batch.prompt_len[:, None]
        b = jnp.arange(counts.shape[0])[:, None]
        counts = counts.at[b, batch.tokens].add((new & ~in_prompt).astype(jnp.int32))
        prompt_mask = prompt_mask.at[b, batch.tokens].max(new & in_prompt)
        last = jnp.max(jnp.where(real, batch.positions + 1, 0), axis=1)  # [B]
        upto = jnp.where(_uses_penalties(batch), jnp.maximum(upto, last), 0)
        return SamplingState(counts=state.counts.at[slot].set(counts, mode="drop"),
                             prompt_mask=state.prompt_mask.at[slot].set(prompt_mask, mode="drop"),
                             counted_upto=state.counted_upto.at[slot].set(upto, mode="drop"))

    return jax.lax.cond(jnp.any(_uses_penalties(batch) | batch.reset), update, lambda: state)


def absorb_committed(state: SamplingState, batch, out_tokens: jax.Array, accepted: jax.Array,
                     first_position: jax.Array) -> SamplingState:
    """Count the tokens a step committed: ``out_tokens [B, K+1]`` up to ``accepted + 1`` per row, the first
    at ``first_position [B]``."""
    def update():
        s = state.counts.shape[0]
        slot = _slot_index(batch, s)
        rows = jnp.clip(slot, 0, s - 1)
        b, t = out_tokens.shape
        keep = (jnp.arange(t)[None, :] <= accepted[:, None]) & _uses_penalties(batch)[:, None]  # [B, K+1]
        keep &= batch.next_token[:, None] < 0  # rows still prefilling commit nothing
        counts = state.counts[rows].at[jnp.arange(b)[:, None], jnp.maximum(out_tokens, 0)].add(
            keep.astype(jnp.int32))  # [B, V]
        upto = jnp.where(keep.any(axis=1), first_position + accepted + 1, state.counted_upto[rows])
        return state.replace(counts=state.counts.at[slot].set(counts, mode="drop"),
                             counted_upto=state.counted_upto.at[slot].set(upto, mode="drop"))

    return jax.lax.cond(jnp.any(_uses_penalties(batch)), update, lambda: state)


def window_counts(state: SamplingState, batch, drafts: jax.Array) -> jax.Array:
    """int32 [B, K+1, V]: output counts at each window position (the drafts before it included)."""
    s = state.counts.shape[0]
    base = state.counts[jnp.clip(batch.slots, 0, s - 1)]  # [B, V]
    k = drafts.shape[1]
    vocab = base.shape[-1]
    onehot = jax.nn.one_hot(drafts, vocab, dtype=jnp.int32) * (jnp.arange(k) < batch.num_drafts[:, None])[..., None]
    before = jnp.cumsum(jnp.pad(onehot, ((0, 0), (1, 0), (0, 0))), axis=1)  # [B, K+1, V]
    return base[:, None, :] + before


def apply_processors(logits: jax.Array, state: SamplingState, batch, drafts: jax.Array) -> jax.Array:
    """Processed logits ``[B, K+1, V]`` (float32) of the window: bias, min_tokens, penalties (see module doc)."""
    logits = logits.astype(jnp.float32)
    b, t, vocab = logits.shape
    rows = jnp.arange(b)[:, None]

    def bias(x):
        ids = jnp.where(batch.bias_ids >= 0, batch.bias_ids, vocab)  # [B, N]; padding dropped
        add = jnp.zeros((b, vocab), jnp.float32).at[rows, ids].add(batch.bias_values, mode="drop")  # [B, V]
        return x + add[:, None, :]

    def min_tokens(x):
        out_index = batch.sample_indices[:, None] + jnp.arange(t)[None, :]  # [B, T]
        ids = jnp.where(batch.stop_ids >= 0, batch.stop_ids, vocab)  # [B, M]
        stops = jnp.zeros((b, vocab), bool).at[rows, ids].set(True, mode="drop")  # [B, V]
        blocked = (out_index < batch.min_tokens[:, None])[..., None] & stops[:, None, :]  # [B, T, V]
        return jnp.where(blocked, _NEG_INF, x)

    def penalties(x):
        counts = window_counts(state, batch, drafts[:, : t - 1])  # [B, T, V]
        s = state.prompt_mask.shape[0]
        seen = (counts > 0) | state.prompt_mask[jnp.clip(batch.slots, 0, s - 1)][:, None, :]
        rep = batch.repetition_penalty[:, None, None]
        x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - batch.frequency_penalty[:, None, None] * counts
        return x - batch.presence_penalty[:, None, None] * (counts > 0)

    logits = jax.lax.cond(jnp.any(batch.bias_ids >= 0), bias, lambda x: x, logits)
    logits = jax.lax.cond(jnp.any(batch.min_tokens > batch.sample_indices), min_tokens, lambda x: x, logits)
    return jax.lax.cond(jnp.any(_uses_penalties(batch)), penalties, lambda x: x, logits)


def logprob_outputs(raw_logits: jax.Array, tokens: jax.Array, num_logprobs: jax.Array, top_n: int) -> jax.Array:
    """float32 [B, T, 2 + 2 * top_n]: per position, the log-probability of ``tokens [B, T]`` under the raw
    logits, its rank (1 = most likely), then the ``top_n`` most likely ids and their log-probabilities."""
    def compute():
        lp = jax.nn.log_softmax(raw_logits.astype(jnp.float32), axis=-1)  # [B, T, V]
        safe = jnp.maximum(tokens, 0)[..., None]
        chosen = jnp.take_along_axis(lp, safe, axis=-1)  # [B, T, 1]
        rank = 1 + jnp.sum(lp > chosen, axis=-1, keepdims=True).astype(jnp.float32)
        top_lp, top_ids = jax.lax.top_k(lp, top_n)  # [B, T, N]
        return jnp.concatenate([chosen, rank, top_ids.astype(jnp.float32), top_lp], axis=-1)

    shape = raw_logits.shape[:2] + (2 + 2 * top_n,)
    return jax.lax.cond(jnp.any(num_logprobs >= 0), compute, lambda: jnp.zeros(shape, jnp.float32))
