"""One engine step: schedule -> pick K -> padded batch -> one compiled call -> one fetch -> commit.

:class:`~specjax.runner.StepRunner` owns the device side: the parameters (target and proposer), the
:class:`~specjax.step.DecodeState` and one compiled executable per bucket
(rows, query length, K). ``Engine`` owns the host side: the scheduler and its
per-slot buffers, the proposer's host half and the statistics. Neither names a
speculative method: everything method-specific sits behind the proposer.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import numpy as np

from specjax.config import EngineConfig, SpeculativeConfig, bucket_for
from specjax.metrics import LatencyStats, SpecDecodeStats
from specjax.runner import Bucket, StepRunner
from specjax.scheduler import Request, Scheduler
from specjax.spec_decode.controller import ControllerConfig, SpeculationController
from specjax.spec_decode.proposer import EMPTY_DRAFTS
from specjax.step import unpack, unpack_logprobs


WARMUP_STEPS_PER_KIND = 4
"""Consecutive all-padding steps of each kind per warmup timing round; the last is timed (see Engine.warmup)."""
WARMUP_ROUNDS = (3, 12)
"""Warmup timing rounds over a row bucket's step kinds: at least, and at most (see WARMUP_TIMING_SECONDS)."""
WARMUP_TIMING_SECONDS = 0.5
"""A row bucket's warmup timing runs rounds beyond the least while its rounds so far took less than this."""
ACCOUNT_BATCH = 64
"""The most decoding steps whose timings wait for the cost model while a plan holds (see Engine._account)."""


