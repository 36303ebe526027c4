"""The one compiled step: decode state as a pytree, the padded batch, and draft -> verify -> sample -> update.

Per bucket (rows, query length, K) there is one
ahead-of-time compiled executable of :func:`decode_step`. It takes the
:class:`DecodeState` donated (every cache is updated in place), runs the
proposer's drafting, one target forward over each row's catch-up tokens and
drafts, the sampler (plain sampling at K = 0, rejection sampling otherwise) and
the proposer's after-verify update, and returns one small int32 array the host
fetches once: each row's committed tokens and accepted count.

Shape letters as in :mod:`specjax.kv_cache`; K = drafts per row, W = window.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig
from specjax.kv_cache import KVCache
from specjax.sample.processors import SamplingState, absorb_committed, absorb_context, apply_processors, \
    logprob_outputs
from specjax.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from specjax.sample.transforms import argmax_last, request_keys, row_exponentials, sample_with_exponentials, \
    shape_logits
from specjax.spec_decode.proposer import Proposer, Verified
from specjax.spec_decode.verify import assemble_window, verify_forward, verify_tokens


MAX_BIAS = MAX_LOGIT_BIAS
"""Logit-bias entries one row can carry (its logit_bias plus banned single-token bad_words)."""
MAX_STOP_IDS = 32
"""Stop ids one row's min_tokens can block."""


@flax.struct.dataclass
class DecodeState:
    """Everything the device carries from one step to the next; donated through every step."""

    target_kv: KVCache
    """The target's paged KV cache."""
    proposer: Any
    """The proposer's own device state (a draft model's or head's KV, pending drafts), or None."""
    sampling: SamplingState
    """Per-slot token statistics for the penalties."""


