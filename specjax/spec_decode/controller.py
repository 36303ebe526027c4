"""Choosing the speculation length every step, from measured step costs and each request's acceptance.

For a decoding step of ``R`` rows the controller picks ``K in 1..K_max`` drafts (rows draft up to their own
cap), ``K = 0`` with the proposer attached (it keeps its device state in step; a draft head also drafts ahead),
or a *detached* plain step: the target alone. Rows whose proposer state misses a detached step can never draft
again, so detaching needs the target alone to beat both attached choices outright for ``detach_after`` steps in
a row (meanwhile the better attached choice runs), on evidence (``detach_z``) and on a measured drafting cost
(the vote first runs that K once). New requests are prefilled detached by the same rules
(:meth:`SpeculationController.prefers_plain`); one per ``explore_every`` batches' worth of them is prefilled
attached and probes one draft first, so a low early estimate of the method can recover.

It maximizes expected committed tokens per second, ``(R + sum_r E[accepted_r | cap_r]) / cost(bucket, K)``,
drafting only when that beats a step without drafts by ``min_speedup`` or while the method's first
``learn_drafts`` drafts teach it the acceptance (see ``learn_z``, ``learn_requests``), where ``E[accepted | c]
= sum_{j<=c} prod_{i<=j} alpha_i`` with per-position conditional acceptance ``alpha_i`` estimated per request
(a Beta-style mean with the method's running average as prior, greedy and sampled requests apart:
:class:`~specjax.spec_decode.estimates.AcceptanceEstimates`), and
``cost`` is the wall time of that step kind (:class:`~specjax.spec_decode.costs.CostModel`: the machine's
current speed x the kind's measured relation to it; a drafting K next to the chosen one is re-measured once per
``cost_max_age`` steps while it could be the better one; never above a kind that does more work).

Where the proposer's weights ship its acceptance measured against this target (``acceptance.json``,
:class:`~specjax.spec_decode.acceptance.AcceptancePrior`), the method's running average starts from it (weighing
``prior_drafts``): there is nothing to learn, and a new request may be prefilled detached on warmup's costs.

A row's cap stops where one more draft adds less than ``min_gain`` expected tokens, so a request whose drafts
keep failing stops drafting while others go on; when no row would draft, the step is plain and host proposers
are not even asked (:meth:`SpeculationController.row_caps` comes before the lookup). A row that has not drafted
for ``probe_every`` decoding steps gets a one-draft probe; each probe doubles that request's wait for the next.
"""

from __future__ import annotations

import math

import numpy as np

from specjax.spec_decode.acceptance import AcceptancePrior, expected_accepted_sums
from specjax.spec_decode.controller_config import LEARN_DRAFTS_PER_REQUEST, ControllerConfig  # noqa: F401 (re-exported)
from specjax.spec_decode.costs import RELATION_MIN_STEPS, CostModel
from specjax.spec_decode.drain import drain_gains
from specjax.spec_decode.estimates import AcceptanceEstimates
from specjax.spec_decode.plan import Decision, RowCaps


