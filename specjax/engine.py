"""One engine step: schedule -> padded batch -> compiled step -> commit.

``ModelRunner`` owns the device side (params, paged KV, compiled buckets);
``Engine`` owns the host side (scheduler, requests) and moves tokens between them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig, forward
from specjax.buckets import CompiledBuckets
from specjax.config import EngineConfig, bucket_for
from specjax.kv_cache import AttentionMetadata, KVCache
from specjax.metrics import LatencyStats
from specjax.parallel.sharding import ShardingPlan, make_mesh
from specjax.sample.transforms import argmax_last, sample_tokens
from specjax.scheduler import Request, ScheduledRow, Scheduler

logger = logging.getLogger(__name__)


@flax.struct.dataclass
class StepInputs:
    """A padded ``[B, T]`` step. Padding rows/tokens write no KV and their outputs are discarded."""

    tokens: jax.Array
    """int32 [B, T]: token ids (0 in padding)."""
    positions: jax.Array
    """int32 [B, T]: absolute positions (0 in padding)."""
    slot_mapping: jax.Array
    """int32 [B, T]: KV slot per token; -1 = padding, not written."""
    block_tables: jax.Array
    """int32 [B, M]: each row's KV blocks; -1 = unused."""
    last_index: jax.Array
    """int32 [B]: index in T of each row's last real token (its logits are sampled)."""
    temperature: jax.Array
    """float32 [B]: 0 = greedy (also for padding rows)."""
    top_k: jax.Array
    """int32 [B]: 0 = off."""
    top_p: jax.Array
    """float32 [B]: 1 = off."""
    seed_streams: jax.Array
    """uint32 [B]: 0 = user seed, 1 = engine-derived seed."""
    seeds: jax.Array
    """uint32 [B]: per-request seed."""
    sample_indices: jax.Array
    """int32 [B]: output position of the token being sampled (keys the noise)."""

    @classmethod
    def zeros(cls, batch: int, length: int, max_blocks: int) -> "StepInputs":
        """Host (numpy) buffers for one bucket, filled with the padding values."""
        i32 = np.int32
        return cls(
            tokens=np.zeros((batch, length), i32),
            positions=np.zeros((batch, length), i32),
            slot_mapping=np.full((batch, length), -1, i32),
            block_tables=np.full((batch, max_blocks), -1, i32),
            last_index=np.zeros((batch,), i32),
            temperature=np.zeros((batch,), np.float32),
            top_k=np.zeros((batch,), i32),
            top_p=np.ones((batch,), np.float32),
            seed_streams=np.zeros((batch,), np.uint32),
            seeds=np.zeros((batch,), np.uint32),
            sample_indices=np.zeros((batch,), i32),
        )


def row_keys(seed_streams: jax.Array, seeds: jax.Array, sample_indices: jax.Array) -> jax.Array:
    """Typed keys [B]: fold_in(fold_in(fold_in(key(0), stream), seed), output_index).

    Depends only on the request (never on its row or batch), so seeded output is batch-invariant
    and a recomputed (preempted) request draws the same noise.
    """
    base = jax.random.key(0)
    return jax.vmap(
        lambda st, s, i: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, st), s), i)
    )(seed_streams, seeds, sample_indices)


def sample_rows(logits: jax.Array, inputs: StepInputs) -> jax.Array:
    """Sample one token per row of ``logits [B, V]``; skips the sort when no row filters."""
    temperature, top_k, top_p = inputs.temperature, inputs.top_k, inputs.top_p
    keys = row_keys(inputs.seed_streams, inputs.seeds, inputs.sample_indices)
    random_rows = temperature > 0
    filtering = jnp.any(random_rows & ((top_k > 0) | (top_p < 1.0)))

    def with_filters():
        return sample_tokens(logits, temperature, top_k, top_p, keys)

    def without_filters():
        return sample_tokens(logits, temperature, None, None, keys)

    def greedy_only():
        return argmax_last(logits)

    return jax.lax.cond(
        jnp.any(random_rows), lambda: jax.lax.cond(filtering, with_filters, without_filters), greedy_only
    )


def decode_step(
    params, kv_cache: KVCache, inputs: StepInputs, *, config: LlamaConfig
) -> tuple[jax.Array, KVCache]:
    """Forward a padded step through the target and sample each row's next token.

    Returns (int32 [B] next tokens, new KV cache). The cache argument is donated.
    """
    md = AttentionMetadata(slot_mapping=inputs.slot_mapping, block_tables=inputs.block_tables)
    logits, _, kv_cache = forward(
        params, inputs.tokens, inputs.positions, kv_cache, md, config=config, logits_indices=inputs.last_index[:, None]
    )
    return sample_rows(logits[:, 0], inputs), kv_cache