@flax.struct.dataclass
class StepBatch:
    """A padded step of ``B`` rows, ``T`` catch-up tokens and up to ``K`` drafts per row.

    Padding rows have ``slots == -1``, all-(-1) ``slot_mapping`` and block tables and
    ``num_drafts == 0``: they write nothing and their outputs are discarded.
    """

    tokens: jax.Array
    """int32 [B, T]: catch-up token ids (0 in padding)."""
    positions: jax.Array
    """int32 [B, T]: absolute positions (0 in padding)."""
    slot_mapping: jax.Array
    """int32 [B, T]: KV slot per token; -1 = padding, not written."""
    block_tables: jax.Array
    """int32 [B, M]: each row's KV blocks; -1 = unused."""
    last_index: jax.Array
    """int32 [B]: index in T of each row's last real token (its logits are sampled)."""
    slots: jax.Array
    """int32 [B]: the request's persistent slot (indexes per-slot device state); -1 = padding row."""
    num_drafts: jax.Array
    """int32 [B]: drafts this row verifies (<= K); 0 for rows that do not sample this step."""
    host_drafts: jax.Array
    """int32 [B, K]: drafts from a host proposer (zeros otherwise)."""
    prev_token: jax.Array
    """int32 [B]: the committed token just before ``tokens[:, 0]``; -1 at the sequence start or padding."""
    next_token: jax.Array
    """int32 [B]: for rows still prefilling, the prompt token after this chunk; -1 for rows that sample."""
    temperature: jax.Array
    """float32 [B]: 0 = greedy (also padding)."""
    top_k: jax.Array
    """int32 [B]: 0 = off."""
    top_p: jax.Array
    """float32 [B]: 1 = off."""
    seed_streams: jax.Array
    """uint32 [B]: 0 = user seed, 1 = engine-derived seed."""
    seeds: jax.Array
    """uint32 [B]: per-request seed."""
    sample_indices: jax.Array
    """int32 [B]: output position of the first token sampled this step (keys the noise)."""
    min_p: jax.Array
    """float32 [B]: 0 = off."""
    presence_penalty: jax.Array
    """float32 [B]: 0 = off."""
    frequency_penalty: jax.Array
    """float32 [B]: 0 = off."""
    repetition_penalty: jax.Array
    """float32 [B]: 1 = off."""
    bias_ids: jax.Array
    """int32 [B, MAX_BIAS]: token ids of the row's logit bias (banned bad words included); -1 = unused."""
    bias_values: jax.Array
    """float32 [B, MAX_BIAS]: the bias of each id (-inf bans)."""
    min_tokens: jax.Array
    """int32 [B]: stop ids are blocked while fewer than this many tokens are out."""
    stop_ids: jax.Array
    """int32 [B, MAX_STOP_IDS]: the row's stop ids (EOS and stop_token_ids) for min_tokens; -1 = unused."""
    prompt_len: jax.Array
    """int32 [B]: the request's prompt length (positions below it are prompt for the penalties)."""
    reset: jax.Array
    """bool [B]: the slot was just (re)assigned: its per-slot statistics start over."""
    num_logprobs: jax.Array
    """int32 [B]: top log-probabilities to return per committed token; -1 = no logprobs."""
    attached: jax.Array
    """bool [B]: the proposer follows this row (keeps its state in step to draft for it later); False for
    padding and in a *detached* step. A step without drafts and without attached rows skips the proposer."""
    draft_ahead: jax.Array
    """int32 [B]: drafts a proposer with ``chained_drafts`` makes for the rows' next step (the most over the
    rows; 0 = padding, and all of them when every row is 0)."""

    @classmethod
    def zeros(cls, batch: int, length: int, k: int, max_blocks: int) -> "StepBatch":
        """Host (numpy) buffers for one bucket, filled with the padding values."""
        i32 = np.int32
        return cls(
            tokens=np.zeros((batch, length), i32),
            positions=np.zeros((batch, length), i32),
            slot_mapping=np.full((batch, length), -1, i32),
            block_tables=np.full((batch, max_blocks), -1, i32),
            last_index=np.zeros((batch,), i32),
            slots=np.full((batch,), -1, i32),
            num_drafts=np.zeros((batch,), i32),
            host_drafts=np.zeros((batch, k), i32),
            prev_token=np.full((batch,), -1, i32),
            next_token=np.full((batch,), -1, i32),
            temperature=np.zeros((batch,), np.float32),
            top_k=np.zeros((batch,), i32),
            top_p=np.ones((batch,), np.float32),
            seed_streams=np.zeros((batch,), np.uint32),
            seeds=np.zeros((batch,), np.uint32),
            sample_indices=np.zeros((batch,), i32),
            min_p=np.zeros((batch,), np.float32),
            presence_penalty=np.zeros((batch,), np.float32),
            frequency_penalty=np.zeros((batch,), np.float32),
            repetition_penalty=np.ones((batch,), np.float32),
            bias_ids=np.full((batch, MAX_BIAS), -1, i32),
            bias_values=np.zeros((batch, MAX_BIAS), np.float32),
            min_tokens=np.zeros((batch,), i32),
            stop_ids=np.full((batch, MAX_STOP_IDS), -1, i32),
            prompt_len=np.zeros((batch,), i32),
            reset=np.zeros((batch,), bool),
            num_logprobs=np.full((batch,), -1, i32),
            attached=np.zeros((batch,), bool),
            draft_ahead=np.zeros((batch,), i32),
        )


_WINDOW_FIELDS = ("tokens", "positions", "slot_mapping")  # the [B, T] fields, stacked in PackedBatch.window


