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

from specjax.step import PackedBatch, StepBatch, host_buffers

_REQUEST_FIELDS = ("temperature", "top_k", "top_p", "seed_streams", "seeds", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "bias_ids", "bias_values", "min_tokens", "stop_ids",
                   "prompt_len", "num_logprobs")
"""The StepBatch fields a slot's request fixes when it is assigned (besides its block table)."""
SCALAR_ROWS = 4
"""A decoding step of at most this many rows is filled row by row (:meth:`SlotTable._fill_decoding_rows`)."""


class SlotTable:
    """Host buffers, one row per request slot."""

    def __init__(self, num_slots: int, max_model_len: int, block_size: int, blocks_per_seq: int):
        self.block_size = block_size
        self.tokens = np.zeros((num_slots, max_model_len), np.int32)
        """int32 [S, max_model_len]: prompt + committed output of the slot's request."""
        self.num_tokens = np.zeros((num_slots,), np.int64)
        self.num_blocks = np.zeros((num_slots,), np.int64)
        fields, record = host_buffers(num_slots, 1, 0, blocks_per_seq)
        self.record = record.rows
        """int32 [S, C]: each slot's row of a step's ``PackedBatch.rows``: its request's fields (block table,
        sampling parameters) as a step takes them, the per-step fields left at their padding values. A step
        copies its rows' records whole (one gather; a gather per field cost ~0.15 ms a step at batch 1, right
        after a step's compiled call), then writes the per-step fields. The per-field arrays below are views
        into it."""
        self.block_table = fields.block_tables
        """int32 [S, M]: the slot's KV blocks in order; -1 = unused."""
        for name in _REQUEST_FIELDS:
            setattr(self, name, getattr(fields, name))
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

    def fill(self, batch: StepBatch, packed: PackedBatch, slots: np.ndarray, starts: np.ndarray,
             num_new: np.ndarray, num_outputs: np.ndarray) -> None:
        """Write ``len(slots)`` rows into a padded host step (rows past them stay padding): ``packed`` the
        arrays it is made of and ``batch`` its fields' views (``specjax.step.host_buffers``).

        slots / starts / num_new / num_outputs: int [R]: each row's slot, first position of its chunk,
        chunk length and committed output count (keys its noise). The rows' ``num_drafts``, ``host_drafts``,
        ``attached`` and ``draft_ahead`` stay at their padding values (the engine's plan sets them).
        """
        # Few numpy calls: right after a step's compiled call each costs several times what it costs warm.
        r = len(slots)
        t = packed.window.shape[2]
        if t == 1 and r <= SCALAR_ROWS:
            return self._fill_decoding_rows(batch, packed, slots.tolist(), starts.tolist(), num_new.tolist(),
                                            num_outputs.tolist())
        np.take(self.record, slots, axis=0, out=packed.rows[:r])
        bs, tokens = self.block_size, self.tokens
        if t == 1:  # decoding rows (and one-token prefill chunks): the common step, without [R, T] masks
            window = packed.window[:r, :, 0]  # [R, 3]
            window[:, 0] = tokens[slots, starts]
            window[:, 1] = starts
            window[:, 2] = self.block_table[slots, starts // bs] * bs + starts % bs
        else:
            j = np.arange(t)
            in_chunk = j[None, :] < num_new[:, None]  # [R, T]
            pos = np.where(in_chunk, starts[:, None] + j[None, :], 0)  # [R, T]
            window = packed.window[:r]  # [R, 3, T]
            window[:, 0] = np.where(in_chunk, tokens[slots[:, None], pos], 0)
            window[:, 1] = pos
            window[:, 2] = np.where(in_chunk, self.block_table[slots[:, None], pos // bs] * bs + pos % bs, -1)
        batch.last_index[:r] = num_new - 1
        batch.slots[:r] = slots
        batch.prev_token[:r] = np.where(starts > 0, tokens[slots, starts - 1], -1)  # (index -1: row's last, unused)
        end = starts + num_new
        batch.next_token[:r] = np.where(end < self.num_tokens[slots], tokens[slots, end % tokens.shape[1]], -1)
        batch.sample_indices[:r] = num_outputs
        batch.reset[:r] = self.fresh[slots]
        self.fresh[slots] = False

    def _fill_decoding_rows(self, batch: StepBatch, packed: PackedBatch, slots: list[int], starts: list[int],
                            num_new: list[int], num_outputs: list[int]) -> None:
        """:meth:`fill` of a few rows into a one-token window, row by row with scalar indexing: right after a
        step, each of fill's vectorized numpy calls (fancy indexing, ``np.where``) cost ~7 us, and fill took
        108-114 us a step (shipped pair, EAGLE-3 at batch 1, K = 3), where scalar item access runs far less
        numpy code."""
        tokens, table, bs, window = self.tokens, self.block_table, self.block_size, packed.window
        last_index, slot_field = batch.last_index, batch.slots
        prev_token, next_token = batch.prev_token, batch.next_token
        sample_indices, reset, fresh = batch.sample_indices, batch.reset, self.fresh
        for i, (s, start, n, outputs) in enumerate(zip(slots, starts, num_new, num_outputs)):
            packed.rows[i] = self.record[s]
            window[i, 0, 0] = tokens[s, start]
            window[i, 1, 0] = start
            window[i, 2, 0] = table[s, start // bs] * bs + start % bs
            last_index[i] = n - 1
            slot_field[i] = s
            prev_token[i] = tokens[s, start - 1] if start > 0 else -1
            end = start + n
            next_token[i] = tokens[s, end % tokens.shape[1]] if end < self.num_tokens[s] else -1
            sample_indices[i] = outputs
            reset[i] = fresh[s]
            fresh[s] = False