class ModelRunner:
    """Device side: parameters, the paged KV cache and the compiled step of every bucket."""

    def __init__(
        self, model_config: LlamaConfig, params, engine_config: EngineConfig, *, kv_dtype,
        plan: ShardingPlan | None = None,
    ):
        self.model_config = model_config
        self.engine_config = engine_config
        self.plan = plan if plan is not None else ShardingPlan(mesh=make_mesh(), tp=1)
        self.param_shardings = self.plan.params(params, model_config)
        self.kv_sharding = self.plan.kv(model_config)
        self.params = jax.device_put(params, self.param_shardings)
        self.kv_cache = KVCache.allocate(
            num_layers=model_config.num_hidden_layers,
            num_blocks=engine_config.total_kv_blocks,
            block_size=engine_config.block_size,
            num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=kv_dtype,
            sharding=self.kv_sharding,
        )
        rows = self.plan.rows
        jitted = jax.jit(
            functools.partial(decode_step, config=model_config), donate_argnums=(1,),
            in_shardings=(self.param_shardings, self.kv_sharding, rows), out_shardings=(rows, self.kv_sharding),
        )
        self.decode = CompiledBuckets("decode_step", jitted, self._example_args)

    def _example_args(self, bucket: tuple[int, int]):
        batch, length = bucket
        inputs = StepInputs.zeros(batch, length, self.engine_config.blocks_per_seq)
        return self.params, self.kv_cache, inputs

    @property
    def buckets(self) -> list[tuple[int, int]]:
        cfg = self.engine_config
        return [(b, t) for b in cfg.row_buckets for t in cfg.length_buckets]

    def warmup(self) -> None:
        """Compile every (rows, query length) bucket now, so generation compiles nothing.

        Each executable also runs once on an all-padding step (it writes no KV):
        a first execution costs extra (allocation, thread start-up), and the
        first real steps should not pay it.
        """
        for bucket in self.buckets:
            exe = self.decode.get(bucket)
            _, self.kv_cache = exe(self.params, self.kv_cache, self._example_args(bucket)[2])

    @property
    def num_compiles(self) -> int:
        return self.decode.num_compiles

    @property
    def compile_seconds(self) -> float:
        return self.decode.compile_seconds

    def build_inputs(self, rows: list[ScheduledRow], scheduler: Scheduler) -> StepInputs:
        """Pad ``rows`` into a (rows, query length) bucket: host numpy buffers, one copy to the device."""
        cfg = self.engine_config
        batch = bucket_for(len(rows), cfg.row_buckets, "num_seqs")
        length = bucket_for(max(r.num_new for r in rows), cfg.length_buckets, "query_len")
        inputs = StepInputs.zeros(batch, length, cfg.blocks_per_seq)
        for i, row in enumerate(rows):
            req = row.request
            n = row.num_new
            positions = np.arange(row.start, row.start + n, dtype=np.int32)
            inputs.tokens[i, :n] = req.token_ids(row.start, row.start + n)
            inputs.positions[i, :n] = positions
            inputs.slot_mapping[i, :n] = scheduler.blocks.slots(req.request_id, positions)
            table = scheduler.blocks.table(req.request_id)
            inputs.block_tables[i, : len(table)] = table
            inputs.last_index[i] = n - 1
            params = req.params
            inputs.temperature[i] = params.temperature
            inputs.top_k[i] = params.top_k_or_off
            inputs.top_p[i] = params.top_p
            inputs.seed_streams[i] = req.seed_stream
            inputs.seeds[i] = req.seed
            inputs.sample_indices[i] = len(req.output_token_ids)
        return inputs

    def run(self, inputs: StepInputs, num_rows: int) -> np.ndarray:
        """Run the plain step on padded ``inputs``; returns the sampled token of the first ``num_rows`` rows."""
        exe = self.decode.get(inputs.tokens.shape)
        next_tokens, self.kv_cache = exe(self.params, self.kv_cache, inputs)
        return np.asarray(next_tokens)[:num_rows]


