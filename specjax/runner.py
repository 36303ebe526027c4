"""The device side of the engine: parameters, decode state and one compiled executable per bucket.

``StepRunner`` owns the parameters (target and proposer), the :class:`~specjax.step.DecodeState` and one
compiled executable per bucket (rows, query length, K); the host loop that drives it is
:class:`specjax.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import numpy as np

from models.llama import LlamaConfig, is_cpu_layout
from specjax.buckets import CompiledBuckets, maps_warning, memory_maps
from specjax.config import EngineConfig, SpeculativeConfig
from specjax.kv_cache import KVCache
from specjax.parallel.sharding import ShardingPlan
from specjax.sample.processors import SamplingState
from specjax.sample.rejection import conditional_acceptance_rates, default_use_kernel
from specjax.spec_decode.proposer import Proposer
from specjax.step import DecodeState, PackedBatch, StepBatch, StepSpec, decode_step, host_buffers, pack, \
    propose_phase, sample_phase, update_phase, verify_phase

logger = logging.getLogger(__name__)

Bucket = tuple[int, int, int]  # (rows, catch-up length, K)


class StepRunner:
    """Device side: parameters, decode state and the compiled step of every bucket."""

    def __init__(
        self, model_config: LlamaConfig, params, proposer: Proposer, engine_config: EngineConfig, *,
        spec: SpeculativeConfig | None, kv_dtype, plan: ShardingPlan, profile: bool = False, quantized=None,
        int8_activations: bool = False,
    ):
        """``profile``: also build each step's four phases as separate executables, run steps through them with a
        sync after each, timing draft (propose + update), verify and sample; slower, for measurement only (their
        compiles are not counted). ``quantized``, ``int8_activations``: the model file's GGUF blocks and how the CPU
        kernels multiply them (``ShardingPlan.layout``)."""
        self.model_config = model_config
        self.engine_config = engine_config
        self.plan = plan
        self.proposer = proposer
        params = plan.layout(params, model_config, quantized=quantized,  # a copy when converted
                             int8_activations=int8_activations)
        self.cpu_weight_layout = is_cpu_layout(params)
        """The target runs in ``models.llama.to_cpu_layout`` (chosen by ``specjax.backends``)."""
        target_shardings = plan.params(params, model_config)
        self.param_shardings = (target_shardings, proposer.param_shardings(plan))
        self.params = (jax.device_put(params, target_shardings), proposer.params)
        cfg = engine_config
        kv = plan.kv(model_config)
        self.state_shardings = DecodeState(target_kv=kv, proposer=proposer.state_shardings(plan),
                                           sampling=plan.replicated)
        state = DecodeState(
            target_kv=KVCache.allocate(
                num_layers=model_config.num_hidden_layers, num_blocks=cfg.total_kv_blocks,
                block_size=cfg.block_size, num_kv_heads=model_config.num_key_value_heads,
                head_dim=model_config.head_dim, dtype=kv_dtype, sharding=kv,
            ),
            proposer=proposer.init_state(num_slots=cfg.max_num_seqs, num_kv_blocks=cfg.total_kv_blocks,
                                         block_size=cfg.block_size, kv_dtype=kv_dtype, plan=plan),
            sampling=SamplingState.zeros(cfg.max_num_seqs, model_config.vocab_size, device=plan.replicated),
        )
        method = spec.rejection_sample_method if spec is not None else "standard"
        rates = (conditional_acceptance_rates(spec.synthetic_acceptance_rates)
                 if spec is not None and method == "synthetic" else None)
        self.spec = StepSpec(config=model_config, proposer=proposer, method=method, rates=rates,
                             use_kernel=default_use_kernel())
        rows = plan.rows
        # the decode state as the compiled steps take and return it (the `state` property assembles it)
        self._state_leaves, self._state_def = jax.tree.flatten(state)
        # positions in _state_leaves of a detached step's state (the proposer's leaves left out)
        numbered = jax.tree.unflatten(self._state_def, range(len(self._state_leaves)))
        self._detached_state_index = jax.tree.leaves(numbered.replace(proposer=None))
        batch_example = self._example_batch((1, 1, 0))

        def compiled(name: str, spec: StepSpec, trees, shardings, example_args) -> CompiledBuckets:
            return CompiledBuckets(name, flat_step(spec, trees, shardings), example_args)

        self.executables = compiled(
            "decode_step", self.spec, (self.params, self.state, batch_example),
            (self.param_shardings, self.state_shardings, rows), self._example_args)
        self.detached_executables: CompiledBuckets | None = None
        """Detached steps of a proposer that ``syncs``: the plain target step, given neither the proposer's
        parameters nor its state. The attached executable could skip the proposer itself (it does for
        all-padding steps), but carrying its state and the target's features through costs time: on the shipped
        EAGLE-3 pair at batch 8, 3.75 ms a step vs 3.50 ms (plain decoding's 3.40 ms)."""
        if proposer.syncs:
            self.detached_executables = compiled(
                "detached_step", dataclasses.replace(self.spec, proposer=Proposer()),
                ((self.params[0], None), self.state.replace(proposer=None), batch_example),
                ((target_shardings, None), self.state_shardings.replace(proposer=None), rows),
                self._detached_example_args)
        self._host_batches: dict[Bucket, tuple[StepBatch, PackedBatch, PackedBatch]] = {}
        # per bucket: (field views, the packed buffers they view, the packed padding to reset them from)
        self.compiled_last_run = False
        """The last :meth:`run` compiled its executable first (its wall time is not a step's cost)."""
        self.profile = profile
        self.phase_seconds = {"draft": 0.0, "verify": 0.0, "sample": 0.0}
        """Time per phase (``profile=True`` only): draft = propose + after-verify update."""
        if profile:
            def phase(fn, batch_arg: int, donate: tuple[int, ...] = ()):
                def on_packed(*args):  # fn(spec, *args) with args[batch_arg] a PackedBatch
                    args = list(args)
                    args[batch_arg] = args[batch_arg].unpack()
                    return fn(self.spec, *args)

                return jax.jit(on_packed, donate_argnums=donate)

            self._phases = {
                "propose": phase(propose_phase, 2, (1,)),
                "verify": phase(verify_phase, 2, (1,)),
                "sample": phase(sample_phase, 1),
                "update": phase(update_phase, 2, (1,)),
            }

    def host_batch(self, bucket: Bucket) -> StepBatch:
        """The bucket's preallocated host buffers, reset to padding (the previous step's fetch has completed).

        Its fields are views into the bucket's :class:`~specjax.step.PackedBatch`, which :meth:`run` passes.
        """
        buffers = self._host_batches.get(bucket)
        if buffers is None:
            rows, length, k = bucket
            views, packed = host_buffers(rows, length, k, self.engine_config.blocks_per_seq)
            buffers = self._host_batches[bucket] = (views, packed, jax.tree.map(np.copy, packed))
        views, packed, padding = buffers
        for buf, pad in zip(jax.tree.leaves(packed), jax.tree.leaves(padding)):
            buf[...] = pad
        return views

    @property
    def params(self) -> tuple:
        """(target parameters, proposer parameters), as the device holds them."""
        return self._params

    @params.setter
    def params(self, params: tuple) -> None:
        self._params = params
        self._param_leaves = jax.tree.leaves(params)  # what a step call passes
        self._target_param_leaves = jax.tree.leaves(params[0])

    @property
    def state(self) -> DecodeState:
        """The decode state (assembled from the leaves the compiled steps take and return)."""
        return jax.tree.unflatten(self._state_def, self._state_leaves)

    @state.setter
    def state(self, state: DecodeState) -> None:
        leaves, treedef = jax.tree.flatten(state)
        if treedef != self._state_def:
            raise ValueError(f"state: expected the structure {self._state_def}, got {treedef}")
        self._state_leaves = leaves

    def _example_batch(self, bucket: Bucket) -> PackedBatch:
        rows, length, k = bucket
        return pack(StepBatch.zeros(rows, length, k, self.engine_config.blocks_per_seq))

    def _example_args(self, bucket: Bucket) -> list:
        return [*self._param_leaves, *self._state_leaves, *jax.tree.leaves(self._example_batch(bucket))]

    def _detached_example_args(self, bucket: Bucket) -> list:
        state = [self._state_leaves[i] for i in self._detached_state_index]
        return [*self._target_param_leaves, *state, *jax.tree.leaves(self._example_batch(bucket))]

    def packed(self, batch: StepBatch) -> PackedBatch:
        """The packed arrays ``batch`` views (a :meth:`host_batch`), else a packed copy of it."""
        buffers = self._host_batches.get(_bucket_of(batch))
        return buffers[1] if buffers is not None and buffers[0] is batch else pack(batch)

    def run(self, batch: StepBatch) -> np.ndarray:
        """Run one padded step; the one host fetch: int32 [B, K+2] (tokens, then the accepted count).

        A step without drafts and without ``batch.attached`` rows is *detached*: the target alone, the
        proposer's state untouched.
        """
        return self.fetch(self.launch(batch))

    def launch(self, batch: StepBatch):
        """Start :meth:`run`'s step and return at once (JAX dispatches asynchronously): host work done before
        :meth:`fetch` overlaps the step. ``batch`` must stay untouched until then (the call may read its arrays
        in place)."""
        compiles = self.num_compiles
        packed = self.packed(batch)
        bucket = _bucket_of(batch)
        if self.profile:
            out = self._run_phases(packed)
        elif self.detached_executables is not None and bucket[2] == 0 and not batch.attached.any():
            exe, state, index = self.detached_executables.get(bucket), self._state_leaves, self._detached_state_index
            out, *new = exe(*self._target_param_leaves, *[state[i] for i in index], *jax.tree.leaves(packed))
            for i, leaf in zip(index, new):
                state[i] = leaf
        else:
            exe = self.executables.get(bucket)
            out, *self._state_leaves = exe(*self._param_leaves, *self._state_leaves, *jax.tree.leaves(packed))
        self.compiled_last_run = self.num_compiles != compiles
        return out

    @staticmethod
    def fetch(out) -> np.ndarray:
        """Wait for a :meth:`launch`'s step: its one host fetch (a no-op after ``_run_phases``)."""
        return np.asarray(out)

    def _run_phases(self, batch: PackedBatch) -> np.ndarray:
        phase, params, timer = self._phases, self.params, time.perf_counter
        t0 = timer()
        drafts, q, state = jax.block_until_ready(phase["propose"](params, self.state, batch))
        t1 = timer()
        logits, features, state = jax.block_until_ready(phase["verify"](params, state, batch, drafts))
        t2 = timer()
        out, accepted = jax.block_until_ready(phase["sample"](state, batch, drafts, q, logits))
        t3 = timer()
        packed, self.state = phase["update"](params, state, batch, drafts, features, logits, out, accepted)
        packed = np.asarray(packed)
        t4 = timer()
        self.phase_seconds["draft"] += (t1 - t0) + (t4 - t3)
        self.phase_seconds["verify"] += t2 - t1
        self.phase_seconds["sample"] += t3 - t2
        return packed

    def warmup(self, buckets: list[Bucket], *, progress: bool = True) -> None:
        """Compile each bucket now and run it once on an all-padding step (it writes nothing).

        Compilations run in parallel on the machine's cores; a first execution costs extra (allocation,
        thread start-up), and the first real steps should not pay it. ``progress`` shows a progress bar
        on stderr while compiling.
        """
        detached = [b for b in buckets if b[2] == 0] if self.detached_executables is not None else []
        bar = None
        if progress and len(buckets) > 1:
            from tqdm.auto import tqdm

            total = len(buckets) + (0 if self.profile else len(detached))
            bar = tqdm(total=total, desc="specjax: compiling steps", unit="exe", leave=False)
        tick = bar.update if bar is not None else None
        workers = os.cpu_count() or 1
        maps, warning = memory_maps(), None
        try:
            if not self.profile:
                self.executables.compile_all(buckets, workers=workers, on_done=tick)
                if detached:
                    self.detached_executables.compile_all(detached, workers=workers, on_done=tick)
                warning = maps_warning(maps, memory_maps())
            for bucket in buckets:
                for attached in (True, False)[: 1 + (bucket in detached)]:
                    batch = self.host_batch(bucket)
                    batch.attached[:] = attached  # padding rows write nothing either way
                    self.run(batch)
                if bar is not None and self.profile:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        if warning:  # (after the progress bar, which would carry it on its line)
            logger.warning(warning)

    def time_step(self, bucket: Bucket, detached: bool, sampled: bool = False, repeats: int = 3,
                  draft_ahead: int = 0) -> float:
        """Median wall time of an all-padding step of ``bucket`` (compiled already), fetch included; the
        padding rows count as attached unless ``detached``, sample (temperature 1) if ``sampled`` and have a
        chained proposer draft ``draft_ahead`` ahead (they write nothing either way)."""
        times = []
        for _ in range(repeats):
            batch = self.host_batch(bucket)
            batch.attached[:] = not detached
            batch.draft_ahead[:] = draft_ahead
            batch.temperature[:] = float(sampled)
            start = time.perf_counter()
            self.run(batch)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    @property
    def num_compiles(self) -> int:
        return sum(e.num_compiles for e in self._all_executables)

    @property
    def compile_seconds(self) -> float:
        return sum(e.compile_seconds for e in self._all_executables)

    @property
    def _all_executables(self) -> list[CompiledBuckets]:
        return [e for e in (self.executables, self.detached_executables) if e is not None]


def flat_step(spec: StepSpec, trees: tuple, shardings: tuple):
    """``decode_step(spec, params, state, batch)`` jitted as a function of the leaves of ``trees`` (examples of
    (params, state, batch)) that returns (out, *the new state's leaves), the state's leaves donated;
    ``shardings`` are prefixes of ``trees`` (the batch's is also the output's).

    Why leaves: a call's argument parsing flattens every pytree argument, and the parameters' nested dicts
    (46 leaves on the shipped draft_model pair) cost ~40-50 us a step at batch 1 (their keys sorted, tree nodes
    allocated); positional arrays cost a fraction of that.
    """
    defs = [jax.tree.structure(t) for t in trees]
    ends = np.cumsum([d.num_leaves for d in defs]).tolist()
    starts = [0, *ends[:-1]]

    def step(*leaves):
        params, state, batch = (jax.tree.unflatten(d, leaves[a:b]) for d, a, b in zip(defs, starts, ends))
        out, state = decode_step(spec, params, state, batch)
        return (out, *jax.tree.leaves(state))

    def per_leaf(prefix, tree) -> list:
        return jax.tree.leaves(jax.tree.broadcast(prefix, tree, is_leaf=lambda x: x is None))

    in_shardings = [s for prefix, tree in zip(shardings, trees) for s in per_leaf(prefix, tree)]
    out_shardings = (shardings[2], *per_leaf(shardings[1], trees[1]))
    return jax.jit(step, donate_argnums=tuple(range(starts[1], ends[1])), in_shardings=tuple(in_shardings),
                   out_shardings=out_shardings)


def _bucket_of(batch: StepBatch) -> Bucket:
    rows, length = batch.tokens.shape
    return rows, length, batch.host_drafts.shape[1]