@flax.struct.dataclass
class PackedBatch:
    """A :class:`StepBatch` as the compiled step receives it: three int32 arrays, not 29.

    Each argument of a compiled call costs host time (a jit call with ~35 small host arrays took 162 us, with
    4 arrays 29 us); the engine's host buffers are numpy views into these three (:func:`host_buffers`), so
    filling a step writes them in place. ``unpack`` (inside the step) restores the fields by static slices.
    """

    window: jax.Array
    """int32 [B, 3, T]: tokens, positions and slot_mapping."""
    host_drafts: jax.Array
    """int32 [B, K]: ``StepBatch.host_drafts``."""
    rows: jax.Array
    """int32 [B, C]: every other field, one after another in :class:`StepBatch` order (float32 and uint32
    fields as their bits, bool fields as 0 / 1)."""

    def unpack(self) -> StepBatch:
        """The fields, by static slices of the arrays (traced: free inside the step)."""

        def as_field(col, dtype):
            if dtype == np.bool_:
                return col != 0
            return col if dtype == np.int32 else jax.lax.bitcast_convert_type(col, dtype)

        return _split(self, as_field)


@functools.cache
def _row_layout(max_blocks: int) -> tuple[tuple[str, int, int | None, np.dtype], ...]:
    """(name, first column, width or None for a [B] field, dtype) of each field in PackedBatch.rows, in order."""
    out, start = [], 0
    for name, a in vars(StepBatch.zeros(1, 1, 0, max_blocks)).items():
        if name in _WINDOW_FIELDS or name == "host_drafts":
            continue
        width = None if a.ndim == 1 else a.shape[1]
        out.append((name, start, width, a.dtype))
        start += 1 if width is None else width
    return tuple(out)


def _num_row_columns(max_blocks: int) -> int:
    _, start, width, _ = _row_layout(max_blocks)[-1]
    return start + (1 if width is None else width)


@functools.cache
def _max_blocks(columns: int) -> int:
    """Inverse of :func:`_num_row_columns` (M is the only variable width in the rows)."""
    fixed = _num_row_columns(0)
    if columns < fixed:
        raise ValueError(f"PackedBatch.rows has {columns} columns; at least {fixed} expected")
    return columns - fixed


def _split(packed: PackedBatch, as_field) -> StepBatch:
    """The StepBatch whose fields are ``packed``'s slices, each row-array column block passed through
    ``as_field(block, the field's dtype)``."""
    fields = {name: packed.window[:, i] for i, name in enumerate(_WINDOW_FIELDS)}
    fields["host_drafts"] = packed.host_drafts
    for name, start, width, dtype in _row_layout(_max_blocks(packed.rows.shape[1])):
        col = packed.rows[:, start] if width is None else packed.rows[:, start:start + width]
        fields[name] = as_field(col, dtype)
    return StepBatch(**fields)


def _host_views(packed: PackedBatch) -> StepBatch:
    """StepBatch fields as numpy views into ``packed``'s host arrays (writes to them fill the packed step)."""
    # Bool fields stay 0 / 1 int32 views; float32 and uint32 fields are views of the same bytes.
    return _split(packed, lambda col, dtype: col if dtype in (np.int32, np.bool_) else col.view(dtype))


def host_buffers(batch: int, length: int, k: int, max_blocks: int) -> tuple[StepBatch, PackedBatch]:
    """One bucket's host buffers, filled with the padding values: (StepBatch of views, the packed arrays)."""
    packed = pack(StepBatch.zeros(batch, length, k, max_blocks))
    return _host_views(packed), packed


def pack(batch: StepBatch) -> PackedBatch:
    """A host StepBatch copied into packed numpy arrays."""
    b = batch.tokens.shape[0]
    rows = np.empty((b, _num_row_columns(batch.block_tables.shape[1])), np.int32)
    for name, start, width, dtype in _row_layout(batch.block_tables.shape[1]):
        value = np.asarray(getattr(batch, name))
        value = value.astype(np.int32) if dtype == np.bool_ else value.view(np.int32)
        rows[:, start:start + (width or 1)] = value.reshape(b, width or 1)
    return PackedBatch(window=np.stack([np.asarray(getattr(batch, n), np.int32) for n in _WINDOW_FIELDS], axis=1),
                       host_drafts=np.asarray(batch.host_drafts, np.int32), rows=rows)


