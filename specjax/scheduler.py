"""Requests, continuous batching with chunked prefill, KV block allocation and preemption.

Everything here is host-side Python over small lists and the per-slot buffers of
:class:`~specjax.input_batch.SlotTable`; the device never waits on it for more
than the one fetch of sampled tokens per step.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import math
from typing import Any

from specjax.config import EngineConfig, SamplingParams, bucket_for
from specjax.input_batch import SlotTable
from specjax.kv_cache import BlockManager

logger = logging.getLogger(__name__)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    """Noise seed (the request's own, or one the engine derived)."""
    seed_stream: int
    """0 when ``seed`` came from the user, 1 when the engine derived it (keeps the two apart)."""
    stop_ids: frozenset[int]
    """Token ids that finish the request (EOS unless ignore_eos, plus stop_token_ids)."""
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens of prompt + output whose KV is in the cache."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = 0.0
    """perf_counter() when the engine received the request."""
    last_token_time: float = 0.0
    """perf_counter() when the request last received tokens."""
    first_token_time: float | None = None
    """perf_counter() when the request received its first token."""
    num_spec_steps: int = 0
    """Steps in which this request verified at least one draft."""
    num_draft_tokens: int = 0
    """Drafts verified for this request."""
    num_accepted_tokens: int = 0
    """Drafts accepted for this request."""
    slot: int | None = None
    """Row of the engine's per-slot buffers while running; None otherwise."""
    logit_bias: tuple[tuple[int, ...], tuple[float, ...]] = ((), ())
    """(ids, values): the request's logit bias, banned bad-word tokens (-inf) included."""
    stop_checker: Any = None
    """Called with each committed token id; returns the stop string it completed, or None."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the request, if any."""
    output_logprobs: list | None = None
    """Per output token (requests with ``logprobs``): (logprob, rank, top ids, top logprobs)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One row of a step: ``num_new`` tokens of ``request`` starting at ``start``."""

    request: Request
    start: int
    num_new: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so its last logits give a new token."""
        return self.start + self.num_new == self.request.num_tokens


class Scheduler:
    """Continuous batching: running requests first (decode or unfinished prefill), then admit waiting ones.

    A step's token budget caps decode tokens plus prefill chunks. When the KV
    pool runs dry, the most recently admitted running request is preempted:
    its blocks are freed and it is recomputed later from prompt + output so far
    (its sampled tokens are kept, and its noise is keyed by output position, so
    it finishes with the output it would have had).
    """

    def __init__(self, config: EngineConfig, *, num_lookahead_tokens: int = 0):
        self.config = config
        self.num_lookahead_tokens = num_lookahead_tokens
        self.blocks = BlockManager(config.total_kv_blocks, config.block_size)
        self.slots = SlotTable(config.max_num_seqs, config.max_model_len, config.block_size, config.blocks_per_seq)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._decoding_turn = False
        """The decoding rows' turn comes next where they and prompt chunks take turns (:meth:`schedule`)."""
        self._lone_best: list[tuple[int, int]] = [(0, config.prefill_chunk)]
        """(cost, first chunk cap) of a prompt of m tokens computed alone, at index m (:meth:`_lone_piece`)."""

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> list[Request]:
        """Drop every unfinished request and free its blocks (after an error mid-generate)."""
        dropped = list(self.running) + list(self.waiting)
        for request in dropped:
            self.blocks.free(request.request_id)
            self.slots.release(request)
            request.status = Status.FINISHED
            request.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        return dropped

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.request_id)
        self.slots.release(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def _reserve(self, request: Request, num_new: int) -> bool:
        """Allocate blocks for ``num_new`` more tokens (+ lookahead), capped at max_model_len."""
        total = min(request.num_computed_tokens + num_new + self.num_lookahead_tokens, self.config.max_model_len)
        if not self.blocks.can_allocate(request.request_id, total):
            return False
        table = self.blocks.allocate(request.request_id, total)
        if request.slot is not None:
            self.slots.sync_blocks(request.slot, table)
        return True

    def schedule(self, *, drafting: bool = False) -> list[ScheduledRow]:
        """This step's rows: running requests in admission order, then waiting ones admitted while the token
        budget and ``max_num_seqs`` allow; decoding rows and prompt chunks take turns where mixing them pads the
        step (:meth:`_mixing_pads`), or where the decoding rows are ``drafting``: a step with a prompt chunk
        verifies no drafts, so mixed in, each decoding row would gain one token where a step of its own gains
        its accepted drafts too (``mixed_step_padding`` None: always mix)."""
        budget = self.config.token_budget
        cap = self._chunk_cap(budget)  # this step's most tokens of one prompt chunk
        rows: list[ScheduledRow] = []
        # Running requests in admission order; preemption takes from the back.
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget <= 0:
                continue
            num_new = self._chunk(request, budget, cap)
            while not self._reserve(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                continue
            rows.append(ScheduledRow(request, request.num_computed_tokens, num_new))
            budget -= num_new
        decoding = [r for r in rows if r.num_new == 1] if self.config.mixed_step_padding is not None else []
        if decoding:  # (with None, mixing is always allowed: no peek at the waiting requests)
            chunks = [r for r in rows if r.num_new > 1]
            wanted = [r.num_new for r in chunks] + self._admissible(budget + len(decoding), cap)
            if wanted and (drafting or self._mixing_pads(len(decoding), wanted)):
                if self._decoding_turn:
                    self._decoding_turn = False
                    return decoding
                chunks += self._admit(budget + len(decoding), cap)  # (the decoding rows' tokens wait for their turn)
                if chunks:
                    self._decoding_turn = True
                    return chunks
                return decoding
        self._decoding_turn = False
        rows += self._admit(budget, cap)
        if not rows and self.has_unfinished:
            raise RuntimeError("scheduler made no progress: KV pool too small for a single request")
        return rows

    @staticmethod
    def _chunk(request: Request, budget: int, cap: int) -> int:
        """Tokens of ``request`` a step computes with ``budget`` tokens left: the rest of its tokens, at most the
        step's chunk cap."""
        return min(request.num_tokens - request.num_computed_tokens, cap, budget)

    def _chunk_cap(self, budget: int) -> int:
        """The query bucket this step's prompt chunks are cut to: the one whose step costs the least per prompt
        token, a step costing its padded token slots (at least ``mixed_step_padding``: a small one costs what its
        weight reads do) plus ``mixed_step_padding`` for the step itself (ties: the longer chunks).

        A step's chunks are padded to the longest one's query bucket, and the default length buckets are 4x
        apart: this scheduler, given the batch benchmark's 256 prompts of 20-122 tokens at max_num_seqs 8, put
        their 15656 tokens in prompt-chunk steps of 33552 slots uncut, 19056 cut. The cut rest of a prompt is
        the next step's chunk. ``mixed_step_padding`` None: never cut (the engine before this)."""
        cfg = self.config
        admitting = self.waiting and len(self.running) < cfg.max_num_seqs
        if cfg.mixed_step_padding is None or (not admitting and all(
                r.num_tokens - r.num_computed_tokens <= 1 for r in self.running)):
            return cfg.prefill_chunk  # (never cut, or no prompt chunk this step)
        whole = self._chunks_at(cfg.prefill_chunk, budget)
        if len(whole) <= 1:  # one prompt alone: the cuts that finish it cheapest
            return self._lone_piece(whole[0]) if whole else cfg.prefill_chunk
        best, best_cost = cfg.prefill_chunk, math.inf
        for cap in self._caps:
            chunks = whole if cap == cfg.prefill_chunk else self._chunks_at(cap, budget)
            if not chunks:
                continue
            cost = self._step_cost(len(chunks), max(chunks)) / sum(chunks)
            if cost < best_cost:
                best, best_cost = cap, cost
        return best

    def _chunks_at(self, cap: int, budget: int) -> list[int]:
        """The prompt chunks a step with this chunk cap would compute (running requests', then admitted ones')."""
        chunks = []
        for request in self.running:
            if budget <= 0:
                break
            n = self._chunk(request, budget, cap)
            budget -= n
            if n > 1:
                chunks.append(n)
        return chunks + self._admissible(budget, cap)

    @functools.cached_property
    def _caps(self) -> list[int]:
        """The chunk caps :meth:`_chunk_cap` weighs, longest first: the length buckets from 2 to the prefill chunk
        (a one-token chunk would look like a decoding row)."""
        return [q for q in reversed(self.config.length_buckets) if 2 <= q <= self.config.prefill_chunk]

    def _step_cost(self, num_rows: int, longest: int) -> int:
        """A step's cost in token slots (see :meth:`_chunk_cap`)."""
        slots = self._rows(num_rows) * bucket_for(longest, self.config.length_buckets, "query_len")
        return max(slots, self.config.mixed_step_padding) + self.config.mixed_step_padding

    def _lone_piece(self, n: int) -> int:
        """The chunk cap for a prompt computed alone with ``n`` tokens left (at most a prefill chunk's worth
        counted): the first piece of the cheapest way to cut them into chunks, each a step of one row.

        Cutting one step at a time by cost per token, a lone prompt of 100 tokens ran as chunks of 64, 16, 16
        and 4, its first token 1.14-1.15x later than in one chunk of 128 (shipped target, CPU); cut cheapest
        overall, it stays one chunk, and one of 20 tokens runs as 16 + 4 (its first token in 0.52x the time)."""
        best = self._lone_best
        while len(best) <= n:  # best[m] = (cost, first piece) of m tokens alone; grown as longer ones come
            m = len(best)
            options = [(self._step_cost(1, q) + best[m - q][0], q) for q in self._caps if q < m]
            if m <= self.config.prefill_chunk:
                options.append((self._step_cost(1, m), self.config.prefill_chunk))  # (all m in one chunk)
            best.append(min(options, key=lambda o: (o[0], -o[1])))  # (ties: the longer piece)
        return best[n][1]

    def _rows(self, n: int) -> int:
        """The rows bucket of a step of ``n`` rows."""
        return bucket_for(n, self.config.row_buckets, "num_seqs")

    def _admissible(self, budget: int, cap: int) -> list[int]:
        """The chunk lengths (at most ``cap``) :meth:`_admit` would give waiting requests with ``budget`` tokens
        (if the KV pool holds them), admitting none."""
        out = []
        for request in self.waiting:
            if len(self.running) + len(out) >= self.config.max_num_seqs or budget <= 0:
                break
            out.append(self._chunk(request, budget, cap))
            budget -= out[-1]
        return out

    def _admit(self, budget: int, cap: int) -> list[ScheduledRow]:
        """Admit waiting requests in order while ``budget`` tokens, ``max_num_seqs`` and the KV pool allow; their
        first chunks."""
        rows = []
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            num_new = self._chunk(request, budget, cap)
            if not self._reserve(request, num_new):
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            self.slots.sync_blocks(self.slots.assign(request), self.blocks.table(request.request_id))
            rows.append(ScheduledRow(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return rows

    def _mixing_pads(self, num_decoding: int, chunks: list[int]) -> bool:
        """One step of ``num_decoding`` one-token rows and prompt chunks of these lengths pads more token slots
        (rows bucket x query bucket) than a step of the chunks and one of the decoding rows do together, by more
        than ``mixed_step_padding``: each decoding row of a mixed step is padded to the longest chunk's bucket
        (shipped target, 28 decoding rows and 4 chunks of 64 tokens: one step of 32 x 64 slots, ~300 ms, where
        a step of 8 x 64 took ~58 ms and one of 32 x 1 ~10 ms)."""
        cfg = self.config
        rows = self._rows
        query = bucket_for(max(chunks), cfg.length_buckets, "query_len")
        apart = rows(len(chunks)) * query + rows(num_decoding) * bucket_for(1, cfg.length_buckets, "query_len")
        return rows(num_decoding + len(chunks)) * query - apart > cfg.mixed_step_padding

    def commit(self, row: ScheduledRow, new_token_ids: list[int], *, num_computed: int | None = None) -> list[int]:
        """Advance ``row``'s request and append its new tokens.

        ``num_computed``: tokens now in the KV cache(s); default the row's chunk end.
        Stop conditions are checked token by token, so tokens after a stop token
        (possible with multi-token steps) are dropped. Returns the tokens kept.
        """
        request = row.request
        request.num_computed_tokens = row.start + row.num_new if num_computed is None else num_computed
        kept: list[int] = []
        slot = request.slot
        for token in new_token_ids:
            request.output_token_ids.append(token)
            kept.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                break
        if request.slot is not None:
            self.slots.append(slot, kept)
        return kept

    def _finish_reason(self, request: Request, token: int) -> str | None:
        stop_string = request.stop_checker(token) if request.stop_checker is not None else None
        if len(request.output_token_ids) >= request.params.min_tokens:  # no stop of any kind before min_tokens
            if token in request.stop_ids:
                request.stop_reason = token
                return "stop"
            if stop_string is not None:
                request.stop_reason = stop_string
                return "stop"
        if len(request.output_token_ids) >= request.params.max_tokens:
            return "length"
        if request.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.running.remove(request)
        self.blocks.free(request.request_id)
        self.slots.release(request)