@dataclasses.dataclass
class EngineStats:
    """Counters the engine keeps (``LLM.get_metrics`` reports them)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    num_row_steps: int = 0
    """Sum over steps of the rows that produced tokens (tokens / row-steps = tokens per step per row)."""
    step_seconds: float = 0.0
    """Wall time of all steps (host work, the compiled call and its fetch)."""


class Engine:
    """Host loop: add requests, step until done. Finished requests are handed back by ``step``."""

    def __init__(self, runner: StepRunner, config: EngineConfig, *, spec: SpeculativeConfig | None):
        self.runner = runner
        self.proposer = runner.proposer
        self.config = config
        self.k_max = kmax = spec.num_speculative_tokens if spec is not None else 0
        self.k_table = spec.k_table(config.max_num_seqs) if spec is not None else (0,) * (config.max_num_seqs + 1)
        self.controller = None
        if spec is not None and spec.adaptive:
            self.controller = SpeculationController(kmax, ControllerConfig(), can_detach=self.proposer.syncs,
                                                    prior=self.proposer.acceptance_prior)
        self.scheduler = Scheduler(config, num_lookahead_tokens=kmax + self.proposer.kv_lookahead(kmax))
        self.stats = EngineStats()
        self.spec_stats = SpecDecodeStats(kmax) if spec is not None else None
        self.latency = LatencyStats()
        self._held = 0  # decoding steps the controller's last plan still serves (Decision.hold) ...
        self._held_key = (b"", False)  # ... for these rows' slots (int64 [R] as bytes: cheaper to compare), in
        # order, and whether requests waited (a plan made while the batch drained must not outlive it) ...
        self._held_plan: tuple[int, list[int]] = (0, [])  # ... with this K and these caps
        self._planned = True  # the last decoding step's plan was made in full (not a held one)
        self._prepared: tuple | None = None  # (key as _held_key, Decision, the controller's state before it) of
        # a plan made for the next step while the device ran this one (see _prepare)
        self._ahead = 1  # drafts a chained proposer makes for the next step (Decision.ahead, see draft_ahead)
        self._last_kind: tuple | None = None  # (bucket, detached) of the last step (cold steps: CostModel)
        self._last_done: float | None = None  # perf_counter when the last step's measured part ended (CostModel)
        self._unaccounted: list[tuple] = []  # decoding steps' timings not yet given to the cost model (_account)
        self._drafting = spec is not None  # the last decoding step verified drafts (before one: speculation is
        # on); its rows then take turns with prompt chunks (Scheduler.schedule)

    # ------------------------------------------------------------------ buckets

    @property
    def _decode_length(self) -> int:
        return self.config.length_buckets[0]

    def buckets(self, prompt_lengths: Sequence[int] | None = None) -> list[Bucket]:
        """Every bucket a step can take: steps without drafts at each query length (with a proposer that
        ``syncs``, an attached and a detached executable each) and drafting steps at each K.

        ``prompt_lengths``: only the query lengths that prompts of these lengths prefill in when each gets whole
        chunks, and (where the scheduler may cut chunks) every shorter one (a step that splits them otherwise
        compiles its bucket on first use)."""
        cfg = self.config
        rows, decode = cfg.row_buckets, self._decode_length
        lengths = cfg.length_buckets
        if prompt_lengths is not None:
            chunk = cfg.prefill_chunk
            needed = {decode} | {n for length in prompt_lengths for n in (min(length, chunk), length % chunk) if n}
            used = {bucket_for(n, lengths, "query length") for n in needed}
            if cfg.mixed_step_padding is not None:  # chunks may be cut to any shorter bucket (Scheduler._chunk_cap)
                used = {t for t in lengths if t <= max(used)}
            lengths = tuple(t for t in lengths if t in used)
        out = [(r, t, 0) for r in rows for t in lengths]
        out += [(r, decode, k) for r in rows for k in range(1, self.k_max + 1)
                if self.controller is not None or k <= max(self.k_table)]
        return out

    def _step_kinds(self, buckets: list[Bucket]) -> list[tuple[Bucket, bool]]:
        """The decoding step kinds the controller chooses between: (bucket, detached)."""
        kinds = [(b, False) for b in buckets if b[1] == self._decode_length]
        if self.proposer.syncs:
            kinds += [(b, True) for b in buckets if b[1] == self._decode_length and b[2] == 0]
        return kinds

    def warmup(self, *, progress: bool = True, prompt_lengths: Sequence[int] | None = None) -> None:
        """Compile every bucket (see :meth:`buckets`); with a controller, also time each decoding step kind
        (its cost model)."""
        buckets = self.buckets(prompt_lengths)
        self.runner.warmup(buckets, progress=progress)
        if self.controller is not None:
            # Rounds over all kinds rather than repeats of one: a slow spell of the machine then lands on one
            # measurement of several kinds, not on all of one kind's (the cost is their median). In each, a kind
            # runs WARMUP_STEPS_PER_KIND steps in a row and the last counts: a kind's cost is what a step costs
            # in a run of it (see CostModel), and steps right after another kind ran cold, the cheap kinds most
            # (SmolLM2 with its EAGLE-3 head at batch 1, greedy, means over fresh processes: one step per round
            # put K = 1 at 1.14x the target alone and K = 2 at 1.40x, four 1.33x and 1.57x; real steps 1.37x
            # and 1.66x).
            # A row bucket gets WARMUP_ROUNDS[0] rounds, and more (up to WARMUP_ROUNDS[1]) while its rounds so far
            # took less than WARMUP_TIMING_SECONDS: one step's time varies by 10-20% (interquartile range / median,
            # shipped pair, eagle3 at batch 1 on this project's 2-core machine), so the median of three rounds may
            # put a kind 20-30% off and the controller then never chooses it to find out; cheap buckets afford more.
            by_rows: dict[int, list] = {}
            for kind in self._step_kinds(buckets):
                by_rows.setdefault(kind[0][0], []).append(kind)
            least, most = WARMUP_ROUNDS
            for kinds in by_rows.values():
                start = time.perf_counter()
                for done in range(most):
                    if done >= least and time.perf_counter() - start > WARMUP_TIMING_SECONDS:
                        break
                    for (rows, length, k), detached in kinds:
                        for sampled in (False, True):
                            step = functools.partial(self.runner.time_step, (rows, length, k), detached, sampled,
                                                     repeats=1, draft_ahead=max(k, 1))
                            for _ in range(WARMUP_STEPS_PER_KIND - 1):
                                step()
                            self.controller.costs.observe((rows, k, detached, sampled), step(), warmup=True)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        self.stats.num_prompt_tokens += len(request.prompt_token_ids)
        request.arrival_time = time.perf_counter()
        self.scheduler.add(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def abort_all(self) -> None:
        self._drop_prepared()
        for request in self.scheduler.abort_all():
            self._release(request)

    def _release(self, request: Request) -> None:
        self.proposer.finish(request.request_id, request.prompt_token_ids, request.output_token_ids)
        if self.controller is not None:
            self.controller.finish(request.request_id)

    # ------------------------------------------------------------------ one step

    def _plan(self, rows, slots: np.ndarray) -> tuple[int, np.ndarray, list[np.ndarray] | None, bool]:
        """(K, drafts per row, host drafts or None, detached) for a decoding step of ``rows``."""
        n = len(rows)
        waiting = bool(self.scheduler.waiting)  # else the batch drains (RowCaps.remaining)
        key = (slots.tobytes(), waiting)
        if self._prepared is not None:  # (made for these rows: step() drops it otherwise)
            got = self._prepared_step(rows, slots, key)
            if got is not None:
                return got
        self._planned = not (self._held and self._held_key == key)
        if not self._planned:
            return self._held_step(rows, slots)
        self._held = 0
        if self.controller is not None and self.proposer.syncs and not self.scheduler.slots.synced[slots].any():
            # Every row's proposer state is stale (they missed detached steps): plain steps, with no planning.
            self.controller.count_step(0, detached=True)
            return 0, np.zeros(n, np.int32), None, True
        k = self.k_max if self.controller is not None else self.k_table[min(n, len(self.k_table) - 1)]
        ids = [r.request.request_id for r in rows]
        remaining = None
        if self.controller is not None:
            remaining = None if waiting else self._remaining(rows)
            wanted, can_draft = self._wanted(rows, slots, ids, remaining)
            limits = wanted.caps  # rows not worth drafting are not even looked up
        else:
            limits = self._row_limits(rows, slots, k)[0]
        host_drafts = None
        if self.proposer.host_side and k:
            host_drafts, limits = self._lookup(ids, slots, limits, remaining)
        if self.controller is None:  # a static K: the step verifies K drafts whenever any row has one
            return (k if any(limits) else 0), np.array(limits, np.int32), host_drafts, False
        plan = self.controller.decide(bucket_for(n, self.config.row_buckets, "num_seqs"), wanted,
                                      found=limits if host_drafts is not None else None, can_draft=can_draft)
        return self._use(key, plan, [min(a, b) for a, b in zip(limits, plan.caps.tolist())], host_drafts)

    def _wanted(self, rows, slots: np.ndarray, ids: list[str], remaining, ready_after: int | None = None):
        """(the controller's :meth:`~SpeculationController.row_caps` for ``rows``, [R] their proposer state is
        current), from their limits at K_max (:meth:`_row_limits`)."""
        limits, can_draft, open_limits = self._row_limits(rows, slots, self.k_max, ready_after)
        return self.controller.row_caps(ids, [r.request.params.temperature > 0 for r in rows], limits, can_draft,
                                        remaining, open_limits), can_draft

    def _use(self, key: tuple, plan, caps: list[int], host_drafts) -> tuple[int, np.ndarray, list | None, bool]:
        """Run the controller's ``plan`` (a Decision) in this step with these ``caps`` [R]; :meth:`_plan`'s result."""
        self._held, self._held_key, self._ahead = plan.hold, key, plan.ahead
        held_k, held_caps = plan.held or (plan.k, plan.caps)
        self._held_plan = held_k, held_caps.tolist()
        return plan.k, np.array(caps, np.int32), host_drafts, plan.detached and self.proposer.syncs

    def _prepare(self, rows, slots: np.ndarray, k: int, ahead: int) -> None:
        """Plan the next step of ``rows`` while the device runs this one (of K = ``k``, drafting ``ahead``), from
        the acceptance up to the last step: a full plan on the host between two steps delays the next launch by
        its whole time (~0.2 ms, draft_model at batch 1 on the shipped pair), and work beside the device's step
        costs a fraction of that. Only where the next step plans in full anyway and its rows' limits cannot
        change: no row can reach max_tokens or max_model_len within this step and the next one's drafts, and
        the proposer's drafts do not come from a host lookup (it needs this step's tokens)."""
        c = self.controller
        if c is None or self._held or self.proposer.host_side or not self.scheduler.slots.synced[slots].any():
            return
        remaining = self._remaining(rows)
        if int(remaining.min()) <= k + 1 + self.k_max:
            return
        ids, waiting = [r.request.request_id for r in rows], bool(self.scheduler.waiting)
        key = slots.tobytes(), waiting
        self._prepared = key, None, c.plan_state(ids)  # (set first: abort_all undoes a plan interrupted midway)
        # (this step commits a token a row at least)
        wanted, can_draft = self._wanted(rows, slots, ids, None if waiting else remaining - 1, ready_after=ahead)
        plan = c.decide(bucket_for(len(rows), self.config.row_buckets, "num_seqs"), wanted, can_draft=can_draft)
        self._prepared = key, plan, self._prepared[2]

    def _prepared_step(self, rows, slots: np.ndarray, key: tuple):
        """:meth:`_plan` from the plan :meth:`_prepare` made for these rows, or None (dropped: a row's limits fell
        short of its caps after all)."""
        plan = self._prepared[1]
        caps = plan.caps.tolist()
        if any(a < b for a, b in zip(self._row_limits(rows, slots, plan.k)[0], caps)):
            self._drop_prepared()
            return None
        self._prepared, self._planned = None, True
        return self._use(key, plan, caps, None)

    def _drop_prepared(self) -> None:
        """Forget the plan :meth:`_prepare` made, as if never made: its step did not come for its rows."""
        if self._prepared is not None:
            self.controller.restore_plan_state(self._prepared[2])
            self._prepared = None

    def _held_step(self, rows, slots: np.ndarray) -> tuple[int, np.ndarray, list[np.ndarray] | None, bool]:
        """A step of the same rows under the controller's last plan (:attr:`Decision.hold`), without planning:
        no drafts, or each row's drafts up to its planned cap (those a host lookup finds; K = the most any row
        has)."""
        self._held -= 1
        k, caps = self._held_plan
        self._ahead = max(k, 1)  # (a plan whose drafts grow next step is not held)
        if k == 0:
            self.controller.held_step(0)
            return 0, np.zeros(len(rows), np.int32), None, False
        limits = [min(a, b) for a, b in zip(self._row_limits(rows, slots, k)[0], caps)]
        host_drafts = None
        if self.proposer.host_side:
            host_drafts, limits = self._lookup([r.request.request_id for r in rows], slots, limits)
        k = max(limits)
        self.controller.held_step(k)
        return k, np.array(limits, np.int32), host_drafts, False

    def _row_limits(self, rows, slots: np.ndarray, k: int,
                    ready_after: int | None = None) -> tuple[list[int], list[bool], list[int] | None]:
        """([R]: the most drafts each row can verify, [R]: its proposer state is current, [R] or None: for a
        proposer that drafts ahead, the first were all K draft positions ready). Drafts only where they can commit:
        never past max_tokens or max_model_len. ``ready_after``: the drafts ready in each row once the step
        running now commits (:meth:`_prepare`; the step's draft_ahead), not those ready now."""
        # Python lists, here and through the plan: right after a step, numpy calls on few-element arrays cost ~10
        # us each, the first ufunc ~45 us (np.minimum of two 1-element arrays, batch 1; right after it 1.3 us).
        table, max_len = self.scheduler.slots, self.config.max_model_len
        synced, ready = table.synced, table.ready_drafts if self.proposer.drafts_ahead else None
        limits, can_draft, open_limits = [], [], None if ready is None else []
        for r, slot in zip(rows, slots.tolist()):
            request = r.request
            in_sync = bool(synced[slot])
            have = 0 if ready is None else ready_after if ready_after is not None else int(ready[slot])
            can = in_sync and (ready is None or have > 0)
            n = 0
            if in_sync and r.samples:
                n = max(0, min(k, request.params.max_tokens - len(request.output_token_ids) - 1,
                               max_len - request.num_tokens - 1))
            if ready is not None:
                open_limits.append(n)
                n = min(n, have)
            limits.append(n)
            can_draft.append(can)
        return limits, can_draft, open_limits

    def _remaining(self, rows) -> np.ndarray:
        """int64 [R]: tokens each row may still generate (max_tokens and max_model_len; an end-of-sequence token
        may stop it sooner)."""
        return np.array([min(r.request.params.max_tokens - len(r.request.output_token_ids),
                             self.config.max_model_len - r.request.num_tokens) for r in rows], np.int64)

    def _lookup(self, ids: list[str], slots: np.ndarray, limits: list[int],
                remaining: np.ndarray | None = None) -> tuple[list[np.ndarray], list[int]]:
        """A host proposer's drafts for each row (at most ``limits`` each) and how many it found ([R]).

        With ``remaining`` (a draining batch, :attr:`RowCaps.remaining`) the rows with the most tokens left are
        looked up first, one by one, and the others only if each of those found drafts: else no draft can
        shorten the drain and the step is plain (the controller's rule), so more lookups would be host time for
        nothing."""
        # Python lists (see _row_limits; with numpy, ngram at batch 8 spent ~60 us a step here outside the lookups).
        n, lim = len(ids), limits
        drafts, found = [EMPTY_DRAFTS] * n, [0] * n
        groups = [[i for i in range(n) if lim[i]]]
        if remaining is not None:
            rem = remaining.tolist()
            top = max(rem)
            last = [i for i in range(n) if rem[i] == top]
            groups = [] if not all(lim[i] for i in last) else [
                *([i] for i in last), [i for i in range(n) if rem[i] != top and lim[i]]]
        table, slot_list = self.scheduler.slots, slots.tolist()
        for rows in groups:
            if not rows:
                continue
            got = self.proposer.propose_host([ids[i] for i in rows], [table.history(slot_list[i]) for i in rows],
                                             [lim[i] for i in rows])
            for i, d in zip(rows, got):
                drafts[i], found[i] = d, len(d)
            if remaining is not None and not all(found[i] for i in rows):
                break
        return drafts, found

    def draft_ahead(self, decoding: bool) -> int:
        """Drafts a proposer with ``chained_drafts`` makes in this step for the rows' next step: all K_max with a
        fixed K or in a prefill step; under the controller what its plan asked for (:attr:`Decision.ahead`;
        warmup times a step of K with ``max(K, 1)``), as each costs a proposer forward (4 sampled EAGLE-3 drafts
        ahead made a batch-1 step without drafts 2.9x a detached one)."""
        if self.controller is None or not decoding or not self.proposer.chained_drafts:
            return self.k_max
        return self._ahead

    def _prefill_detached(self, rows) -> bool:
        """Run this prefill step without the proposer: no row in it is decoding with current proposer state,
        and the controller expects requests like these to decode faster with the target alone at the batch
        size the scheduler holds (then drafting for them would never pay, and neither would following their
        prompts)."""
        c, table = self.controller, self.scheduler.slots
        if c is None or not self.proposer.syncs:
            return False
        decoding = [r.num_new == 1 and bool(r.request.output_token_ids) for r in rows]
        if any(d and table.synced[r.request.slot] for d, r in zip(decoding, rows)):
            return False
        # The plan holds the requests being prefilled, not the (detached) rows decoding beside them: they stand for
        # requests like them, and count towards the controller's next exploring prefill.
        rows = [r for d, r in zip(decoding, rows) if not d]
        sched = self.scheduler
        expected = min(len(sched.running) + len(sched.waiting), self.config.max_num_seqs)
        limits = np.asarray([min(self.k_max, r.request.params.max_tokens - 1) for r in rows]).clip(0)
        # Every request is admitted: the batch will drain (its decoding steps count drafts so, RowCaps.remaining).
        draining = len(sched.running) + len(sched.waiting) <= self.config.max_num_seqs
        plan = c.row_caps([r.request.request_id for r in rows], [r.request.params.temperature > 0 for r in rows],
                          limits, np.ones(len(rows), bool), self._remaining(rows) if draining else None)
        detached = c.prefers_plain(bucket_for(expected, self.config.row_buckets, "num_seqs"), plan, expected)
        c.num_detached_prefills += int(detached)
        return detached

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        start_time = time.perf_counter()
        rows = self.scheduler.schedule(drafting=self._drafting)
        n = len(rows)
        slots = np.asarray([r.request.slot for r in rows], np.int64)
        starts = np.asarray([r.start for r in rows], np.int64)
        num_new = np.asarray([r.num_new for r in rows], np.int64)
        decoding = num_new.max() == 1  # drafts are verified only when every row decodes (prefill steps are plain)
        made = self._prepared
        if made is not None and not (decoding and made[1] is not None
                                     and made[0] == (slots.tobytes(), bool(self.scheduler.waiting))):
            self._drop_prepared()  # (before anything else asks the controller: its state is the plan's)
        plan_start = time.perf_counter()
        if decoding and self.spec_stats is not None:
            k, num_drafts, host_drafts, detached = self._plan(rows, slots)
            self._drafting = k > 0
        else:
            self._held = 0
            k, num_drafts, host_drafts, detached = 0, np.zeros(n, np.int32), None, self._prefill_detached(rows)
        # The controller's step costs leave out the planning above, timed apart (see CostModel), and include the
        # last step's accounting (_account), which overlaps the device's step.
        run_start = time.perf_counter()
        cfg = self.config
        bucket = (bucket_for(n, cfg.row_buckets, "num_seqs"),
                  bucket_for(int(num_new.max()), cfg.length_buckets, "query_len"), k)
        batch = self.runner.host_batch(bucket)
        table = self.scheduler.slots
        table.fill(batch, self.runner.packed(batch), slots, starts, num_new,
                   np.asarray([len(r.request.output_token_ids) for r in rows], np.int64))
        batch.num_drafts[:n] = num_drafts
        if host_drafts is not None:
            for i, d in enumerate(host_drafts):
                batch.host_drafts[i, : num_drafts[i]] = d[: num_drafts[i]]
        ahead = self.draft_ahead(decoding)
        if detached:
            table.synced[slots] = False  # the proposer does not see this step's tokens
        else:
            batch.attached[:n] = True
            batch.draft_ahead[:n] = ahead
        pending = self.runner.launch(batch)
        self._account()  # the last step's costs, while the device runs this one (see _account)
        if not detached and self.spec_stats is not None and (decoding or all(r.samples for r in rows)):
            self._prepare(rows, slots, k, ahead)  # (a prefill step whose rows all decode next, too)
        packed = self.runner.fetch(pending)[:n]  # the step's one host fetch
        finished = self._commit(rows, packed, num_drafts, k, ahead)
        done = time.perf_counter()
        elapsed = done - start_time
        switched, self._last_kind = self._last_kind != (bucket, detached), (bucket, detached)
        last_done, self._last_done = self._last_done, done
        if decoding and self.controller is not None and not self.runner.compiled_last_run:
            sampled = any(r.request.params.temperature > 0 for r in rows)  # (numpy right after a step is slow)
            self._unaccounted.append(((bucket[0], sampled), k, detached, ahead, switched, self._planned,
                                      None if last_done is None else plan_start - last_done,
                                      run_start - plan_start, done - run_start))
            if not detached and not finished and self.controller.shadow_due(bucket[0], sampled):
                self._shadow_step(rows, slots, bucket[0], sampled)
        if not self.scheduler.has_unfinished:
            self._drop_prepared()
            self._account(flush=True)  # (no next step to hide it behind)
        self.stats.num_steps += 1
        self.stats.step_seconds += elapsed
        return finished

    def _account(self, flush: bool = False) -> None:
        """Hand the decoding steps' timings to the controller's cost model: while a plan holds, in one go before
        the step that plans next (else every ``ACCOUNT_BATCH`` steps), or at once with ``flush``.

        Runs while the device computes the next step (or before a shadow step, or when the batch is done): host
        work before a step's launch cost 2.5-4x its own time there and ~0.2x after it (shipped target alone,
        batch 1, a 35 us busy loop: +90-145 us a step before the launch, +6 us between launch and fetch; in part
        because on the 2-vCPU VM measured, threads idle for 0.2-1 ms wake 16-105 us late). The costs a plan
        reads therefore lag one step. In one go, because code run right after a step runs cold: accounting one
        step at a time took 9-11 us of every held step (median; ngram and eagle3 at batch 1, T 0.8), 0.5-0.7 us
        in one go (and 45-48 us for the steps of a hold)."""
        backlog = self._unaccounted
        if not backlog or (self._held and not flush and len(backlog) < ACCOUNT_BATCH):
            return
        self._unaccounted, costs, chained = [], self.controller.costs, self.proposer.chained_drafts
        for bucket, k, detached, ahead, switched, planned, overhead, planning, seconds in backlog:
            if overhead is not None:
                costs.observe_overhead(bucket, overhead)
            # A chained proposer's step costs its K's verify and its drafts ahead; the kind K is what a run of K
            # costs, drafting K ahead (as warmup times it). A step growing or shrinking the drafts ahead costs
            # another K's drafts: it would pollute this K's cost (eagle3 at batch 1, T 0.8: K = 1 steps drafting
            # 3 ahead, before a K = 3 run, put K = 1 at 1.9 ms where a run of K = 1 costs ~1.3).
            if detached or not chained or ahead == max(k, 1):
                costs.observe((bucket[0], k, detached, bucket[1]), seconds, switched=switched)
            if not detached:
                costs.observe_planning(bucket, planning, full=planned)
        if not self._held:  # the next step plans: its costs are worked out here, off its path
            costs.refresh(*backlog[-1][0])

    def _shadow_step(self, rows, slots: np.ndarray, num_rows: int, sampled: bool) -> None:
        """Time the target alone on ``rows`` (just decoded; ``num_rows`` their row bucket) for the controller,
        twice (the first runs cold, see ``CostModel``), in steps that write nothing: each row re-reads its context
        up to its last computed token, with no KV slot and no persistent slot (as padding rows have), and the
        output is dropped (``ControllerConfig.shadow_band``). It leaves out the commit a real step does."""
        self._account(flush=True)  # (the cost model sees steps in the order they ran)
        n = len(rows)
        starts = np.asarray([r.request.num_computed_tokens - 1 for r in rows], np.int64)
        outputs = np.asarray([len(r.request.output_token_ids) for r in rows], np.int64)
        bucket = (num_rows, self._decode_length, 0)
        for switched in (True, False):
            start = time.perf_counter()
            batch = self.runner.host_batch(bucket)
            self.scheduler.slots.fill(batch, self.runner.packed(batch), slots, starts, np.ones(n, np.int64),
                                      outputs)
            batch.slots[:n] = -1
            batch.slot_mapping[:n] = -1
            batch.next_token[:n] = -1  # (it samples, as a decoding row does)
            self.runner.run(batch)  # no row attached: the detached executable
            self.controller.costs.observe((num_rows, 0, True, sampled), time.perf_counter() - start,
                                          switched=switched)
        self._last_kind = bucket, True

    def _commit(self, rows, packed: np.ndarray, num_drafts: np.ndarray, k: int, ahead: int) -> list[Request]:
        finished = []
        now = time.perf_counter()
        table = self.scheduler.slots
        if k and self.spec_stats is not None:
            self.spec_stats.num_spec_steps += 1
        tokens, accepted_counts = unpack(packed, k)
        logprobs = None
        for i, row in enumerate(rows):
            request = row.request
            accepted = accepted_counts[i]
            computed = row.start + row.num_new
            if self.proposer.drafts_ahead:
                # The head drafted from this step's features, over a complete history of its own (a row that
                # missed a detached step has a stale head cache and never drafts again).
                table.ready_drafts[request.slot] = ahead if row.samples and table.synced[request.slot] else 0
            if not row.samples:
                request.num_computed_tokens = computed
                continue
            self.stats.num_row_steps += 1
            first = not request.output_token_ids
            kept = self.scheduler.commit(row, tokens[i][: accepted + 1], num_computed=computed + accepted)
            if request.output_logprobs is not None:
                if logprobs is None:
                    logprobs = unpack_logprobs(packed, k)
                width = (logprobs.shape[-1] - 2) // 2
                n = min(request.params.logprobs, width)
                for lp in logprobs[i, : len(kept)]:  # (logprob, rank, top ids, top logprobs) per kept token
                    request.output_logprobs.append((float(lp[0]), int(lp[1]), lp[2:2 + n].astype(np.int64),
                                                    lp[2 + width:2 + width + n].copy()))
            drafted = int(num_drafts[i])
            if drafted:
                self.spec_stats.observe(drafted, accepted)
                if self.controller is not None:
                    self.controller.observe(request.request_id, request.params.temperature > 0, drafted, accepted)
                request.num_spec_steps += 1
                request.num_draft_tokens += drafted
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
        self.stats.num_finished_requests += len(finished)
        return finished