class SpeculationController:
    """Picks K and per-row caps each decoding step (see the module docstring)."""

    def __init__(self, k_max: int, config: ControllerConfig, *, can_detach: bool,
                 prior: AcceptancePrior | None = None):
        self.k_max = k_max
        self.config = config
        self.can_detach = can_detach
        self.costs = CostModel(config.cost_window)
        self.estimates = AcceptanceEstimates(k_max, config, prior)
        """The method's and each running request's acceptance, as the plans read it."""
        self._idle_steps: dict[str, int] = {}
        self._probe_wait: dict[str, int] = {}
        self._detach_votes = 0
        self._held_steps = 0  # decoding steps run on a held decision since the last plan
        self._held_plans = 0  # consecutive plans that held (for the same rows, ``_held_ids``) before this one
        self._held_ids: list[str] | None = None
        self._draft_held: tuple | None = None  # the last drafting plan's (rows, K, caps) if it held, and how many
        self._draft_holds = 0  # plans in a row before it made the same one
        self._miss_holds = 0  # plans in a row, any rows, held because the method's lookups seldom hit (see decide)
        self._held_idle: list[str] = []  # the rows the held decision gave no drafts
        self.lookup_hit_rate = 1.0
        """Share of recent plans (an EMA over ~16) where a host lookup found drafts, among those that drafted or
        would have had it found them all."""
        self.lookup_saving: float | None = None
        """Over the same plans (an EMA over ~16; None before the first hit): the step time a plan's lookups
        saved, a plain step's cost x (1 - its rate / the drafting rate) where they found drafts worth verifying,
        0 where they missed (see ``ControllerConfig.min_lookup_hits``)."""
        self.k_histogram = [0] * (k_max + 1)
        self.num_detached_steps = 0
        self.num_detached_prefills = 0
        self._detached_prefill_votes = 0  # requests whose prefill the controller chose detached (see explore_every)
        self._last_rates: tuple[tuple[int, bool], float, float] | None = None  # the last attached plan's (rows,
        # sampled), the tokens per second of the kind it chose and of a detached step (see shadow_due)

    # ------------------------------------------------------------------ estimates

    def conditional_acceptance(self, request_id: str, sampled: bool) -> np.ndarray:
        """float64 [K_max]: the request's estimated P(accept draft i | drafts before it accepted)."""
        alpha = self.estimates.conditional(request_id, sampled)
        return np.asarray(self.estimates.prior(sampled)[0] if alpha is None else alpha)

    @staticmethod
    def expected_accepted(alpha: np.ndarray) -> np.ndarray:
        """[..., K_max + 1]: E[accepted | cap c] for c = 0..K_max given conditional rates ``alpha`` [..., K_max]."""
        reach = np.cumprod(np.asarray(alpha, np.float64), axis=-1)
        return np.concatenate([np.zeros(reach.shape[:-1] + (1,)), np.cumsum(reach, axis=-1)], axis=-1)

    def observe(self, request_id: str, sampled: bool, num_drafts: int, num_accepted: int) -> None:
        """One verification of the request's drafts (see :meth:`AcceptanceEstimates.observe`)."""
        self.estimates.observe(request_id, sampled, num_drafts, num_accepted)

    def finish(self, request_id: str) -> None:
        """The request ended: its estimate and its probe and idle counts go."""
        self.estimates.finish(request_id)
        self._idle_steps.pop(request_id, None)
        self._probe_wait.pop(request_id, None)

    # ------------------------------------------------------------------ the choice

    def row_caps(self, request_ids: list[str], sampled: list[bool], limits: np.ndarray,
                 can_draft: np.ndarray, remaining: np.ndarray | None = None,
                 open_limits: list[int] | None = None) -> RowCaps:
        """Each row's worthwhile drafts from its acceptance estimate alone (no costs, no drafts needed).

        ``limits`` int [R]: the most drafts each row can commit (max_tokens / max_model_len) and has ready;
        ``can_draft`` bool [R]: the row's proposer state is current; ``remaining`` int [R]: see
        :attr:`RowCaps.remaining`; ``open_limits`` int [R]: a chained proposer's ``limits`` were all its draft
        positions ready (see :attr:`RowCaps.open_caps`).
        """
        # Plain Python per row: this runs every plan, right after a step (see AcceptanceStats).
        cfg = self.config
        if self._held_steps:  # steps run on a held decision: its rows without drafts were idle
            for rid in self._held_idle:
                if rid in self._idle_steps:  # (a request that finished during the hold is gone)
                    self._idle_steps[rid] += self._held_steps
            self._held_steps = 0
        reach, caps, probing, until_probe = [], [], [], 1 << 30
        open_caps = None if open_limits is None else []
        for i, (rid, smp, limit, can) in enumerate(zip(request_ids, sampled, np.asarray(limits).tolist(),
                                                       np.asarray(can_draft).tolist())):
            row = self.estimates.reach(rid, bool(smp))  # non-increasing
            useful = sum(1 for x in row if x >= cfg.min_gain)  # positions worth drafting
            limit = min(limit, self.k_max) if can else 0
            probe = False
            if cfg.probe_every and limit > 0:
                ahead = self._probe_wait.get(rid, cfg.probe_every) - self._idle_steps.get(rid, 0)
                # A row due already that does not probe in this step found no draft to probe with: it tries
                # again when a plan is next made.
                probe = ahead <= 0
                if not probe:
                    until_probe = min(until_probe, ahead)
            reach.append(row)
            caps.append(min(max(useful, int(probe)), limit))
            probing.append(probe)
            if open_caps is not None:
                open_caps.append(max(caps[-1], min(useful, open_limits[i], self.k_max)))
        return RowCaps(request_ids=list(request_ids), reach=reach, caps=caps, probing=probing,
                       sampled=any(sampled), until_probe=until_probe,
                       remaining=None if remaining is None else np.asarray(remaining).tolist(),
                       row_sampled=[bool(x) for x in sampled], open_caps=open_caps)

    def decide(self, rows: int, plan: RowCaps, found: np.ndarray | None = None,
               can_draft: np.ndarray | None = None) -> Decision:
        """Plan a decoding step of ``rows`` (its row bucket) from :meth:`row_caps`.

        ``found`` int [R]: for host proposers, how many drafts the lookup found (caps shrink to it);
        ``can_draft`` bool [R]: the rows' proposer state is current (default: all).
        """
        cfg = self.config
        cap_row = plan.caps if found is None else [min(c, int(f)) for c, f in zip(plan.caps, found)]
        gains = self._gains(plan.reach, cap_row, plan.remaining)
        n = len(plan.request_ids)
        draft_k, draft_rate, attached_rate, detached_rate = self._plan_rates(rows, plan, gains)
        pays = draft_k > 0 and draft_rate >= cfg.min_speedup * max(attached_rate, detached_rate)
        learn_k = self._learning_k(rows, n, cap_row, plan.sampled, ids=plan.request_ids) if draft_k > 0 else 0
        drafting = pays or learn_k > 0
        draft_k = learn_k or draft_k
        detached = measure = False
        probes = any(p and c > 0 for p, c in zip(plan.probing, cap_row))
        stale = can_draft is not None and not any(can_draft)
        if (not drafting and self._detach_wins(draft_rate, attached_rate, detached_rate)
                and (stale or self._detach_sure(rows, plan, cap_row))):
            self._detach_votes += 1
            measure = self._unmeasured(rows, draft_k, plan.sampled)  # (the measuring step still counts as a vote)
            # A due probe runs first: detaching would end the rows' drafts, and with them the probe's evidence.
            detached = not measure and not probes and (self._detach_votes >= cfg.detach_after or stale)
        else:
            self._detach_votes = 0
        if not drafting and not detached:
            # Attached either way: drafting needs the margin over an attached step without drafts only. (A
            # head's attached K=0 step drafts ahead and costs what K=1 costs; running it while detaching is
            # still being voted on would be slower than both drafting and the target alone.) Or the vote
            # runs the drafting K once to measure it (see _unmeasured).
            drafting = measure or (draft_k > 0 and draft_rate >= cfg.min_speedup * attached_rate)
        if measure:
            k = draft_k
        else:
            k = self._explore(rows, draft_k, cap_row, plan, gains) if drafting else 0
        explored = drafting and k != draft_k
        if k == 0 and not detached and probes:
            k = 1  # a probe: one draft for the rows whose estimate has not been tested for a while
        caps = [min(c, k) for c in cap_row]
        for rid, c, probe in zip(plan.request_ids, caps, plan.probing):
            if c:
                self._idle_steps[rid] = 0
                wait = self._probe_wait.get(rid, cfg.probe_every)
                self._probe_wait[rid] = min(2 * wait, 1 << 30) if probe else cfg.probe_every
            else:
                self._idle_steps[rid] = self._idle_steps.get(rid, 0) + 1
        self.count_step(k, detached)
        chosen_rate = attached_rate  # (tokens a step as _plan_rates counts them)
        if k and not math.isnan(gains[k]):
            chosen_rate = ((n if plan.remaining is None else 1) + gains[k]) / self.costs.estimate(rows, k, False,
                                                                                                 plan.sampled)
        self._last_rates = None if detached else ((rows, plan.sampled), chosen_rate, detached_rate)
        ahead = self._ahead(rows, plan, k, cap_row) if not detached else 1
        hold, held, seldom = 0, None, False
        # One row's host lookup: a held plan is what a hit would make; its held steps verify what each lookup
        # finds, up to the caps, or run plain, as new plans would (not while probing or learning).
        one_lookup = (found is not None and n == 1 and not any(plan.probing)
                      and not self.estimates.learning(plan.sampled))
        if found is not None and k:  # the lookup found drafts worth verifying: a hit
            self.lookup_hit_rate += (1.0 - self.lookup_hit_rate) / 16
            plain = self.costs.estimate(rows, 0, False, plan.sampled)
            self._lookup_saved(plain * max(0.0, 1.0 - attached_rate / draft_rate) if draft_rate > 0 else 0.0)
        # The lookup found every draft asked for: this decision is the one a hit makes (no need to work it out).
        found_all = found is not None and cap_row == plan.caps
        same_rows = plan.request_ids == self._held_ids
        self._held_ids, self._held_plans = plan.request_ids, self._held_plans + 1 if same_rows else 0
        if k == 0 and not detached and not self._detach_votes:
            # Each plan in a row that keeps the same rows plain holds twice as long, up to 8x.
            limit = cfg.replan_every * (1 << min(self._held_plans, 3)) - 1
            k_found = self._could_draft(rows, plan) if found is not None and not found_all else 0
            if k_found:
                # Only the lookup's misses kept this step plain, and the next lookup may hit: skip lookups only
                # for a method whose lookups seldom find drafts (their host time would not pay).
                self.lookup_hit_rate += (float(any(cap_row)) - self.lookup_hit_rate) / 16
                self._lookup_saved(0.0)
                # (Held for replan_every steps: a lookup that hits after the text turns repetitive drafts, and on a
                # large model a hit is worth far more than a lookup costs: doubling these holds, SmolLM2 ngram at
                # batch 1 greedy drafted in 1% of steps, 1.01x plain, fixed K = 2 1.26x. Longer only while
                # planning costs more than max_planning_share of a plain step.)
                limit = 0
                seldom = self.lookup_hit_rate < cfg.min_lookup_hits
                if seldom or (not one_lookup and self._lookups_dear(rows, plan)):
                    # Where the method's lookups seldom find drafts, that is a matter of the method, not of these
                    # rows: the doubling carries over to the next request, and a probe falling due does not end the
                    # hold (it would be one more lookup). ngram at batch 1, T 0.8 on the shipped target, which never
                    # drafts there, planned ~3 times per 64-token request, each ~0.3-0.5 ms with its lookup.
                    in_row = self._miss_holds if seldom else self._held_plans
                    dear = self._planning_dear(rows, plan.sampled)
                    limit = (cfg.replan_every << (min(in_row, 3) if dear else 0)) - 1
                if not limit and one_lookup:  # held as a hit's plan (the same decision), doubling alike
                    held = self._hit_plan(plan, k_found)
                    limit = self._draft_hold(plan.request_ids, *held)
            # The rows' idle counts grow by one here; the first probe comes until_probe steps from now.
            hold = limit if seldom else max(0, min(limit, plan.until_probe - 1))
        self._miss_holds = self._miss_holds + 1 if seldom else 0
        if not hold or k or held:
            self._held_plans, self._held_ids = 0, None
        # A host lookup's drafts are held for one row only: with more rows, which of them found drafts decides
        # whether verifying pays (ngram at batch 8 held such plans at 0.89x plain).
        if (k and (found is None or one_lookup) and k == draft_k and not learn_k and not probes
                and not self._detach_votes and ahead == k):
            if found is not None:  # caps as if the lookup had found every draft asked for (not only this one's)
                k_found = k if found_all else self._could_draft(rows, plan) or k
                held = self._hit_plan(plan, k_found)
            hold = max(0, min(self._draft_hold(plan.request_ids, *(held or (k, caps))), plan.until_probe - 1))
        else:
            if held is None:  # (a lookup's miss, held as a hit's plan, keeps the hits' doubling)
                self._draft_held, self._draft_holds = None, 0
            if explored and (found is None or one_lookup) and not probes and not self._detach_votes and ahead >= k:
                # (Also where the next neighbour gets its drafts made first, ahead > k: else a chained head's K = 3
                # was only ever timed in single cold steps, 2.3-3.0 ms against 1.9 in a run, and never chosen.)
                hold = max(0, min(1, plan.until_probe - 1))  # its first step ran cold, its second is timed
        held_caps = caps if held is None else held[1]
        self._held_idle = [rid for rid, c in zip(plan.request_ids, held_caps) if not c] if hold else []
        return Decision(k=k, caps=np.array(caps, np.int32), detached=detached, hold=hold, held=held, ahead=ahead)

    def _draft_hold(self, request_ids: list[str], k: int, caps) -> int:
        """Held steps of a drafting decision (K = ``k``, ``caps`` [R]) for ``request_ids``: ``draft_replan_every - 1``,
        twice as many for each plan in a row that made it (up to 4x), for these rows or the next request's (batch 1:
        2214 -> 1465 plans for 181 rounds of eagle3, 1.009-1.018x as fast; draft_model 1.007-1.011x, T 0.8 alike)."""
        key = (len(request_ids), k, [int(c) for c in caps])
        self._draft_holds = self._draft_holds + 1 if key == self._draft_held else 0
        self._draft_held = key
        every = self.config.draft_replan_every
        return (every << min(self._draft_holds, 2) if every > 1 else every) - 1  # (0 or 1: plan every step)

    def _ahead(self, rows: int, plan: RowCaps, k: int, cap_row: list[int]) -> int:
        """:attr:`Decision.ahead` of a step of K = ``k``: ``max(k, 1)``, or where the drafts ready held the rows
        back (``plan.open_caps``), the K a plan with every position ready would draft at (by the rules of
        :meth:`decide`: learning, or beating an attached step without drafts by the margin), or the neighbour
        ``k + 1`` when :meth:`_explore` is due to try it. A drafting K then grows one step later than it could
        have, where drafting ``k + 1`` ahead every step cost a proposer forward in each (SmolLM2's EAGLE-3 head at
        batch 1 drafting K = 1 in 96% of its steps ran 0.90x plain, fixed K = 1 1.03x)."""
        ahead = max(k, 1)
        open_caps = plan.open_caps
        if open_caps is None or ahead >= self.k_max or not any(o > c for o, c in zip(open_caps, cap_row)):
            return ahead
        gains = self._gains(plan.reach, open_caps, plan.remaining)
        want, want_rate, attached_rate, _ = self._plan_rates(rows, plan, gains)
        learn = self._learning_k(rows, len(open_caps), open_caps, plan.sampled, ids=plan.request_ids) if want else 0
        if learn or (want and want_rate >= self.config.min_speedup * attached_rate):
            ahead = max(ahead, learn or want)
        if k and self._explore(rows, k, open_caps, plan, gains) == k + 1:
            ahead = max(ahead, k + 1)
        return min(ahead, self.k_max)

    def shadow_due(self, rows: int, sampled: bool) -> bool:
        """Time the target alone on the rows of the step just run, which the last plan ran attached (a *shadow*
        step that writes nothing) now: see ``ControllerConfig.shadow_band`` for when."""
        last, band, key = self._last_rates, self.config.shadow_band, (rows, 0, True, sampled)
        if not band or last is None or last[0] != (rows, sampled) or not last[2] or last[1] > band * last[2]:
            return False
        return self.costs.age(key) >= (self.config.cost_max_age << min(3, self.costs.measurements(key)) or math.inf)

    def _lookup_saved(self, seconds: float) -> None:
        """One plan's :attr:`lookup_saving` (it starts at the first hit: before any, ``min_lookup_hits`` alone
        decides)."""
        last = self.lookup_saving
        self.lookup_saving = (seconds or None) if last is None else last + (seconds - last) / 16

    def _lookups_dear(self, rows: int, plan: RowCaps) -> bool:
        """Several rows' host lookups saved less step time per plan, recently, than a full plan costs: a plan
        kept plain by their misses is then held like one where lookups seldom hit (ngram at batch 8 on the shipped
        target: a ~0.3 ms plan before each ~3.5 ms step, drafting in 10% of them, ran 0.94x plain)."""
        saved = self.lookup_saving
        return saved is not None and saved < self.costs.full_plan(rows, plan.sampled)

    def _planning_dear(self, rows: int, sampled: bool) -> bool:
        """The controller's planning costs more per attached step of the bucket than ``max_planning_share`` of a
        plain step."""
        planning = self.costs.planning(rows, sampled)
        return planning > self.config.max_planning_share * (self.costs.estimate(rows, 0, False, sampled) - planning)

    @staticmethod
    def _hit_plan(plan: RowCaps, k: int) -> tuple[int, np.ndarray]:  # (K, int32 caps [R]): if a lookup found all
        return k, np.array([min(c, k) for c in plan.caps], np.int32)

    def _could_draft(self, rows: int, plan: RowCaps) -> int:
        """The K a step would draft at if a host lookup found every draft the rows' estimates ask for, else 0.
        (By the weakest of the rules in :meth:`decide`: learning, or beating the attached plain step by the
        margin.)"""
        gains = self._gains(plan.reach, plan.caps, plan.remaining)
        n = len(plan.request_ids)
        draft_k, draft_rate, attached_rate, _ = self._plan_rates(rows, plan, gains)
        if not draft_k:
            return 0
        learn_k = self._learning_k(rows, n, plan.caps, plan.sampled, ids=plan.request_ids)
        return learn_k or (draft_k if draft_rate >= self.config.min_speedup * attached_rate else 0)

    def held_step(self, k: int = 0) -> None:
        """A decoding step of K = ``k`` ran a held decision (:attr:`Decision.hold`), without planning."""
        self._held_steps += 1
        self.count_step(k, False)

    def _unmeasured(self, rows: int, k: int, sampled: bool) -> bool:
        """Drafting at ``k`` (> 0) never ran in a real step of this bucket: its cost is warmup's time for it,
        scaled like the kinds that did. Detaching cannot be undone, so it does not rest on that: warmup's
        all-padding rows time kinds unevenly (shipped pair at batch 8, sampled: drafting looked 20% dearer than
        it was, and new requests were prefilled detached where fixed K = 2 ran 1.1-1.3x plain)."""
        return k > 0 and not self.costs.seen((rows, k, False, sampled))

    def _no_drafting_measured(self, rows: int, sampled: bool) -> bool:
        """No drafting K ran in a real step of this bucket: every drafting cost is warmup's (see
        :meth:`_unmeasured`). A prefill's vote to detach waits on one real drafting step, not on its own best K:
        the other drafting kinds are then scaled like it, and its best K need not be the decoding steps' (eagle3,
        batch 32, greedy: new requests' best was K = 1, the draining rows' K = 2, so only K = 2 was ever
        measured, and every prefill ran attached, 0.91x plain)."""
        return not any(self.costs.seen((rows, k, False, sampled)) for k in range(1, self.k_max + 1))

    def _explore(self, rows: int, k: int, cap_row: list[int], plan: RowCaps, gains: list[float]) -> int:
        """``k``, or a neighbouring drafting K whose cost was not measured in a real step for ``cost_max_age``
        steps of the bucket: warmup's all-padding steps time each kind only roughly, and without real measurements
        of its neighbours the chosen K could never be found wrong (a neighbour costs about what ``k`` costs, and its
        drafts are verified as exactly). Once measured in ``RELATION_MIN_STEPS`` real steps, only while its expected
        tokens per second (``plan``'s rows drafting up to ``cap_row``, ``gains`` [K_max + 1]) are within
        ``explore_margin`` of ``k``'s. Unless several rows' drafts come from a host lookup, the neighbour runs two
        steps (:attr:`Decision.hold`): the first runs cold, the second is what the kind costs in a run."""
        max_age, sampled = self.config.cost_max_age, plan.sampled
        if max_age:
            n = len(plan.request_ids) if plan.remaining is None else 1  # (tokens a plain step commits, as counted)
            rate = (n + gains[k]) / self.costs.estimate(rows, k, False, sampled)
            for kk in (k + 1, k - 1):
                key = (rows, kk, False, sampled)
                if (1 <= kk <= self.k_max and self.costs.age(key) >= max_age
                        and any(c > min(k, kk) for c in cap_row)  # some row's cap differs at kk
                        and (self.costs.measurements(key) < RELATION_MIN_STEPS
                             or (n + gains[kk]) / self.costs.estimate(rows, kk, False, sampled)
                             >= (1.0 - self.config.explore_margin) * rate)):
                    return kk
        return k

    def _gains(self, reach: list[list[float]], cap_row: list[int],
               remaining: list[int] | None = None) -> list[float]:
        """Gains [K_max + 1] of a step of K drafts (each row drafting up to ``cap_row``): NaN where no row drafts,
        else the expected accepted drafts summed over rows, or with ``remaining`` (a draining batch) how many
        tokens they take off the drain beyond a plain step's one (:func:`~specjax.spec_decode.drain.drain_gains`).
        """
        if remaining is not None:
            return drain_gains(reach, cap_row, remaining, self.k_max)
        if not any(cap_row):  # a row drafts at some K >= 1 exactly when its cap is > 0 (and a plain step gains 0)
            return [0.0] + [math.nan] * self.k_max
        return expected_accepted_sums(reach, cap_row, self.k_max)

    def _best_drafting(self, rows: int, n: float, gains: list[float], sampled: bool) -> tuple[int, float]:
        """The K >= 1 with the most expected tokens per second for ``n`` rows and that rate; (0, 0) when no
        row drafts."""
        best_k, best_rate = 0, 0.0
        for k, gain in enumerate(gains[1:], start=1):
            if math.isnan(gain):
                continue
            rate = (n + gain) / self.costs.estimate(rows, k, False, sampled)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def _plan_rates(self, rows: int, plan: RowCaps, gains: list[float]) -> tuple[int, float, float, float]:
        """:meth:`_rates` of ``plan``'s rows: tokens per step count every row; draining, the last row's (its
        bonus token and what the drafts take off the drain, see :meth:`_gains`)."""
        return self._rates(rows, len(plan.request_ids) if plan.remaining is None else 1, gains, plan.sampled)

    def _rates(self, rows: int, n: float, gains: list[float], sampled: bool) -> tuple[int, float, float, float]:
        """(best drafting K, its tokens per second, tokens per second of an attached and of a detached step
        without drafts (0 where the proposer cannot detach))."""
        draft_k, draft_rate = self._best_drafting(rows, n, gains, sampled)
        return (draft_k, draft_rate, *self._plain_rates(rows, n, sampled))

    @staticmethod
    def _detach_wins(draft_rate: float, attached_rate: float, detached_rate: float) -> bool:
        """The target alone beats both attached choices outright. Detaching cannot be undone for the rows in
        the step, so it needs no margin-sized doubt: drafting short of the ``min_speedup`` margin but above the
        target alone keeps drafting (hysteresis; the per-request estimate dips and recovers)."""
        return detached_rate > max(attached_rate, draft_rate)

    def _detach_sure(self, rows: int, plan: RowCaps, cap_row: list[int]) -> bool:
        """The target alone also beats both attached choices with each row's acceptance taken no lower than the
        method's unless the row's own drafts put it below with confidence (``detach_z``): detaching cannot be
        undone, and a request's estimate from a few sampled drafts dips by chance."""
        row_sampled = plan.row_sampled or [plan.sampled] * len(plan.request_ids)
        reach = [self.estimates.detach_reach(rid, smp) for rid, smp in zip(plan.request_ids, row_sampled)]
        if reach == plan.reach:
            return True
        _, draft_rate, attached_rate, detached_rate = self._plan_rates(rows, plan,
                                                                       self._gains(reach, cap_row, plan.remaining))
        return self._detach_wins(draft_rate, attached_rate, detached_rate)

    def _plain_rates(self, rows: int, n: float, sampled: bool) -> tuple[float, float]:
        """Tokens per second of an attached and of a detached step without drafts (0 where the proposer
        cannot detach)."""
        attached = n / self.costs.estimate(rows, 0, False, sampled)
        return attached, (n / self.costs.estimate(rows, 0, True, sampled) if self.can_detach else 0.0)

    def prefers_plain(self, rows: int, plan: RowCaps, num_rows: int) -> bool:
        """Would ``num_rows`` rows like ``plan``'s (requests about to be prefilled) decode faster with the
        target alone in steps of ``rows``? Then their prefill runs detached and the proposer never sees them.

        The same rates and margin as :meth:`decide`, with each row's gains scaled to ``num_rows`` rows; where the
        batch will drain (``plan.remaining``: no request waits beyond these), the drain's gains of ``num_rows``
        rows like these (each standing for ``num_rows / len(plan.request_ids)`` of them), as its decoding steps
        will count them (else a prefill would wait on a drafting K those steps never choose to measure).
        """
        n = len(plan.request_ids)
        if not self.can_detach or not n or self._learning_k(rows, num_rows, plan.caps, plan.sampled,
                                                            scale=num_rows / n):
            return False
        if plan.remaining is None:
            gains, tokens = [g * (num_rows / n) for g in self._gains(plan.reach, plan.caps)], num_rows
        else:
            like = [i % n for i in range(max(num_rows, n))]
            gains = self._gains([plan.reach[i] for i in like], [plan.caps[i] for i in like],
                                [plan.remaining[i] for i in like])
            tokens = 1
        draft_k, draft_rate, attached_rate, detached_rate = self._rates(rows, tokens, gains, plan.sampled)
        # Attached only where drafting pays as decide() starts it, by the margin: an attached prefill costs the
        # proposer's pass over the prompt (and a head's drafts ahead), and once attached, the decoding steps
        # keep drafting until the target alone wins outright (eagle3 at batch 8 greedy on the shipped pair,
        # K = 2 estimated as fast as the target alone: loads prefilled attached drafted and took 1.17x the time of
        # those prefilled detached).
        pays = draft_k and draft_rate >= self.config.min_speedup * max(attached_rate, detached_rate)
        # A measured prior may detach on warmup's costs: its acceptance is known, and the first prefill of a
        # short job is most of it (SmolLM2 with its EAGLE-3 head, the README's first command: attached, the
        # drafting steps of the vote cost 1.5x a plain step each).
        unmeasured = not self.estimates.primed[plan.sampled] and self._no_drafting_measured(rows, plan.sampled)
        if pays or not detached_rate or (draft_k and unmeasured):
            return False
        # Exploring costs the whole batch (its steps run attached until the vote detaches again): once per
        # explore_every batches' worth of requests.
        period = self.config.explore_every * max(1, num_rows)
        before = self._detached_prefill_votes
        self._detached_prefill_votes += n
        if period and self._detached_prefill_votes // period > before // period:
            for rid in plan.request_ids:  # a probe is due at their first decoding step (see row_caps)
                self._idle_steps[rid] = 1 << 30
            return False
        return True

    def _learning_k(self, rows: int, n: float, caps: list[int], sampled: bool, scale: float = 1.0, *,
                    ids: list[str] | None = None) -> int:
        """While learning: the K with the most tokens per second if the acceptance were at its optimistic bound
        (``gains * scale``: rows standing for ``n``), when that beats a step without drafts; else 0 (1 while
        fewer than ``learn_requests`` requests taught the bound if a row, of ``ids`` or new ones (None), had
        fewer than LEARN_DRAFTS_PER_REQUEST drafts verified). Choosing
        K at the bound, not at the estimate, also teaches the deeper positions: at the estimate a new method
        settled on K = 2 and its positions 3-4 stayed at the prior (9 and 2 drafts verified there)."""
        if not self.estimates.learning(sampled):
            return 0
        reach = self.estimates.optimistic_reach(sampled)
        gains = self._gains([reach] * len(caps), caps)
        k, rate = self._best_drafting(rows, n, [g * scale for g in gains], sampled)
        if rate > max(self._plain_rates(rows, n, sampled)):
            return k
        # Learning would end on cost: not before K = 1, the cheapest drafting step, ran in a real step of the
        # bucket (warmup timed it on all-padding rows; ngram at batch 1, T 0.8 ended learning after its first 7
        # sampled drafts, all at K = 4, with K = 1 estimated 1.39x a plain step, while fixed K = 1 ran 1.08x plain).
        few = len(self.estimates.learned_from[sampled]) < self.config.learn_requests and (ids is None or any(
            (s := self.estimates.requests.get(rid)) is None or s.tried[0] < LEARN_DRAFTS_PER_REQUEST for rid in ids))
        return 1 if k and (few or self._unmeasured(rows, 1, sampled)) else 0

    _PLAN_STATE = ("_held_steps", "_detach_votes", "_last_rates", "_held_ids", "_held_plans", "_draft_held",
                   "_draft_holds", "_miss_holds", "_held_idle",
                   "num_detached_steps")  # (each reassigned, never changed in place)

    def plan_state(self, request_ids: list[str]) -> tuple:
        """What :meth:`row_caps` and :meth:`decide` for ``request_ids`` change, for :meth:`restore_plan_state`."""
        rows = {rid: (self._idle_steps.get(rid), self._probe_wait.get(rid))
                for rid in (*request_ids, *self._held_idle)}
        return [getattr(self, name) for name in self._PLAN_STATE], list(self.k_histogram), rows

    def restore_plan_state(self, state: tuple) -> None:
        """Undo a plan made ahead of its step that did not run (its rows changed): as if never made. Requests
        finished since stay gone."""
        values, self.k_histogram, rows = state
        for name, value in zip(self._PLAN_STATE, values):
            setattr(self, name, value)
        for rid, before in rows.items():
            if rid in self._idle_steps:  # (decide counts every row; finish() drops it)
                for table, value in zip((self._idle_steps, self._probe_wait), before):
                    if value is None:
                        table.pop(rid, None)
                    else:
                        table[rid] = value

    def count_step(self, k: int, detached: bool) -> None:
        """Count a decoding step's K (also for steps planned without :meth:`decide`)."""
        self.k_histogram[k] += 1
        self.num_detached_steps += int(detached)

    def as_dict(self) -> dict:
        """Metrics: how often each K was chosen for a decoding step, and the share of plain ones."""
        steps = sum(self.k_histogram)
        return {
            "k_histogram": list(self.k_histogram),
            "plain_step_share": float(self.k_histogram[0] / steps) if steps else 0.0,
            "num_detached_steps": self.num_detached_steps,
            "num_detached_prefills": self.num_detached_prefills,
            "prior_strength": {"greedy": self.estimates.strength[False],
                               "sampled": self.estimates.strength[True]},
            "acceptance_prior": {"greedy": self.estimates.primed[False], "sampled": self.estimates.primed[True]},
        }