def batch_keys(batch: StepBatch) -> jax.Array:
    """Typed PRNG keys [B]: depend only on the request and its output position, never on the batch."""
    return request_keys(jax.random.key(0), batch.seeds, batch.sample_indices, streams=batch.seed_streams)


def _sample_plain(logits: jax.Array, batch: StepBatch, keys: jax.Array) -> jax.Array:
    """One token per row of ``logits [B, V]``: an argmax pass alone when no row samples."""
    greedy = argmax_last(logits)  # [B]
    random_rows = batch.temperature > 0

    def sampled():
        shaped = shape_logits(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)  # [B, V]
        drawn = sample_with_exponentials(shaped, row_exponentials(keys, logits.shape[-1:]), logits=True)
        return jnp.where(random_rows, drawn, greedy)

    return jax.lax.cond(jnp.any(random_rows), sampled, lambda: greedy)


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: holds the proposer and arrays
class StepSpec:
    """What a step computes, fixed per engine (closed over by every compiled step)."""

    config: LlamaConfig
    """The target's config."""
    proposer: Proposer
    """The speculative method (plain decoding: the base ``Proposer``)."""
    method: str
    """Rejection sampling method: "standard", "block" or "synthetic"."""
    rates: np.ndarray | None
    """Conditional synthetic acceptance rates [K_max] (method "synthetic"), else None."""
    use_kernel: bool
    """Run the fused Pallas rejection kernel (see :mod:`specjax.backends`)."""


def _window(batch: StepBatch, drafts: jax.Array, block_size: int):
    return assemble_window(batch.tokens, batch.positions, batch.slot_mapping, batch.block_tables, batch.last_index,
                           drafts, batch.num_drafts, block_size)


def _if_attached(batch: StepBatch, proposer_state, fn):
    """``fn()`` -> (..., new proposer state); in a step without drafts (K = 0) it runs only when some row is
    attached, else zeros of its outputs and the state untouched (a detached step: the target alone)."""
    if proposer_state is None or batch.host_drafts.shape[1] > 0:
        return fn()

    def skip():
        outs = jax.eval_shape(fn)[:-1]
        return (*jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), outs), proposer_state)

    return jax.lax.cond(jnp.any(batch.attached), fn, skip)


def propose_phase(spec: StepSpec, params, state: DecodeState, batch: StepBatch):
    """The proposer's drafts: (int32 [B, K], q [B, K, V] or None, state). Also counts the catch-up tokens."""
    target_params, proposer_params = params
    drafts, q, pstate = _if_attached(batch, state.proposer, lambda: spec.proposer.propose(
        proposer_params, target_params, state.proposer, batch, batch_keys(batch), k=batch.host_drafts.shape[1]))
    return drafts, q, state.replace(proposer=pstate, sampling=absorb_context(state.sampling, batch))


def verify_phase(spec: StepSpec, params, state: DecodeState, batch: StepBatch, drafts: jax.Array):
    """The target's forward over catch-up + drafts: (logits [B, K+1, V], features [B, W, F] | None, state)."""
    logits, features, target_kv = verify_forward(
        params[0], state.target_kv, _window(batch, drafts, state.target_kv.block_size), batch.block_tables,
        config=spec.config, features=spec.proposer.features, aux_layer_ids=spec.proposer.aux_layer_ids,
    )
    return logits, features, state.replace(target_kv=target_kv)


def sample_phase(spec: StepSpec, state: DecodeState, batch: StepBatch, drafts: jax.Array, q, logits: jax.Array):
    """Committed tokens [B, K+1] and accepted drafts [B]: plain sampling at K = 0, rejection sampling otherwise.

    The logits processors (bias, min_tokens, penalties) apply first, at every window position.
    """
    k = drafts.shape[1]
    keys = batch_keys(batch)
    logits = apply_processors(logits, state.sampling, batch, drafts)  # [B, K+1, V]
    if k == 0:
        out = _sample_plain(logits[:, 0], batch, keys)[:, None]  # [B, 1]
        return out, jnp.zeros(out.shape[:1], jnp.int32)
    rates = None if spec.rates is None else jnp.asarray(spec.rates[:k])
    return verify_tokens(logits, drafts, batch.num_drafts, q, batch.temperature, batch.top_k, batch.top_p, keys,
                         rates, method=spec.method, use_kernel=spec.use_kernel, min_p=batch.min_p)