@dataclasses.dataclass
class EngineStats:
    """Counters the engine keeps (``LLM.get_metrics`` reports them)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    num_row_steps: int = 0
    """Sum over steps of the rows that produced tokens (tokens / row-steps = tokens per step per row)."""


class Engine:
    """Host loop: add requests, step until done. Finished requests are handed back by ``step``.

    With ``spec`` (a :class:`~specjax.spec_decode.runner.SpecRunner`) each step
    verifies drafts: from ``proposer`` (host-side) or from the spec runner's draft model.
    """

    def __init__(self, runner: ModelRunner, config: EngineConfig, *, spec=None, proposer=None):
        self.runner = runner
        self.config = config
        self.spec = spec
        self.proposer = proposer
        lookahead = spec.spec.num_speculative_tokens if spec is not None else 0
        if spec is not None and spec.has_head:
            lookahead *= 2  # a head's chained drafts write its KV up to K positions past the verified ones
        self.scheduler = Scheduler(config, num_lookahead_tokens=lookahead)
        self.stats = EngineStats()
        self.latency = LatencyStats()

    def add_request(self, request: Request) -> None:
        self.stats.num_prompt_tokens += len(request.prompt_token_ids)
        request.arrival_time = time.perf_counter()
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def abort_all(self) -> None:
        for request in self.scheduler.abort_all():
            self._release(request)

    def _release(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.finish(request.request_id, request.prompt_token_ids, request.output_token_ids)

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        rows = self.scheduler.schedule()
        k = self.spec.k_table[min(len(rows), len(self.spec.k_table) - 1)] if self.spec is not None else 0
        if k == 0:
            inputs = self.runner.build_inputs(rows, self.scheduler)
            if self.spec is not None and self.spec.has_draft_model:
                self.spec.sync_draft(inputs)
            tokens = self.runner.run(inputs, len(rows))
            outputs = [([t], 0, 0) for t in tokens.tolist()]
            next_drafts = None
        else:
            outputs, next_drafts = self._speculate(rows, k)
        finished = []
        now = time.perf_counter()
        for i, (row, (new_tokens, num_drafts, accepted)) in enumerate(zip(rows, outputs)):
            request = row.request
            computed = row.start + row.num_new
            if not row.samples:
                request.num_computed_tokens = computed
                continue
            # The draft model has not seen its last accepted draft when all drafts were accepted.
            lag = 1 if (self.spec is not None and self.spec.has_draft_model and 0 < num_drafts == accepted) else 0
            self.stats.num_row_steps += 1
            first = not request.output_token_ids
            kept = self.scheduler.commit(row, new_tokens, num_computed=computed + accepted - lag)
            if num_drafts:
                self.spec.stats.observe(num_drafts, accepted)
                request.num_spec_steps += 1
                request.num_draft_tokens += num_drafts
                request.num_accepted_tokens += accepted
            if first:
                request.first_token_time = now
            self.latency.observe_tokens(now - (request.arrival_time if first else request.last_token_time),
                                        len(kept), first)
            request.last_token_time = now
            self.stats.num_generated_tokens += len(kept)
            if request.finish_reason is not None:
                finished.append(request)
                self._release(request)
            elif next_drafts is not None:
                self.proposer.store(request.request_id, request.num_tokens, next_drafts[i])
        self.stats.num_finished_requests += len(finished)
        self.stats.num_steps += 1
        return finished

    def _speculate(
        self, rows: list[ScheduledRow], k: int
    ) -> tuple[list[tuple[list[int], int, int]], np.ndarray | None]:
        """Draft (host or device), verify and sample.

        Returns per row (new tokens, drafts verified, drafts accepted), and a head's drafts for the next
        step (int32 [rows, K]; None without a head).
        """
        max_len = self.config.max_model_len
        # Drafts only for rows that reach their end this step, and never past max_model_len.
        caps = np.asarray(
            [min(k, max_len - r.request.num_tokens - 1) if r.samples else 0 for r in rows], np.int32
        ).clip(0)
        inputs = self.runner.build_inputs(rows, self.scheduler)
        host_drafts = None
        if not self.spec.has_draft_model:
            host_drafts = np.zeros((len(rows), k), np.int32)
            if self.proposer is not None:
                t0 = time.perf_counter()
                proposals = self.proposer.propose(
                    [r.request.request_id for r in rows],
                    [np.asarray(r.request.token_ids(0, r.request.num_tokens), np.int32) for r in rows],
                    caps.tolist(),
                )
                self.spec.stats.draft_time_s += time.perf_counter() - t0
                for i, drafts in enumerate(proposals):
                    caps[i] = len(drafts)
                    host_drafts[i, : len(drafts)] = drafts
                if not caps.any() and not self.spec.has_head:
                    # Nothing to verify anywhere: a plain step is the same computation on 1 token instead of K+1.
                    tokens = self.runner.run(inputs, len(rows)).tolist()
                    return [([t] if r.samples else [], 0, 0) for r, t in zip(rows, tokens)], None
        next_prompt = None
        if self.spec.has_head:
            next_prompt = np.asarray(
                [-1 if r.samples else r.request.token_ids(r.start + r.num_new, r.start + r.num_new + 1)[0]
                 for r in rows], np.int32,
            )
        out, accepted, next_drafts = self.spec.execute(rows, self.scheduler, inputs, k, caps, host_drafts, next_prompt)
        return [
            (out[i, : accepted[i] + 1].tolist() if rows[i].samples else [], int(caps[i]), int(accepted[i]))
            for i in range(len(rows))
        ], next_drafts
