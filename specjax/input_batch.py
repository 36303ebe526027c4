"""Persistent per-slot host buffers (vLLM's InputBatch) and the padded step built from them.

Every running request owns a slot ``s < max_num_seqs`` for as long as it runs:
its token ids, block table and sampling parameters live in row ``s`` of
preallocated numpy arrays, appended to as tokens are committed and blocks are
allocated. Building a step gathers rows from these arrays with a few vectorized
numpy ops, so host work per step grows with the tokens a step adds, never with
context length. The slot also indexes per-slot device state
(``DecodeState.proposer``, e.g. a head's pending drafts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specjax.step import MAX_BIAS, MAX_STOP_IDS, StepBatch


class SlotTable:
    """Host buffers, one row per request slot."""

    def __init__(self, num_slots: int, max_model_len: int, block_size: int, blocks_per_seq: int):
        self.block_size = block_size
        self.tokens = np.zeros((num_slots, max_model_len), np.int32)
        """int32 [S, max_model_len]: prompt + committed output of the slot's request."""
        self.num_tokens = np.zeros((num_slots,), np.int64)
        self.block_table = np.full((num_slots, blocks_per_seq), -1, np.int32)
        """int32 [S, M]: the slot's KV blocks in order; -1 = unused."""
        self.num_blocks = np.zeros((num_slots,), np.int64)
        self.temperature = np.zeros((num_slots,), np.float32)
        self.top_k = np.zeros((num_slots,), np.int32)
        self.top_p = np.ones((num_slots,), np.float32)
        self.seed_streams = np.zeros((num_slots,), np.uint32)
        self.seeds = np.zeros((num_slots,), np.uint32)
        self.min_p = np.zeros((num_slots,), np.float32)
        self.presence_penalty = np.zeros((num_slots,), np.float32)
        self.frequency_penalty = np.zeros((num_slots,), np.float32)
        self.repetition_penalty = np.ones((num_slots,), np.float32)
        self.bias_ids = np.full((num_slots, MAX_BIAS), -1, np.int32)
        self.bias_values = np.zeros((num_slots, MAX_BIAS), np.float32)
        self.min_tokens = np.zeros((num_slots,), np.int32)
        self.stop_ids = np.full((num_slots, MAX_STOP_IDS), -1, np.int32)
        self.prompt_len = np.zeros((num_slots,), np.int32)
        self.num_logprobs = np.full((num_slots,), -1, np.int32)
        self.fresh = np.zeros((num_slots,), bool)
        """The slot was (re)assigned and no step has run it yet: its device statistics must start over."""
        self.ready_drafts = np.zeros((num_slots,), np.int32)
        """Device-side drafts of the slot (``Proposer.drafts_ahead``) current for its next step (0 = none)."""
        self.synced = np.zeros((num_slots,), bool)
        """The proposer's device state has seen every token of the slot (no detached step skipped it)."""
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def assign(self, request) -> int:
        """Give ``request`` a slot and load its tokens and sampling parameters (once per admission)."""
        s = self._free.pop()
        request.slot = s
        ids = request.prompt_token_ids + request.output_token_ids
        self.tokens[s, : len(ids)] = ids
        self.num_tokens[s] = len(ids)
        self.block_table[s] = -1
        self.num_blocks[s] = 0
        p = request.params
        self.temperature[s] = p.temperature
        self.top_k[s] = p.top_k_or_off
        self.top_p[s] = p.top_p
        self.seed_streams[s] = request.seed_stream
        self.seeds[s] = request.seed
        self.min_p[s] = p.min_p
        self.presence_penalty[s] = p.presence_penalty
        self.frequency_penalty[s] = p.frequency_penalty
        self.repetition_penalty[s] = p.repetition_penalty
        bias = request.logit_bias  # (ids, values): logit_bias and banned bad words, merged by the LLM
        self.bias_ids[s] = -1
        self.bias_values[s] = 0.0
        self.bias_ids[s, : len(bias[0])] = bias[0]
        self.bias_values[s, : len(bias[1])] = bias[1]
        self.min_tokens[s] = p.min_tokens
        self.stop_ids[s] = -1
        if p.min_tokens:
            stops = sorted(request.stop_ids)
            self.stop_ids[s, : len(stops)] = stops
        self.prompt_len[s] = len(request.prompt_token_ids)
        self.num_logprobs[s] = -1 if p.logprobs is None else p.logprobs
        self.fresh[s] = True
        self.ready_drafts[s] = 0
        self.synced[s] = True  # its prefill runs with the proposer attached
        return s

    def release(self, request) -> None:
        if request.slot is not None:
            self.ready_drafts[request.slot] = 0
            self._free.append(request.slot)
            request.slot = None

    def append(self, slot: int, token_ids: Sequence[int]) -> None:
        n = int(self.num_tokens[slot])
        self.tokens[slot, n : n + len(token_ids)] = token_ids
        self.num_tokens[slot] = n + len(token_ids)

    def sync_blocks(self, slot: int, table: Sequence[int]) -> None:
        """Copy the blocks appended to ``table`` since the last call (allocation only ever appends)."""
        have = int(self.num_blocks[slot])
        if len(table) > have:
            self.block_table[slot, have : len(table)] = table[have:]
            self.num_blocks[slot] = len(table)

    def history(self, slot: int) -> np.ndarray:
        """The slot's prompt + committed output (a view: valid until the next append)."""
        return self.tokens[slot, : self.num_tokens[slot]]

    def fill(self, batch: StepBatch, slots: np.ndarray, starts: np.ndarray, num_new: np.ndarray,
             num_outputs: np.ndarray) -> None:
        """Write ``len(slots)`` rows into the padded host ``batch`` (rows past them stay padding).

        slots / starts / num_new / num_outputs: int [R]: each row's slot, first position of its chunk,
        chunk length and committed output count (keys its noise).
        """
        r = len(slots)
        t = batch.tokens.shape[1]
        j = np.arange(t)
        in_chunk = j[None, :] < num_new[:, None]  # [R, T]
        pos = starts[:, None] + j[None, :]  # [R, T]
        safe_pos = np.where(in_chunk, pos, 0)
        bs = self.block_size
        blocks = self.block_table[slots[:, None], safe_pos // bs]  # [R, T]
        batch.tokens[:r] = np.where(in_chunk, self.tokens[slots[:, None], safe_pos], 0)
        batch.positions[:r] = safe_pos
        batch.slot_mapping[:r] = np.where(in_chunk, blocks * bs + safe_pos % bs, -1)
        batch.block_tables[:r] = self.block_table[slots]
        batch.last_index[:r] = num_new - 1
        batch.slots[:r] = slots
        batch.prev_token[:r] = np.where(starts > 0, self.tokens[slots, np.maximum(starts - 1, 0)], -1)
        end = starts + num_new
        prefilling = end < self.num_tokens[slots]
        batch.next_token[:r] = np.where(prefilling, self.tokens[slots, np.where(prefilling, end, 0)], -1)
        batch.temperature[:r] = self.temperature[slots]
        batch.top_k[:r] = self.top_k[slots]
        batch.top_p[:r] = self.top_p[slots]
        batch.seed_streams[:r] = self.seed_streams[slots]
        batch.seeds[:r] = self.seeds[slots]
        batch.sample_indices[:r] = num_outputs
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "bias_ids",
                     "bias_values", "min_tokens", "stop_ids", "prompt_len", "num_logprobs"):
            getattr(batch, name)[:r] = getattr(self, name)[slots]
        batch.reset[:r] = self.fresh[slots]
        self.fresh[slots] = False