def update_phase(spec: StepSpec, params, state: DecodeState, batch: StepBatch, drafts, features, logits, out,
                 accepted):
    """The proposer's after-verify update and the penalties' counts; returns (packed int32 output, state).

    packed [B, K+2 + (K+1) * (2 + 2N)], N = :func:`top_logprobs`: committed tokens (-1 after the last), the
    accepted count, then per position the float32 bits of (logprob of the token, its rank, top ids, top logprobs).
    """
    tokens, positions, slots, _ = _window(batch, drafts, state.target_kv.block_size)  # [B, W] each
    verified = Verified(tokens=tokens, positions=positions, slot_mapping=slots, features=features, drafts=drafts,
                        out_tokens=out, accepted=accepted)
    pstate, = _if_attached(batch, state.proposer, lambda: (spec.proposer.update(
        params[1], params[0], state.proposer, batch, verified, k=drafts.shape[1]),))
    first = jnp.take_along_axis(batch.positions, batch.last_index[:, None], axis=1)[:, 0] + 1  # [B]
    sampling = absorb_committed(state.sampling, batch, out, accepted, first)
    logprobs = logprob_outputs(logits, out, batch.num_logprobs, top_logprobs(logits.shape[-1]))  # [B, K+1, 2+2N]
    b = out.shape[0]
    packed = jnp.concatenate([
        out.astype(jnp.int32), accepted[:, None].astype(jnp.int32),
        jax.lax.bitcast_convert_type(logprobs, jnp.int32).reshape(b, -1),
    ], axis=1)
    return packed, state.replace(proposer=pstate, sampling=sampling)


def decode_step(spec: StepSpec, params, state: DecodeState, packed: PackedBatch) -> tuple[jax.Array, DecodeState]:
    """One engine step: the four phases in one program. ``params = (target, proposer)``; ``state`` is donated.

    Returns (the packed int32 output of :func:`update_phase`, the new state). K (static) is
    ``packed.host_drafts.shape[1]``; K = 0 is a plain step.
    """
    batch = packed.unpack()
    drafts, q, state = propose_phase(spec, params, state, batch)  # [B, K], [B, K, V] | None
    logits, features, state = verify_phase(spec, params, state, batch, drafts)  # [B, K+1, V], [B, W, F] | None
    out, accepted = sample_phase(spec, state, batch, drafts, q, logits)  # [B, K+1], [B]
    return update_phase(spec, params, state, batch, drafts, features, logits, out, accepted)


def top_logprobs(vocab: int) -> int:
    """N: how many top log-probabilities each position of a step returns (MAX_LOGPROBS, or the vocabulary)."""
    return min(MAX_LOGPROBS, vocab)


def unpack(packed: np.ndarray, k: int) -> tuple[list[list[int]], list[int]]:
    """Host side of :func:`update_phase`'s output: (tokens [B][K+1], accepted [B]) as Python lists (what the
    engine's per-row loop reads; numpy calls right after a step cost several microseconds each)."""
    rows = packed[:, : k + 2].tolist()
    return [r[: k + 1] for r in rows], [r[k + 1] for r in rows]


def unpack_logprobs(packed: np.ndarray, k: int) -> np.ndarray:
    """float32 [B, K+1, 2 + 2N]: the logprobs part of :func:`update_phase`'s output (requests that asked)."""
    b = packed.shape[0]
    return np.ascontiguousarray(packed[:, k + 2:]).view(np.float32).reshape(b, k + 1, -1)
