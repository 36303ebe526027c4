"""Device side of a speculative step: propose -> verify forward -> rejection sample.

Three compiled functions per bucket, called back to back: the draft (for the
draft_model method; host proposers hand their drafts in), the target's verify
forward over catch-up + drafts, and the rejection sampler. Keeping them apart
costs two extra dispatches per step but lets the engine report draft, verify
and sample time separately, which the efficiency benchmark needs.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from models.heads import HeadConfig
from models.llama import LlamaConfig
from specjax.buckets import CompiledBuckets
from specjax.config import EngineConfig, SpeculativeConfig
from specjax.engine import ModelRunner, StepInputs, row_keys
from specjax.kv_cache import KVCache
from specjax.metrics import SpecDecodeStats
from specjax.parallel.sharding import ShardingPlan
from pallas_kernels.rejection import greedy_verify_reference
from specjax.sample.rejection import conditional_acceptance_rates
from specjax.scheduler import ScheduledRow, Scheduler
from specjax.spec_decode.draft_model import draft_propose
from specjax.spec_decode.heads import head_propose
from specjax.spec_decode.verify import verify_forward, verify_sample
from specjax.spec_decode.vocab_map import VocabMap


def _draft_step(draft_params, draft_cache, inputs: StepInputs, num_drafts, vocab_map, *, config, k, probabilistic):
    keys = row_keys(inputs.seed_streams, inputs.seeds, inputs.sample_indices)
    return draft_propose(
        draft_params, draft_cache, inputs.tokens, inputs.positions, inputs.slot_mapping, inputs.block_tables,
        inputs.last_index, num_drafts, inputs.temperature, inputs.top_k, inputs.top_p, keys,
        config=config, k=k, probabilistic=probabilistic, vocab_map=vocab_map,
    )


def _verify_step(params, kv_cache, inputs: StepInputs, draft_ids, num_drafts, *, config, features=None,
                 aux_layer_ids=()):
    logits, feats, kv_cache = verify_forward(
        params, kv_cache, inputs.tokens, inputs.positions, inputs.slot_mapping, inputs.block_tables,
        inputs.last_index, draft_ids, num_drafts, config=config, features=features, aux_layer_ids=aux_layer_ids,
    )
    return logits, feats, kv_cache  # feats None without a head


def _head_step(head_params, target_params, head_cache, features, inputs: StepInputs, draft_ids, num_drafts,
               out_tokens, accepted, next_prompt, *, config, target_config, num_out):
    return head_propose(
        head_params, target_params, head_cache, features, inputs.tokens, inputs.positions, inputs.slot_mapping,
        inputs.block_tables, inputs.last_index, draft_ids, num_drafts, out_tokens, accepted, next_prompt,
        config=config, target_config=target_config, num_out=num_out,
    )


def _row_params(inputs: StepInputs) -> tuple:
    """The per-row [B] fields the sampler needs (not the [B, T] ones, which vary by length bucket)."""
    return (inputs.temperature, inputs.top_k, inputs.top_p, inputs.seed_streams, inputs.seeds, inputs.sample_indices)


def _sample_step(target_logits, draft_ids, num_drafts, draft_probs, row_params, rates, *, method):
    temperature, top_k, top_p, seed_streams, seeds, sample_indices = row_params
    keys = row_keys(seed_streams, seeds, sample_indices)
    return verify_sample(
        target_logits, draft_ids, num_drafts, draft_probs, temperature, top_k, top_p, keys, rates, method=method
    )


class SpecRunner:
    """Speculative steps on top of a target :class:`ModelRunner` (whose params and KV cache it uses)."""

    def __init__(
        self,
        target: ModelRunner,
        spec: SpeculativeConfig,
        engine_config: EngineConfig,
        *,
        draft: tuple[LlamaConfig, dict] | None = None,
        head: tuple[HeadConfig, dict] | None = None,
        kv_dtype=None,
        draft_tp: int = 1,
        vocab_map: VocabMap | None = None,
    ):
        """``draft_tp``: 1 replicates the draft on every device of the target's mesh; else the target's tp.

        ``head``: a draft head (EAGLE/EAGLE-3/MTP/Medusa) that drafts at the end of each step from the
        verify pass's features; heads are small and replicated on every device.
        """
        self.target = target
        self.spec = spec
        self.engine_config = engine_config
        self.head_config = head[0] if head is not None else None
        # A head's cache must see every step's window, so head methods never take the plain (K = 0) step.
        self.k_table = tuple(max(k, 1) if head is not None else k for k in spec.k_table(engine_config.max_num_seqs))
        self.ks = sorted(set(self.k_table[1:]))
        self.stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.probabilistic = spec.draft_sample_method == "probabilistic" and draft is not None
        method = spec.rejection_sample_method
        self.rates = (
            conditional_acceptance_rates(spec.synthetic_acceptance_rates) if method == "synthetic" else None
        )
        tcfg = target.model_config
        rows, kv = target.plan.rows, target.kv_sharding
        features = None
        if head is not None:
            features = "aux" if self.head_config.method == "eagle3" else "hidden"
        # Every batch-major argument and result is split by rows (dp); logits come back whole on each tp device.
        self.verify = CompiledBuckets(
            "verify_forward",
            jax.jit(
                functools.partial(_verify_step, config=tcfg, features=features,
                                  aux_layer_ids=self.head_config.aux_layer_ids if head is not None else ()),
                donate_argnums=(1,),
                in_shardings=(target.param_shardings, kv, rows, rows, rows),
                out_shardings=(rows, rows, kv),
            ),
            self._verify_args,
        )
        self.sample = CompiledBuckets(
            "verify_sample",
            jax.jit(
                functools.partial(_sample_step, method=method),
                in_shardings=(rows, rows, rows, rows, rows, target.plan.replicated), out_shardings=rows,
            ),
            self._sample_args,
        )
        # All-greedy steps (known on the host) skip the random machinery entirely: on XLA:CPU the
        # untaken branch of an in-graph cond still costs as much as the greedy pass itself.
        # Synthetic acceptance applies to greedy rows too, so it never takes this path.
        self.greedy_path = method != "synthetic"
        self.sample_greedy = CompiledBuckets(
            "verify_greedy", jax.jit(greedy_verify_reference, in_shardings=rows, out_shardings=rows), self._greedy_args
        )
        self.draft_config = None
        self.draft_cache = None
        if draft is not None:
            self.draft_config, draft_params = draft
            plan = ShardingPlan(mesh=target.plan.mesh, tp=draft_tp)
            draft_shardings = plan.params(draft_params, self.draft_config)
            draft_kv = plan.kv(self.draft_config)
            self.draft_params = jax.device_put(draft_params, draft_shardings)
            # Heterogeneous vocabularies: the id maps go to device once, as arguments (not constants).
            self.draft_vocab_map = (
                None if vocab_map is None else jax.device_put(vocab_map.arrays, target.plan.replicated)
            )
            self.draft_cache = KVCache.allocate(
                num_layers=self.draft_config.num_hidden_layers,
                num_blocks=engine_config.total_kv_blocks,
                block_size=engine_config.block_size,
                num_kv_heads=self.draft_config.num_key_value_heads,
                head_dim=self.draft_config.head_dim,
                dtype=kv_dtype,
                sharding=draft_kv,
            )
            # The draft's k is static (it sizes the loop and outputs): one set of buckets per k.
            self.draft_buckets = {
                k: CompiledBuckets(
                    f"draft_propose[k={k}]",
                    jax.jit(
                        functools.partial(_draft_step, config=self.draft_config, k=k, probabilistic=self.probabilistic),
                        donate_argnums=(1,),
                        in_shardings=(draft_shardings, draft_kv, rows, rows, target.plan.replicated),
                        out_shardings=(rows, rows, draft_kv),
                    ),
                    self._draft_args,
                )
                for k in {max(k, 1) for k in self.ks}
            }
        self.head_cache = None
        if head is not None:
            hcfg, head_params = head
            hcfg.check_target(tcfg)
            if hcfg.method == "medusa" and spec.num_speculative_tokens > hcfg.num_medusa_heads:
                raise ValueError(
                    f"num_speculative_tokens={spec.num_speculative_tokens} exceeds the Medusa head count "
                    f"{hcfg.num_medusa_heads}"
                )
            replicated = target.plan.replicated
            self.head_params = jax.device_put(head_params, replicated)
            if hcfg.is_fusion:
                self.head_cache = KVCache.allocate(
                    num_layers=1, num_blocks=engine_config.total_kv_blocks, block_size=engine_config.block_size,
                    num_kv_heads=hcfg.num_key_value_heads, head_dim=hcfg.head_dim, dtype=kv_dtype,
                    sharding=replicated,
                )
            self.head_buckets = CompiledBuckets(
                "head_propose",
                jax.jit(
                    functools.partial(_head_step, config=hcfg, target_config=tcfg,
                                      num_out=spec.num_speculative_tokens),
                    donate_argnums=(2,),
                    in_shardings=(replicated, target.param_shardings, replicated, rows, rows, rows, rows, rows, rows,
                                  rows),
                    out_shardings=(rows, replicated),
                ),
                self._head_args,
            )

    # ------------------------------------------------------------ compile plumbing

    @property
    def has_draft_model(self) -> bool:
        return self.draft_config is not None

    def _inputs(self, batch: int, length: int) -> StepInputs:
        return StepInputs.zeros(batch, length, self.engine_config.blocks_per_seq)

    def _verify_args(self, bucket):
        batch, length, k = bucket
        ids = np.zeros((batch, k), np.int32)
        return self.target.params, self.target.kv_cache, self._inputs(batch, length), ids, ids[:, 0]

    def _sample_args(self, bucket):
        batch, k = bucket
        vocab = self.target.model_config.vocab_size
        logits = jax.ShapeDtypeStruct((batch, k + 1, vocab), np.float32)
        probs = jax.ShapeDtypeStruct((batch, k, vocab), np.float32) if self.probabilistic else None
        ids = np.zeros((batch, k), np.int32)
        return logits, ids, ids[:, 0], probs, _row_params(self._inputs(batch, 1)), self.rates

    def _greedy_args(self, bucket):
        batch, k = bucket
        logits = jax.ShapeDtypeStruct((batch, k + 1, self.target.model_config.vocab_size), np.float32)
        ids = np.zeros((batch, k), np.int32)
        return ids, ids[:, 0], logits

    def _draft_args(self, bucket):
        batch, length = bucket
        return (self.draft_params, self.draft_cache, self._inputs(batch, length), np.zeros((batch,), np.int32),
                self.draft_vocab_map)

    def _head_args(self, bucket):
        batch, length, k = bucket
        dtype = jax.tree.leaves(self.target.params)[0].dtype
        feats = jax.ShapeDtypeStruct((batch, length + k, self.head_config.feature_size), dtype)
        ids = np.zeros((batch, k), np.int32)
        out = np.zeros((batch, k + 1), np.int32)
        return (self.head_params, self.target.params, self.head_cache, feats, self._inputs(batch, length), ids,
                ids[:, 0], out, out[:, 0], np.full((batch,), -1, np.int32))

    @property
    def has_head(self) -> bool:
        return self.head_config is not None

    def _draft_exe(self, batch: int, length: int, k: int):
        return self.draft_buckets[k].get((batch, length))

    def _all_buckets(self) -> list[CompiledBuckets]:
        out = [self.verify, self.sample, self.sample_greedy]
        if self.has_head:
            out.append(self.head_buckets)
        return out + list(self.draft_buckets.values()) if self.has_draft_model else out

    @property
    def num_compiles(self) -> int:
        return sum(c.num_compiles for c in self._all_buckets())

    @property
    def compile_seconds(self) -> float:
        return sum(c.compile_seconds for c in self._all_buckets())

    def warmup(self) -> None:
        """Compile every bucket, and run each once on all-padding inputs (see ``ModelRunner.warmup``)."""
        cfg = self.engine_config
        lengths = cfg.length_buckets
        for batch in cfg.row_buckets:
            for k in self.ks:
                if k == 0:
                    continue
                self._warm(self.sample, (batch, k))
                if self.greedy_path:
                    self._warm(self.sample_greedy, (batch, k))
                for length in lengths:
                    *_, self.target.kv_cache = self._warm(self.verify, (batch, length, k))
                    if self.has_head:
                        _, self.head_cache = self._warm(self.head_buckets, (batch, length, k))
                    if self.has_draft_model:
                        self._warm_draft(batch, length, k)
            if 0 in self.ks and self.has_draft_model:
                for length in lengths:
                    self._warm_draft(batch, length, 1)

    def _warm(self, buckets: CompiledBuckets, bucket):
        """Compile ``bucket`` and run it once on its example arguments (padding: no KV is written)."""
        args = buckets.example_args(bucket)
        rows = self.target.plan.rows
        # ShapeDtypeStructs (the logits) become zeros of their shape, placed like the real ones.
        args = jax.tree.map(
            lambda a: jax.numpy.zeros(a.shape, a.dtype, device=rows) if isinstance(a, jax.ShapeDtypeStruct) else a,
            args,
        )
        return buckets.get(bucket)(*args)

    def _warm_draft(self, batch: int, length: int, k: int) -> None:
        _, _, self.draft_cache = self._warm(self.draft_buckets[k], (batch, length))

    # ------------------------------------------------------------ one step

    def sync_draft(self, inputs: StepInputs) -> None:
        """K = 0 step: the draft still consumes the catch-up tokens, so its KV stays in step with the target's."""
        batch, length = inputs.tokens.shape
        exe = self._draft_exe(batch, length, 1)
        _, _, self.draft_cache = exe(self.draft_params, self.draft_cache, inputs, np.zeros((batch,), np.int32),
                                     self.draft_vocab_map)

    def execute(
        self,
        rows: list[ScheduledRow],
        scheduler: Scheduler,
        inputs: StepInputs,
        k: int,
        num_drafts: np.ndarray,
        host_drafts: np.ndarray | None,
        next_prompt: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Verify drafts for ``rows``.

        Returns (output ids int32 [n, K+1] with -1 tail, accepted counts [n], and with a head the next
        step's drafts int32 [n, num_speculative_tokens], else None). ``next_prompt`` int32 [n] (heads):
        the prompt token after this step's chunk for rows still prefilling, -1 for rows that sample.
        """
        batch, length = inputs.tokens.shape
        n = len(rows)
        padded_drafts = np.zeros((batch,), np.int32)
        padded_drafts[:n] = num_drafts
        start = time.perf_counter()
        draft_probs = None
        if self.has_draft_model:
            exe = self._draft_exe(batch, length, k)
            draft_ids, draft_probs, self.draft_cache = exe(
                self.draft_params, self.draft_cache, inputs, padded_drafts, self.draft_vocab_map
            )
            jax.block_until_ready(draft_ids)
        else:
            draft_ids = np.zeros((batch, k), np.int32)
            draft_ids[:n] = host_drafts
        t_draft = time.perf_counter()
        logits, feats, self.target.kv_cache = self.verify.get((batch, length, k))(
            self.target.params, self.target.kv_cache, inputs, draft_ids, padded_drafts
        )
        jax.block_until_ready(logits)
        t_verify = time.perf_counter()
        if self.greedy_path and not inputs.temperature.any():
            out, accepted = self.sample_greedy.get((batch, k))(draft_ids, padded_drafts, logits)
        else:
            out, accepted = self.sample.get((batch, k))(
                logits, draft_ids, padded_drafts, draft_probs, _row_params(inputs), self.rates
            )
        next_drafts, head_s = None, 0.0
        if self.has_head:
            jax.block_until_ready(out)
            t_sampled = time.perf_counter()
            prompt_next = np.full((batch,), -1, np.int32)
            prompt_next[:n] = next_prompt
            next_drafts, self.head_cache = self.head_buckets.get((batch, length, k))(
                self.head_params, self.target.params, self.head_cache, feats, inputs, draft_ids, padded_drafts,
                out, accepted, prompt_next,
            )
            next_drafts = np.asarray(next_drafts)[:n]
            head_s = time.perf_counter() - t_sampled  # the head drafts (for the next step): drafting time
        out, accepted = np.asarray(out)[:n], np.asarray(accepted)[:n]
        t_sample = time.perf_counter()
        self.stats.draft_time_s += t_draft - start + head_s
        self.stats.verify_time_s += t_verify - t_draft
        self.stats.sample_time_s += t_sample - t_verify - head_s
        self.stats.num_spec_steps += 1
        return out, accepted, next_drafts
