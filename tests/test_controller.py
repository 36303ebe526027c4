"""The adaptive speculation-length controller: decisions on fake costs and acceptance, then in the engine."""

import collections
import copy
import math

import jax
import numpy as np
import pytest

import specjax
from specjax.buckets import count_compiles
from specjax.spec_decode.controller import LEARN_DRAFTS_PER_REQUEST, ControllerConfig, SpeculationController
from specjax.engine import WARMUP_ROUNDS, WARMUP_STEPS_PER_KIND
from specjax.spec_decode.costs import FIRST_CLIP, RELATION_MIN_STEPS
from specjax.spec_decode.plan import RowCaps
from tiny_models import make_tiny_checkpoint

K = 4


def _controller(costs: dict, *, can_detach=False, **cfg) -> SpeculationController:
    # These tests teach the method through one request (_teach): learning counts its drafts alone, unless a test
    # asks otherwise (the rule for several requests has its own tests).
    c = SpeculationController(K, ControllerConfig(**{"learn_requests": 1, **cfg}), can_detach=can_detach)
    for key, seconds in costs.items():  # (rows, K, detached): the same for greedy and sampled steps
        for sampled in (False, True):
            c.costs.observe((*key, sampled), seconds)
    return c


def _decide(c: SpeculationController, rows: int, ids: list[str], sampled: list[bool], limits, can_draft):
    return c.decide(rows, c.row_caps(ids, sampled, np.asarray(limits), np.asarray(can_draft)),
                    can_draft=np.asarray(can_draft))


def _teach(c: SpeculationController, request_id: str, rate: float, n: int = 400, sampled: bool = False) -> None:
    """Feed ``n`` verifications of K drafts with per-position acceptance ``rate`` (deterministic pattern)."""
    rng = np.random.default_rng(0)
    for _ in range(n):
        accepted = 0
        while accepted < K and rng.random() < rate:
            accepted += 1
        c.observe(request_id, sampled, K, accepted)


FLAT = {(1, k, False): 1.0 + 0.1 * k for k in range(K + 1)} | {(1, 0, True): 1.0}


def test_expected_accepted_is_the_sum_of_prefix_products():
    alpha = np.asarray([0.5, 0.5, 1.0, 0.0])
    np.testing.assert_allclose(SpeculationController.expected_accepted(alpha), [0, 0.5, 0.75, 1.0, 1.0])


def test_chooses_the_maximum_when_every_draft_is_accepted():
    c = _controller(FLAT)
    _teach(c, "a", 1.0)
    d = _decide(c, 1, ["a"], [False], [K], [True])
    assert d.k == K and d.caps.tolist() == [K] and not d.detached


def test_chooses_plain_when_verify_costs_more_than_drafts_gain():
    # A drafting step costs 3x a plain one; acceptance 0.3 per position gains < 0.45 tokens: plain wins.
    costs = {(1, k, False): 3.0 for k in range(1, K + 1)} | {(1, 0, False): 1.0, (1, 0, True): 1.0}
    c = _controller(costs)
    _teach(c, "a", 0.3)
    d = _decide(c, 1, ["a"], [False], [K], [True])
    assert d.k == 0 and d.caps.tolist() == [0]


def test_caps_a_row_whose_drafts_always_fail_while_others_speculate():
    c = _controller({(2, k, False): 1.0 + 0.05 * k for k in range(K + 1)})
    _teach(c, "good", 0.9)
    _teach(c, "bad", 0.0)
    d = _decide(c, 2, ["good", "bad"], [False, False], [K, K], [True, True])
    assert d.k >= 2 and d.caps[0] == d.k and d.caps[1] == 0


def test_greedy_and_sampled_estimates_are_kept_apart():
    c = _controller(FLAT)
    _teach(c, "x", 1.0, sampled=False)
    _teach(c, "y", 0.0, sampled=True)
    assert c.conditional_acceptance("new", False)[0] > 0.9
    assert c.conditional_acceptance("new", True)[0] < 0.1


def test_detaches_only_after_plain_won_several_steps_in_a_row():
    costs = {(1, k, False): 2.0 for k in range(K + 1)} | {(1, 0, True): 1.0}  # attached steps cost 2x
    c = _controller(costs, can_detach=True, detach_after=3)
    _teach(c, "a", 0.1)
    plans = [_decide(c, 1, ["a"], [False], [K], [True]) for _ in range(4)]
    assert [p.detached for p in plans] == [False, False, True, True]
    # A row whose proposer state is already stale loses nothing by detaching: at once.
    c2 = _controller(costs, can_detach=True, detach_after=3)
    assert _decide(c2, 1, ["a"], [False], [0], [False]).detached


def test_while_detaching_is_voted_on_the_steps_draft_rather_than_run_an_attached_plain_step():
    # A head's attached plain step drafts ahead: it costs what K=1 costs (2.0), the target alone 1.0. At
    # acceptance 0.5 drafting (~1.9 tokens per 2.0-2.1 s) loses to the target alone but beats the attached plain
    # step (1 token per 2.0 s): until detaching wins its votes, the steps draft.
    costs = {(1, 0, False): 2.0} | {(1, k, False): 2.0 + 0.025 * k for k in range(1, K + 1)} | {(1, 0, True): 1.0}
    c = _controller(costs, can_detach=True, detach_after=3)
    _teach(c, "a", 0.5)
    plans = [_decide(c, 1, ["a"], [False], [K], [True]) for _ in range(3)]
    assert [p.k > 0 for p in plans] == [True, True, False]
    assert [p.detached for p in plans] == [False, False, True]


def test_drafting_short_of_the_margin_over_the_target_alone_keeps_drafting():
    # Acceptance 0.7: ~2.8 tokens per K=4 step of 2.6 s, 1.07x the target alone (1 token per 1.0 s): below the
    # 1.1x margin that starts drafting, but detaching (irreversible) needs the target alone to win outright.
    costs = {(1, 0, False): 2.0} | {(1, k, False): 2.6 for k in range(1, K + 1)} | {(1, 0, True): 1.0}
    c = _controller(costs, can_detach=True, detach_after=3)
    _teach(c, "a", 0.7)
    plans = [_decide(c, 1, ["a"], [False], [K], [True]) for _ in range(10)]
    assert all(p.k == K and not p.detached for p in plans)
    # New requests are prefilled attached only where drafting pays by the margin, as drafting starts: an attached
    # prefill costs the proposer's pass over the prompt, and its steps would then keep drafting at 1.07x.
    plan = c.row_caps(["new"], [False], np.asarray([K]), np.asarray([True]))
    assert c.prefers_plain(1, plan, 1)
    good = _controller({**costs, **{(1, k, False): 2.3 for k in range(1, K + 1)}}, can_detach=True)
    _teach(good, "a", 0.7)  # ~2.8 tokens per 2.3 s: 1.2x the target alone
    assert not good.prefers_plain(1, good.row_caps(["new"], [False], np.asarray([K]), np.asarray([True])), 1)
    poor = _controller(costs, can_detach=True, detach_after=3)
    _teach(poor, "a", 0.5)  # ~1.9 tokens per 2.6 s: the target alone wins outright
    assert poor.prefers_plain(1, poor.row_caps(["new"], [False], np.asarray([K]), np.asarray([True])), 1)


def test_a_few_failed_drafts_do_not_detach_a_request_while_the_methods_drafts_pay():
    # At the method's acceptance (0.7) a K=4 step of 2.3 s gives ~2.8 tokens, 1.2x the target alone. A new
    # request's first 3 drafts fail: its estimate (~0.4 at position 1) loses to the target alone, but 0 of 3 is
    # no evidence it differs from the method (Wilson upper bound 0.57): detaching waits. After 0 of 12 it is.
    costs = {(1, 0, False): 2.0} | {(1, k, False): 2.3 for k in range(1, K + 1)} | {(1, 0, True): 1.0}

    def fails(z: float, n: int) -> bool:
        c = _controller(costs, can_detach=True, detach_after=3, detach_z=z)
        _teach(c, "a", 0.7)
        for _ in range(n):
            c.observe("b", False, K, 0)
        return any(_decide(c, 1, ["b"], [False], [K], [True]).detached for _ in range(4))

    assert fails(0.0, 3)  # the estimate alone detaches it
    assert not fails(2.0, 3)
    assert fails(2.0, 12)


def _warmup_timed() -> tuple[SpeculationController, RowCaps]:
    """Warmup timed every kind at 1 row; real steps so far only the target alone (2x its warmup time), so
    drafting is estimated at its warmup time x 2; the method's acceptance is 0.1. Also a new request's plan."""
    c = SpeculationController(K, ControllerConfig(detach_after=2, learn_requests=1), can_detach=True)
    for k in range(K + 1):
        c.costs.observe((1, k, False, False), 1.0 + 0.5 * k, warmup=True)
    c.costs.observe((1, 0, True, False), 0.5, warmup=True)
    c.costs.observe((1, 0, True, False), 1.0)
    _teach(c, "a", 0.1)
    return c, c.row_caps(["new"], [False], np.asarray([K]), np.asarray([True]))


def test_detaching_waits_for_a_real_measurement_of_the_drafting_step_it_beats():
    # Drafting loses (acceptance 0.1), but detaching cannot be undone: the vote first runs the drafting K once,
    # and new requests are prefilled attached until then.
    c, new = _warmup_timed()
    assert not c.prefers_plain(1, new, 1)
    cheap = copy.deepcopy(c)
    first = _decide(c, 1, ["a"], [False], [K], [True])
    assert first.k > 0 and not first.detached and first.hold == 0
    c.costs.observe((1, first.k, False, False), c.costs.estimate(1, first.k, False))  # it costs what was guessed
    assert c.prefers_plain(1, new, 1)
    assert _decide(c, 1, ["a"], [False], [K], [True]).detached  # the second vote (detach_after = 2)
    # Measured at a fifth of the guess instead, drafting beats the target alone: no detaching, attached prefills.
    first = _decide(cheap, 1, ["a"], [False], [K], [True])
    cheap.costs.observe((1, first.k, False, False), 0.2 * cheap.costs.estimate(1, first.k, False))
    assert not cheap.prefers_plain(1, new, 1)
    assert not any(_decide(cheap, 1, ["a"], [False], [K], [True]).detached for _ in range(4))


def test_a_prefill_detaches_once_any_drafting_k_of_the_bucket_ran_for_real():
    # At acceptance 0.1 a new request's best drafting K is the cheapest (1), but the decoding steps measured only
    # K = 4 (a draining batch's best can differ): that real measurement scales the other kinds, and the prefill
    # no longer waits on K = 1, which no decoding step would run (else every prefill stays attached).
    c, new = _warmup_timed()
    assert not c.prefers_plain(1, new, 1)
    c.costs.observe((1, K, False, False), c.costs.estimate(1, K, False))
    assert not c.costs.seen((1, 1, False, False)) and c.prefers_plain(1, new, 1)
    assert not c.prefers_plain(2, new, 2)  # per bucket: nothing measured at 2 rows


def test_a_kind_chosen_seldom_keeps_its_relation_to_the_others_as_the_machine_slows():
    """A kind not chosen is priced by what its steps cost next to the steps around them, at the speed the
    chosen kind runs at now, not at what its last step cost in another moment."""
    c = _controller({})
    for k in range(K + 1):  # warmup: K=k costs 1 + 0.25 k
        c.costs.observe((1, k, False, False), 1.0 + 0.25 * k, warmup=True)
    for _ in range(40):  # K=4 chosen: its steps take 2.0 (its warmup time)
        c.costs.observe((1, K, False, False), 2.0)
    c.costs.observe((1, K - 1, False, False), 2.5, switched=True)  # explored: a cold step, then one in a run
    c.costs.observe((1, K - 1, False, False), 1.8)
    c.costs.observe((1, K, False, False), 3.0, switched=True)  # back to K=4: its cold step does not count
    for _ in range(4):
        c.costs.observe((1, K, False, False), 2.0)
    assert c.costs.estimate(1, K - 1, False) == pytest.approx(1.8)
    assert c.costs.estimate(1, K, False) == pytest.approx(2.0)
    for _ in range(40):  # the machine slows down by 30% while K=4 runs
        c.costs.observe((1, K, False, False), 2.6)
    assert c.costs.estimate(1, K, False) == pytest.approx(2.6, rel=0.01)
    assert c.costs.estimate(1, K - 1, False) == pytest.approx(1.8 * 1.3, rel=0.01)
    # Never run for real: warmup's time (1.5) x the measured kinds' real / warmup ratio (their geometric median:
    # 2.0 / 2.0 and 1.8 / 1.75), at today's speed.
    assert c.costs.estimate(1, 2, False) == pytest.approx(1.5 * math.sqrt(1.8 / 1.75) * 1.3, rel=0.01)


def test_an_explored_kind_is_priced_by_the_mean_of_its_explorations():
    c = _controller({})
    for k in range(K + 1):
        c.costs.observe((1, k, False, False), 1.0 + 0.25 * k, warmup=True)
    for seconds in (1.7, 1.9, 1.8):  # three explorations of K=3 between runs of K=4 at 2.0
        for _ in range(16):
            c.costs.observe((1, K, False, False), 2.0)
        c.costs.observe((1, K - 1, False, False), 2.4, switched=True)
        c.costs.observe((1, K - 1, False, False), seconds)
        c.costs.observe((1, K, False, False), 2.0, switched=True)
    assert c.costs.estimate(1, K - 1, False) == pytest.approx((1.7 * 1.9 * 1.8) ** (1 / 3))
    assert c.costs.age((1, K - 1, False, False)) == 1  # (the cold K=4 step after it counts as a step)


def test_a_neighbouring_k_not_measured_in_real_steps_is_tried_once_per_cost_max_age():
    def chosen_ks(rate: float) -> list[int]:
        c = _controller({}, cost_max_age=8)
        for k in range(K + 1):  # warmup only: costs nearly flat, K=4 looks best
            c.costs.observe((1, k, False, False), 1.0 + 0.01 * k, warmup=True)
        _teach(c, "a", rate)
        ks = []
        for _ in range(120):
            ks.append(_decide(c, 1, ["a"], [False], [K], [True]).k)
            c.costs.observe((1, ks[-1], False, False), 1.0 + 0.01 * ks[-1])  # the engine times every step
        return ks

    ks = chosen_ks(1.0)
    assert ks[:12] == [K - 1] + [K] * 8 + [K - 1] + [K] * 2
    # At acceptance 1, K=3's tokens per second are 20% below K=4's, past explore_margin: once RELATION_MIN_STEPS
    # real steps measured it, it is not explored again.
    assert ks.count(K - 1) == RELATION_MIN_STEPS and K - 1 not in ks[-40:] and set(ks) == {K - 1, K}
    ks = chosen_ks(0.5)  # at acceptance 0.5, K=3 is within 3% of K=4: explored on
    assert ks.count(K - 1) == 120 // 9 + 1 and K - 1 in ks[-9:]
    quiet = _controller({}, cost_max_age=0)  # 0: no expiry, no exploration
    for k in range(K + 1):
        quiet.costs.observe((1, k, False, False), 1.0 + 0.01 * k, warmup=True)
    _teach(quiet, "a", 1.0)
    assert {_decide(quiet, 1, ["a"], [False], [K], [True]).k for _ in range(12)} == {K}


def test_a_step_right_after_another_kind_counts_only_until_its_kind_is_timed_in_a_run():
    c = _controller({}, cost_max_age=0)
    key = (1, 3, False, False)
    c.costs.observe(key, 3.0, switched=True)  # explored: its step ran right after a step of another kind
    assert c.costs.estimate(1, 3, False) == pytest.approx(3.0)  # (nothing better known)
    c.costs.observe(key, 2.0)  # its next step, in a run of it: replaces the cold one
    assert c.costs.estimate(1, 3, False) == pytest.approx(2.0)
    for _ in range(2):  # later cold steps of it are not what it costs in a run
        c.costs.observe(key, 9.0, switched=True)
    assert c.costs.estimate(1, 3, False) == pytest.approx(2.0)
    c.costs.observe(key, 2.2)  # (the mean of its steps' logs)
    assert c.costs.estimate(1, 3, False) == pytest.approx(math.sqrt(2.0 * 2.2))
    other = (1, 2, False, False)  # a kind only ever visited for one step is costed by those steps
    for seconds in (4.0, 4.4, 4.8):
        c.costs.observe(other, seconds, switched=True)
    assert c.costs.estimate(1, 2, False) == pytest.approx(math.sqrt(2.0 * 2.2))  # (capped by K=3: more work)
    assert c.costs.seconds[other] == pytest.approx((4.0 * 4.4 * 4.8) ** (1 / 3))


def test_an_explored_neighbour_runs_two_steps_so_the_second_is_timed_in_a_run():
    c = _controller({}, cost_max_age=8)
    for k in range(K + 1):  # warmup only: K=4 looks best, K=3 was never measured in a real step
        c.costs.observe((1, k, False, False), 1.0 + 0.01 * k, warmup=True)
    _teach(c, "a", 1.0)
    explored = _decide(c, 1, ["a"], [False], [K], [True])
    assert explored.k == K - 1 and explored.hold == 1
    c.costs.observe((1, K - 1, False, False), 1.03)
    chosen = _decide(c, 1, ["a"], [False], [K], [True])
    assert chosen.k == K and chosen.hold == ControllerConfig().draft_replan_every - 1
    # One row's host lookup too (its held step verifies what the next lookup finds, up to the explored K): else
    # the explored K ran only cold steps, which do not count once it was timed in a run, and fell due again at
    # every plan (ngram at batch 1 greedy: 40 of 264 plans).
    lookup = _controller({}, cost_max_age=8)
    for k in range(K + 1):
        lookup.costs.observe((1, k, False, False), 1.0 + 0.01 * k, warmup=True)
    _teach(lookup, "a", 1.0)
    wanted = lookup.row_caps(["a"], [False], np.asarray([K]), np.asarray([True]))
    explored = lookup.decide(1, wanted, found=np.asarray([K]))
    assert explored.k == K - 1 and explored.hold == 1 and explored.caps.tolist() == [K - 1]


def test_the_target_alone_is_timed_in_a_shadow_step_only_while_its_cost_is_a_guess_that_could_matter():
    c = _controller({}, can_detach=True, cost_max_age=8)
    for k in range(K + 1):  # warmup: drafting looks 1.2x the target alone at best, which never ran for real
        c.costs.observe((1, k, False, False), 2.0 + 0.5 * k, warmup=True)
    c.costs.observe((1, 0, True, False), 2.0, warmup=True)
    _teach(c, "a", 0.5)
    d = _decide(c, 1, ["a"], [False], [K], [True])
    assert d.k >= 1 and not d.detached and c.shadow_due(1, False)
    assert not c.shadow_due(1, True) and not c.shadow_due(8, False)  # (another bucket than the plan's)
    c.costs.observe((1, 0, True, False), 1.0)  # the shadow step's time: now measured
    c.costs.observe((1, 1, False, False), 2.5)
    _decide(c, 1, ["a"], [False], [K], [True])
    assert not c.shadow_due(1, False)
    for _ in range(14):  # ... until twice cost_max_age steps ran without it (one measurement behind its cost)
        c.costs.observe((1, 1, False, False), 2.5)
        assert not c.shadow_due(1, False)
    c.costs.observe((1, 1, False, False), 2.5)
    assert c.costs.age((1, 0, True, False)) == 16
    d = _decide(c, 1, ["a"], [False], [K], [True])
    assert not d.detached and c.shadow_due(1, False)
    c.costs.observe((1, 0, True, False), 1.0)  # a second one: then four times, at most eight times
    for _ in range(31):
        c.costs.observe((1, 1, False, False), 2.5)
    assert not c.shadow_due(1, False)
    c.costs.observe((1, 1, False, False), 2.5)
    assert c.shadow_due(1, False)
    # Drafting far ahead of the target alone (every draft accepted): no shadow; nor with shadow_band = 0.
    sure = _controller({}, can_detach=True, cost_max_age=8)
    for k in range(K + 1):
        sure.costs.observe((1, k, False, False), 1.0 + 0.01 * k, warmup=True)
    sure.costs.observe((1, 0, True, False), 1.0, warmup=True)
    _teach(sure, "a", 1.0)
    assert _decide(sure, 1, ["a"], [False], [K], [True]).k >= K - 1 and not sure.shadow_due(1, False)
    off = _controller({}, can_detach=True, shadow_band=0.0)
    for k in range(K + 1):
        off.costs.observe((1, k, False, False), 2.0 + 0.5 * k, warmup=True)
    off.costs.observe((1, 0, True, False), 2.0, warmup=True)
    _teach(off, "a", 0.5)
    _decide(off, 1, ["a"], [False], [K], [True])
    assert not off.shadow_due(1, False)


def test_a_chained_proposer_drafts_ahead_only_what_the_next_plan_may_verify():
    def plan(c, ready):  # the row has ``ready`` drafts made ahead; K could have been made
        return c.decide(1, c.row_caps(["a"], [False], np.asarray([ready]), np.asarray([True]), open_limits=[K]))

    # Each K costs more than its drafts gain beyond K = 1 (acceptance 0.8: 1.8 tokens per 1.2 s at K = 1, 2.44 per
    # 2.0 s at K = 2): one draft is verified and one made ahead, and the plan is held.
    steep = _controller({(1, 0, False): 1.0, (1, 1, False): 1.2} | {(1, k, False): float(k) for k in range(2, K + 1)},
                        cost_max_age=0)
    _teach(steep, "a", 0.8)
    d = plan(steep, 1)
    assert (d.k, d.ahead) == (1, 1) and d.hold > 0
    assert plan(steep, K).ahead == 1  # (more were made after a prefill: still one for the next step)
    # Every draft accepted, drafting nearly free: the one draft ready is verified and K are made for the next
    # step; the plan is not held on K = 1.
    flat = _controller(FLAT, cost_max_age=0)
    _teach(flat, "a", 1.0)
    d = plan(flat, 1)
    assert (d.k, d.ahead, d.hold) == (1, K, 0)
    d = plan(flat, K)
    assert (d.k, d.ahead) == (K, K)
    # Without open limits (a proposer that does not draft ahead), ahead is K (or 1).
    assert flat.decide(1, flat.row_caps(["a"], [False], np.asarray([2]), np.asarray([True]))).ahead == 2
    # A neighbour due for exploration (its cost unmeasured in real steps) gets its drafts made first.
    explore = _controller({}, cost_max_age=8)
    for k in range(K + 1):  # at warmup K = 2 looked best; K = 3 never ran in a real step
        explore.costs.observe((1, k, False, False), 1.0 if k <= 2 else 9.0, warmup=True)
    _teach(explore, "a", 1.0)
    for k in (1, 2):
        explore.costs.observe((1, k, False, False), 1.0)
    d = plan(explore, 2)
    assert (d.k, d.ahead) == (2, 3)
    # With those drafts ready K = 3 is explored, for two steps so that the second is timed in a run, also where
    # its own neighbour gets drafts made first (one cold step of an EAGLE-3 head's K = 3 read 2.3-3.0 ms on the
    # shipped pair, a run of them 1.9 ms, and the controller kept to K = 2).
    d = plan(explore, 3)
    assert (d.k, d.ahead, d.hold) == (3, K, 1)


def test_while_learning_k_is_chosen_at_the_optimistic_acceptance_so_deeper_positions_are_taught():
    # Costs rise 0.3 per K: at the prior (0.6 per position) K = 1 is best, and K = 2..4 would never be tried.
    costs = {(1, k, False): 1.0 + 0.3 * k for k in range(K + 1)}
    c = _controller(costs)
    at_prior = c._rates(1, 1, c._gains(c.row_caps(["a"], [False], np.asarray([K]), np.asarray([True])).reach,
                                       np.asarray([K])), False)[0]
    assert at_prior == 1
    # Nothing verified: the bound is 1.
    assert c.estimates.learning(False) and _decide(c, 1, ["a"], [False], [K], [True]).k == K
    _teach(c, "a", 1.0, n=40)  # learned (40 > learn_drafts): every draft was accepted, K = 4 pays on its own
    assert not c.estimates.learning(False) and _decide(c, 1, ["a"], [False], [K], [True]).k == K


def test_every_explore_every_th_detached_prefill_runs_attached_and_probes_before_detaching():
    # The target alone wins (1.0 s a token against 2.0 attached, drafting 2.5 at acceptance 0.1): new requests
    # are prefilled detached, and so would never draft again; every 4th is prefilled attached instead and
    # probes one draft in its first decoding step, although detaching has won its vote (detach_after = 1).
    costs = {(1, 0, False): 2.0} | {(1, k, False): 2.5 for k in range(1, K + 1)} | {(1, 0, True): 1.0}
    c = _controller(costs, can_detach=True, detach_after=1, explore_every=4)
    _teach(c, "a", 0.1)

    def prefill(controller, rid):
        return controller.prefers_plain(1, controller.row_caps([rid], [False], np.asarray([K]), np.asarray([True])), 1)

    assert [prefill(c, f"r{i}") for i in range(8)] == [True, True, True, False] * 2
    first = _decide(c, 1, ["r3"], [False], [K], [True])
    assert first.k == 1 and first.caps.tolist() == [1] and not first.detached
    c.observe("r3", False, 1, 0)
    assert _decide(c, 1, ["r3"], [False], [K], [True]).detached  # then it detaches, as the vote said
    # At batch 8 (steps of 8 rows, here one request per prefill), one per 4 x 8 requests: a probe costs every row.
    wide = _controller({(8, *key[1:]): v for key, v in costs.items()}, can_detach=True, detach_after=1,
                       explore_every=4)
    _teach(wide, "a", 0.1)
    explored = [not wide.prefers_plain(8, wide.row_caps([f"w{i}"], [False], np.asarray([K]), np.asarray([True])), 8)
                for i in range(64)]
    assert [i for i, e in enumerate(explored) if e] == [31, 63]
    never = _controller(costs, can_detach=True, detach_after=1, explore_every=0)
    _teach(never, "a", 0.1)
    assert all(prefill(never, f"r{i}") for i in range(20))
    with pytest.raises(ValueError, match="explore_every"):
        ControllerConfig(explore_every=-1)


def test_probe_after_idle_steps():
    costs = {(1, k, False): 3.0 for k in range(1, K + 1)} | {(1, 0, False): 1.0}
    c = _controller(costs, probe_every=5)
    _teach(c, "a", 0.05)
    ks = [_decide(c, 1, ["a"], [False], [K], [True]).k for _ in range(6)]
    assert ks[:5] == [0] * 5 and ks[5] == 1


def test_probe_waits_double_after_each_probe_of_a_request():
    costs = {(1, k, False): 3.0 for k in range(1, K + 1)} | {(1, 0, False): 1.0}
    c = _controller(costs, probe_every=4)
    _teach(c, "a", 0.05)
    ks = [_decide(c, 1, ["a"], [False], [K], [True]).k for _ in range(4 + 1 + 8 + 1 + 16 + 1)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes == [4, 4 + 1 + 8, 4 + 1 + 8 + 1 + 16]


def _run_steps(c: SpeculationController, steps: int) -> tuple[list[int], int]:
    """Decoding steps of one row "a" as the engine runs them: a held plan serves ``Decision.hold`` steps
    without planning. (K per step, number of plans.)"""
    ks, plans, held = [], 0, 0
    while len(ks) < steps:
        if held:
            held -= 1
            c.held_step()
            ks.append(0)
            continue
        d = _decide(c, 1, ["a"], [False], [K], [True])
        plans += 1
        ks.append(d.k)
        held = d.hold
    return ks, plans


def test_a_plan_without_drafts_is_held_and_probes_still_fall_due_on_time():
    costs = {(1, k, False): 3.0 for k in range(1, K + 1)} | {(1, 0, False): 1.0}
    runs = {}
    for replan_every in (0, 4):
        c = _controller(costs, probe_every=5, replan_every=replan_every)
        _teach(c, "a", 0.05)
        runs[replan_every] = (*_run_steps(c, 20), sum(c.k_histogram))
    every, plans_every, _ = runs[0]
    held, plans_held, counted = runs[4]
    assert [i for i, k in enumerate(every) if k] == [5, 16]  # probes after 5 idle steps, then after 10
    assert held == every and counted == 20  # the same steps, every one counted
    assert plans_every == 20 and plans_held < 12


def test_a_row_due_a_probe_that_found_no_draft_does_not_end_holds():
    """A host proposer's lookup found nothing for the due row: it tries again at the next plan."""
    costs = {(1, k, False): 3.0 for k in range(1, K + 1)} | {(1, 0, False): 1.0}
    c = _controller(costs, probe_every=2, replan_every=4)
    _teach(c, "a", 0.05)
    holds = []
    for _ in range(4):
        plan = c.row_caps(["a"], [False], np.asarray([K]), np.asarray([True]))
        d = c.decide(1, plan, found=np.asarray([0]))
        holds.append((bool(plan.probing[0]), d.k, d.hold))
    # The second held plan in a row for the same rows holds twice as long (replan_every doubles).
    assert holds == [(False, 0, 1), (False, 0, 0), (True, 0, 3), (True, 0, 7)]


def test_holds_double_for_the_same_rows_up_to_8x_and_start_over_when_rows_change_or_a_plan_drafts():
    costs = {(1, k, False): 3.0 for k in range(1, K + 1)} | {(1, 0, False): 1.0}
    c = _controller(costs, probe_every=0, replan_every=4)
    _teach(c, "a", 0.05)
    _teach(c, "b", 0.3)  # pays only if drafting costs what a plain step costs
    holds = [_decide(c, 1, ["a"], [False], [K], [True]).hold for _ in range(6)]
    assert holds == [3, 7, 15, 31, 31, 31]
    assert _decide(c, 1, ["b"], [False], [K], [True]).hold == 3  # other rows: from replan_every again
    assert _decide(c, 1, ["b"], [False], [K], [True]).hold == 7
    for k in range(1, K + 1):  # drafting gets as cheap as a plain step: the next plan drafts ...
        c.costs.set((1, k, False, False), 1.0)
    assert _decide(c, 1, ["b"], [False], [K], [True]).k > 0
    for k in range(1, K + 1):  # ... and the run of holds after it starts over
        c.costs.set((1, k, False, False), 3.0)
    assert [_decide(c, 1, ["b"], [False], [K], [True]).hold for _ in range(2)] == [3, 7]


def test_a_drafting_decision_repeated_holds_twice_as_long_up_to_4x_also_for_the_next_request():
    c = _controller(FLAT, probe_every=0, draft_replan_every=4)
    _teach(c, "a", 0.9)
    _teach(c, "b", 0.9)
    first = _decide(c, 1, ["a"], [False], [K], [True])
    assert first.k == K and first.hold == 3
    holds = [_decide(c, 1, ["a"], [False], [K], [True]).hold for _ in range(2)]
    assert holds == [7, 15]
    # The next request at batch 1 whose plan makes the same decision keeps the hold's length (a plan every 16
    # steps, not 4, 8, 16 again for each request).
    assert [_decide(c, 1, ["b"], [False], [K], [True]).hold for _ in range(2)] == [15, 15]
    # Another decision (a lower cap: the row can commit only 2 more tokens) starts over, and so does the one after it.
    capped = _decide(c, 1, ["b"], [False], [2], [True])
    assert capped.k == 2 and capped.hold == 3
    assert _decide(c, 1, ["a"], [False], [K], [True]).hold == 3
    # 0 or 1: plan every step, however often the decision repeats.
    for every in (0, 1):
        c = _controller(FLAT, probe_every=0, draft_replan_every=every)
        _teach(c, "a", 0.9)
        assert [_decide(c, 1, ["a"], [False], [K], [True]).hold for _ in range(4)] == [0, 0, 0, 0]


def test_a_restored_plan_state_undoes_a_plan_made_ahead_as_if_never_made():
    c = _controller(FLAT, probe_every=0, draft_replan_every=4)
    _teach(c, "a", 0.9)
    assert _decide(c, 1, ["a"], [False], [K], [True]).hold == 3
    state, histogram = c.plan_state(["a"]), list(c.k_histogram)
    assert _decide(c, 1, ["a"], [False], [K], [True]).hold == 7  # made ahead: the decision repeats, its hold doubles
    c.restore_plan_state(state)
    assert c.k_histogram == histogram
    assert _decide(c, 1, ["a"], [False], [K], [True]).hold == 7  # (15 had the plan made ahead counted)
    # A request new in the undone plan leaves nothing behind, and neither does one that finished meanwhile.
    state = c.plan_state(["a", "b"])
    _decide(c, 2, ["a", "b"], [False, False], [K, K], [True, True])
    c.finish("a")
    c.restore_plan_state(state)
    assert "a" not in c._idle_steps and "b" not in c._idle_steps and "b" not in c._probe_wait


def test_where_only_lookup_misses_keep_steps_plain_a_plan_is_held_once_lookups_seldom_hit():
    c = _controller({(2, k, False): 1.0 + 0.1 * k for k in range(K + 1)}, replan_every=4, min_lookup_hits=0.1)
    _teach(c, "a", 0.9)
    _teach(c, "b", 0.9)
    plan = lambda: c.row_caps(["a", "b"], [False] * 2, np.asarray([K, K]), np.asarray([True] * 2))  # noqa: E731
    holds = [c.decide(2, plan(), found=np.asarray([0, 0])).hold for _ in range(40)]
    # Hit rate 15/16 per miss: at or above 0.1 for the first 35 misses (the next lookup may hit), then held.
    assert holds[:35] == [0] * 35 and holds[35:] == [3] * 5
    assert c.decide(2, plan(), found=np.asarray([K, K])).k > 0  # drafts found: they pay
    assert c.decide(2, plan(), found=np.asarray([0, 0])).hold == 0  # a hit: lookups run every step again


def test_lookup_miss_holds_double_while_planning_costs_more_than_max_planning_share_of_a_plain_step():
    def holds(planning_seconds):
        c = _controller({(2, k, False): 1.0 + 0.1 * k for k in range(K + 1)}, replan_every=4, min_lookup_hits=0.1,
                        probe_every=0)
        c.costs.observe_planning((2, False), planning_seconds)  # per attached step, against a 1 s plain step
        _teach(c, "a", 0.9)
        _teach(c, "b", 0.9)
        plan = lambda: c.row_caps(["a", "b"], [False] * 2, np.asarray([K, K]), np.asarray([True] * 2))  # noqa: E731
        return [c.decide(2, plan(), found=np.asarray([0, 0])).hold for _ in range(40)][35:]

    assert holds(0.005) == [3] * 5  # planning 0.5% of a plain step: held replan_every steps
    assert holds(0.05) == [3, 7, 15, 31, 31]  # 5%: twice as long for each such plan in a row, up to 8x


def test_holds_for_lookups_that_seldom_hit_carry_over_to_new_requests_and_outlast_due_probes():
    """Once the method's lookups seldom find drafts, each such plan in a row holds twice as long (planning being
    dear), whichever requests it plans for, and a probe falling due does not end the hold (it would be one more
    lookup): ngram at batch 1, T 0.8 had planned ~3 times per 64-token request, ~1.15 after."""
    c = _controller({(2, k, False): 1.0 + 0.1 * k for k in range(K + 1)}, replan_every=4, min_lookup_hits=0.1,
                    probe_every=8)
    c.costs.observe_planning((2, False), 0.05)  # planning 5% of a 1 s plain step: dear
    for rid in "abcd":
        _teach(c, rid, 0.9)

    def miss(ids):
        return c.decide(2, c.row_caps(ids, [False] * 2, np.asarray([K, K]), np.asarray([True] * 2)),
                        found=np.asarray([0, 0]))

    assert [miss(["a", "b"]).hold for _ in range(35)] == [0] * 35  # (lookups do not seldom hit yet)
    holds = [miss(ids).hold for ids in (["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"], ["c", "d"])]
    assert holds == [3, 7, 15, 31, 31]  # 4, 8, 16, 32 steps (up to 8x), across requests and past probe_every
    assert c.decide(2, c.row_caps(["c", "d"], [False] * 2, np.asarray([K, K]), np.asarray([True] * 2)),
                    found=np.asarray([K, K])).k > 0  # drafts found: they pay
    assert miss(["c", "d"]).hold == 0  # after a hit, lookups run every step again


def test_one_row_whose_lookup_found_nothing_holds_the_plan_a_hit_would_have_made():
    """A miss's held plan is the decision a hit makes, so plans in a row making it hold twice as long each time
    (draft_replan_every), hits and misses alike (ngram at batch 1 greedy had planned before 38% of its steps)."""
    c = _controller(FLAT, probe_every=0, draft_replan_every=4)
    _teach(c, "a", 0.9)

    def wanted():
        return c.row_caps(["a"], [False], np.asarray([K]), np.asarray([True]))

    miss = c.decide(1, wanted(), found=np.asarray([0]))
    assert miss.k == 0 and miss.caps.tolist() == [0]  # this step: nothing to verify
    hit = c.decide(1, wanted(), found=np.asarray([K]))
    assert hit.held[0] == hit.k and miss.held[0] == hit.k and miss.held[1].tolist() == hit.caps.tolist()
    assert (miss.hold, hit.hold) == (3, 7)
    # A short hit verifies its one draft now; the held steps may verify as many as a full hit's.
    short = c.decide(1, wanted(), found=np.asarray([1]))
    assert short.k == 1 and short.caps.tolist() == [1]
    assert short.hold == 15 and short.held[0] == hit.k and short.held[1].tolist() == hit.caps.tolist()
    assert c.decide(1, wanted(), found=np.asarray([0])).hold == 15  # (up to 4x)
    other = c.decide(1, c.row_caps(["b"], [False], np.asarray([K]), np.asarray([True])), found=np.asarray([0]))
    assert other.hold == 15 and other.held[0] == hit.k  # the next request making the same decision: as long


def test_no_plan_is_held_while_detaching_is_voted_on():
    costs = {(1, k, False): 3.0 for k in range(K + 1)} | {(1, 0, True): 1.0}
    c = _controller(costs, can_detach=True, detach_after=3, replan_every=8)
    _teach(c, "a", 0.05)
    decisions = [_decide(c, 1, ["a"], [False], [K], [True]) for _ in range(4)]
    assert [(d.k, d.detached, d.hold) for d in decisions] == [(0, False, 0)] * 2 + [(0, True, 0)] * 2


def test_one_slow_step_moves_a_cost_little():
    c = _controller({})
    for seconds in (1.0, 1.1, 0.9, 30.0, 1.0):  # a GC pause or another process in the middle
        c.costs.observe((1, 0, True, False), seconds)
    # Its log residual counts at most RESIDUAL_CLIP, at weight 1/4 (its fourth step): 5% at most.
    assert c.costs.get((1, 0, True, False)) == pytest.approx(1.0, rel=0.06)
    for _ in range(40):  # a lasting change is followed
        c.costs.observe((1, 0, True, False), 3.0)
    assert c.costs.get((1, 0, True, False)) == pytest.approx(3.0, rel=0.01)


def test_kinds_seen_only_at_warmup_scale_with_the_real_steps_of_their_bucket():
    c = _controller({})
    for k, seconds in ((0, 1.0), (1, 1.5), (2, 2.0)):  # all-padding warmup steps
        c.costs.observe((8, k, False, False), seconds, warmup=True)
    c.costs.observe((8, 0, True, False), 0.8, warmup=True)
    assert c.costs.estimate(8, 1, False) == pytest.approx(1.5)
    for _ in range(3):  # real detached steps run 2x their warmup time (real rows read real KV blocks)
        c.costs.observe((8, 0, True, False), 1.6)
    assert c.costs.estimate(8, 0, True) == pytest.approx(1.6)
    assert c.costs.estimate(8, 1, False) == pytest.approx(3.0) and c.costs.estimate(8, 2, False) == pytest.approx(4.0)
    assert c.costs.estimate(8, 1, False, True) == 1.25  # another bucket (sampled): nothing measured, a guess


def test_a_kinds_first_step_in_a_slow_moment_prices_it_at_most_first_clip_above_its_prior():
    """A kind chosen seldom is measured in few steps, and one slow one must not keep it from being chosen (eagle3
    on the shipped pair, batch 1, T 0.8: K = 3 read 2.22 ms from its one step in a run, as dear as K = 4, where a
    run of it costs ~1.8)."""
    c = _controller({})
    for k in range(K + 1):  # warmup: K=k costs 1 + 0.25 k, the target alone 1.0
        c.costs.observe((1, k, False, False), 1.0 + 0.25 * k, warmup=True)
    c.costs.observe((1, 0, True, False), 1.0, warmup=True)
    for _ in range(RELATION_MIN_STEPS):  # real K=2 and detached steps run 1.2x their warmup time
        c.costs.observe((1, 2, False, False), 1.8)
        c.costs.observe((1, 0, True, False), 1.2)
    c.costs.observe((1, 3, False, False), 4.0)  # one K=3 step, in a slow moment: 1.9x its prior 1.75 x 1.2
    assert c.costs.seconds[1, 3, False, False] == pytest.approx(1.75 * 1.2 * math.exp(FIRST_CLIP))
    assert c.costs.estimate(1, 3, False) == pytest.approx(2.0 * 1.2)  # (capped by K=4, which does more work)
    for _ in range(16):  # chosen again: its steps in a run bring it to what they cost
        c.costs.observe((1, 3, False, False), 2.3)
    assert c.costs.estimate(1, 3, False) == pytest.approx(2.3, rel=0.02)


def test_host_time_between_steps_is_added_to_every_kind():
    c = _controller({(1, 0, True): 1.0, (1, 0, False): 1.05, (1, 2, False): 1.1})
    for seconds in (0.1, 0.2, 5.0):  # the median: one long gap (a call's first step) does not count
        c.costs.observe_overhead((1, False), seconds)
    assert c.costs.overhead(1) == pytest.approx(0.2)
    assert c.costs.estimate(1, 0, True) == pytest.approx(1.2)
    assert c.costs.estimate(1, 2, False) == pytest.approx(1.3)
    assert c.costs.estimate(1, 2, False, True) == pytest.approx(1.1)  # sampled steps: none measured
    c.costs.observe_overhead((1, False), 0.3)
    assert c.costs.overhead(1) == pytest.approx(0.25)


def test_planning_time_is_added_to_attached_kinds_only():
    c = _controller({(1, 0, True): 1.0, (1, 0, False): 1.05, (1, 2, False): 1.1})
    for seconds in (0.1, 0.3):  # a full plan, then a held one: the mean per attached step counts
        c.costs.observe_planning((1, False), seconds)
    assert c.costs.estimate(1, 0, True) == 1.0  # detached steps of stale rows plan nothing
    assert c.costs.estimate(1, 0, False) == pytest.approx(1.25)
    assert c.costs.estimate(1, 2, False) == pytest.approx(1.3)
    assert c.costs.estimate(1, 2, False, True) == pytest.approx(1.1)  # sampled steps: none measured


def test_a_kind_is_never_estimated_above_one_that_does_more_work():
    # Detached plain measured badly once (5.0) and never chosen again; attached K=0 and K=2 measured cheaper.
    c = _controller({(1, 0, True): 5.0, (1, 0, False): 2.0, (1, 1, False): 4.0, (1, 2, False): 3.0})
    assert c.costs.estimate(1, 0, True) == pytest.approx(2.0)
    assert c.costs.estimate(1, 1, False) == pytest.approx(3.0)
    assert c.costs.estimate(1, 2, False) == pytest.approx(3.0) and c.costs.estimate(1, 0, False) == pytest.approx(2.0)


def test_drafting_must_promise_min_speedup_over_plain():
    for k1_cost, drafts in ((1.9, False), (1.7, True)):  # every draft accepted: 2 tokens per K=1 step
        costs = {(1, 0, False): 1.0, (1, 1, False): k1_cost} | {(1, k, False): 10.0 for k in range(2, K + 1)}
        c = _controller(costs)
        _teach(c, "a", 1.0)
        assert _decide(c, 1, ["a"], [False], [K], [True]).k == (1 if drafts else 0), k1_cost


def test_sampled_steps_are_costed_apart_from_greedy_ones():
    c = _controller({})
    for sampled, k1_cost in ((False, 1.2), (True, 3.0)):  # the sampler's random path makes sampled steps dear
        c.costs.observe((1, 0, False, sampled), 1.0)
        c.costs.observe((1, 1, False, sampled), k1_cost)
        for k in range(2, K + 1):
            c.costs.observe((1, k, False, sampled), 10.0)
    _teach(c, "g", 1.0)
    _teach(c, "s", 1.0, sampled=True)
    assert _decide(c, 1, ["g"], [False], [K], [True]).k == 1
    assert _decide(c, 1, ["s"], [True], [K], [True]).k == 0


def test_learning_ends_early_when_even_optimistic_acceptance_cannot_pay():
    # K=1 costs 1.5x plain: it pays only if the first draft is accepted more than half the time.
    costs = {(1, 0, False): 1.0, (1, 1, False): 1.5} | {(1, k, False): 10.0 for k in range(2, K + 1)}
    c = _controller(costs)
    assert c.estimates.learning(False) and _decide(c, 1, ["a"], [False], [K], [True]).k == 1  # nothing verified: learn
    for i in range(16):
        c.observe("a" + str(i % 2), False, 1, 0)  # 16 first drafts of two requests, all rejected: Wilson bound
        c.observe("b", True, 1, 1)  # (z = 2) 0.2 < 0.5; sampled drafts of the method, all accepted: they go on
    assert c.estimates.learning(False) and c.estimates.method_stats[False].tried[0] < c.config.learn_drafts
    np.testing.assert_allclose(c.estimates.optimistic_reach(False)[0], 0.2)
    assert _decide(c, 1, ["a2"], [False], [K], [True]).k == 0
    assert _decide(c, 1, ["b2"], [True], [K], [True]).k == 1
    # The same failures against a cheap verify (K=1 at 1.05x) leave drafting possible: learning goes on.
    cheap = _controller(costs | {(1, 1, False): 1.05})
    for i in range(16):
        cheap.observe("a" + str(i % 2), False, 1, 0)
    assert _decide(cheap, 1, ["a2"], [False], [K], [True]).k == 1


def test_learning_does_not_end_on_a_drafting_cost_known_only_from_warmup():
    c = _controller({}, cost_max_age=0)  # (no exploration of neighbouring K)
    c.costs.observe((1, 0, False, False), 1.0)  # a real plain step
    for k in range(K + 1):  # warmup: K = 1 looks 1.5x a plain step, more drafts 10x
        c.costs.observe((1, k, False, False), (1.0, 1.5)[k] if k < 2 else 10.0, warmup=True)
    for i in range(16):
        c.observe("a" + str(i % 2), False, 1, 0)  # bound 0.2: drafting at 1.5x could not pay
    assert _decide(c, 1, ["a2"], [False], [K], [True]).k == 1  # ... but K = 1 never ran: it runs once
    c.costs.observe((1, 1, False, False), 1.05)  # and costs 1.05x: learning goes on
    assert _decide(c, 1, ["a3"], [False], [K], [True]).k == 1
    dear = _controller({(1, 0, False): 1.0, (1, 1, False): 1.5} | {(1, k, False): 10.0 for k in range(2, K + 1)},
                       cost_max_age=0)  # K = 1 measured in a real step at 1.5x: learning ends
    for i in range(16):
        dear.observe("a" + str(i % 2), False, 1, 0)
    assert _decide(dear, 1, ["a2"], [False], [K], [True]).k == 0


def test_learning_lasts_until_learn_requests_requests_had_drafts_verified():
    c = SpeculationController(K, ControllerConfig(), can_detach=False)  # learn_requests = 4
    for _ in range(40):
        c.observe("a", True, K, 1)
    assert c.estimates.learning(True)  # 40 drafts (> learn_drafts), all of one request
    for r in ("b", "c"):
        for _ in range(LEARN_DRAFTS_PER_REQUEST):
            c.observe(r, True, K, 1)
    for _ in range(LEARN_DRAFTS_PER_REQUEST - 1):
        c.observe("d", True, K, 1)
    assert c.estimates.learning(True)
    c.observe("d", True, K, 1)  # the fourth request's fourth draft
    assert not c.estimates.learning(True) and c.estimates.learning(False)  # (greedy requests apart)


def test_learning_does_not_end_on_one_requests_drafts():
    # K=1 costs 1.5x plain (as above). 16 rejected drafts of one request bound the acceptance at 0.2, but one
    # request's drafts are not independent (its text may be what the proposer cannot draft): that request stops
    # drafting, and the next learns at K = 1 until LEARN_DRAFTS_PER_REQUEST of its own drafts are verified.
    costs = {(1, 0, False): 1.0, (1, 1, False): 1.5} | {(1, k, False): 10.0 for k in range(2, K + 1)}
    c = _controller(costs | {(1, 0, True): 0.9}, can_detach=True, learn_requests=2)  # (the target alone: a
    # little cheaper)
    for i in range(16):
        c.observe("a", False, 1, 0)
    assert c.estimates.learning(False) and _decide(c, 1, ["a"], [False], [K], [True]).k == 0
    new = c.row_caps(["b"], [False], np.asarray([K]), np.asarray([True]))
    assert not c.prefers_plain(1, new, 1)  # prefilled attached, to learn
    for i in range(LEARN_DRAFTS_PER_REQUEST):
        assert _decide(c, 1, ["b"], [False], [K], [True]).k == 1
        c.observe("b", False, 1, 0)
    # Two requests' drafts (learn_requests = 2), all rejected: learning ends, new requests are prefilled detached.
    assert _decide(c, 1, ["b"], [False], [K], [True]).k == 0
    assert _decide(c, 1, ["c"], [False], [K], [True]).k == 0
    assert c.prefers_plain(1, c.row_caps(["d"], [False], np.asarray([K]), np.asarray([True])), 1)
    # One request in two ends learning early as before (learn_requests = 1).
    one = _controller(costs, learn_requests=1)
    for i in range(16):
        one.observe("a", False, 1, 0)
    assert _decide(one, 1, ["b"], [False], [K], [True]).k == 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="cost_window"):
        ControllerConfig(cost_window=0)
    with pytest.raises(ValueError, match="min_speedup"):
        ControllerConfig(min_speedup=float("nan"))
    with pytest.raises(ValueError, match="explore_margin"):
        ControllerConfig(explore_margin=-0.1)
    with pytest.raises(ValueError, match="learn_requests"):
        ControllerConfig(learn_requests=0)
    with pytest.raises(ValueError, match="detach_z"):
        ControllerConfig(detach_z=-1.0)
    with pytest.raises(ValueError, match="prior_drafts"):
        ControllerConfig(prior_drafts=-1.0)
    with pytest.raises(ValueError, match="detach_after"):
        ControllerConfig(detach_after=-1)
    with pytest.raises(ValueError, match="cost_max_age"):
        ControllerConfig(cost_max_age=1.5)
    with pytest.raises(ValueError, match="learn_z"):
        ControllerConfig(learn_z=-1.0)
    with pytest.raises(ValueError, match="replan_every"):
        ControllerConfig(replan_every=-2)
    with pytest.raises(ValueError, match="draft_replan_every"):
        ControllerConfig(draft_replan_every=True)
    with pytest.raises(ValueError, match="min_lookup_hits"):
        ControllerConfig(min_lookup_hits=-0.5)
    with pytest.raises(ValueError, match="shadow_band"):
        ControllerConfig(shadow_band=float("inf"))
    with pytest.raises(ValueError, match="max_planning_share"):
        ControllerConfig(max_planning_share=-0.1)
    with pytest.raises(ValueError, match="max_prior_strength"):
        ControllerConfig(prior_strength=8.0, max_prior_strength=4.0)
    with pytest.raises(ValueError, match="sampled_prior_strength"):
        ControllerConfig(sampled_prior_strength=-1.0)
    with pytest.raises(ValueError, match="sampled_prior_strength"):
        ControllerConfig(sampled_prior_strength=128.0)  # above max_prior_strength (64)
    with pytest.raises(ValueError, match="adaptive"):
        specjax.SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive="yes")
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        specjax.SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=True,
                                  num_speculative_tokens_per_batch_size=[(1, 4, 2)])
    assert specjax.SpeculativeConfig(method="ngram", num_speculative_tokens=2).adaptive is True
    assert specjax.SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                     num_speculative_tokens_per_batch_size=[(1, 4, 2)]).adaptive is False


# --------------------------------------------------------------------------- in the engine


KW = dict(max_model_len=64, max_num_seqs=4, block_size=8, max_prefill_chunk=16, query_buckets=(1, 16))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), family="llama", num_kv_heads=2,
                                vocab_size=32, eos_token_id=None, seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), family="llama", num_kv_heads=1,
                                vocab_size=32, num_layers=1, hidden_size=32, eos_token_id=None, seed=7)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(4, 32, size=n).tolist()} for n in lengths]


def test_warmup_times_each_step_kind_in_a_run_of_it(target_dir, draft_dir, monkeypatch):
    """A kind's cost is what a step costs in a run of it: warmup times the last of WARMUP_STEPS_PER_KIND
    consecutive steps of each kind (the first, right after another kind, runs cold)."""
    # The rounds' time budget is wall-clock time: on a loaded machine the fake steps below once ran 11 rounds.
    monkeypatch.setattr("specjax.engine.WARMUP_TIMING_SECONDS", 1e9)
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
                      warmup=False, **KW)
    calls, seen = [], []
    llm.runner.warmup = lambda *a, **kw: None  # (compiling is not what this checks)

    def time_step(bucket, detached, sampled=False, repeats=3, draft_ahead=0):
        calls.append((bucket, detached, sampled, draft_ahead))
        return float(len(calls))  # a step's "time": its place in the sequence

    llm.runner.time_step = time_step
    costs = llm.engine.controller.costs
    real_observe = costs.observe
    costs.observe = lambda key, seconds, **kw: (seen.append((key, seconds, kw)), real_observe(key, seconds, **kw))
    llm.engine.warmup(progress=False)
    kinds = {(b[0], b[2], d, smp) for b, d, smp, _ in calls}
    # Steps that take no time: the most rounds over every kind of each row bucket, one bucket after another.
    most = WARMUP_ROUNDS[1]
    assert len(seen) == most * len(kinds) and {key for key, _, _ in seen} == kinds
    assert [key[0] for key, _, _ in seen] == sorted(key[0] for key, _, _ in seen)
    for key, seconds, kw in seen:
        assert kw == {"warmup": True}
        last = int(seconds) - 1  # the timed step
        run = calls[last - WARMUP_STEPS_PER_KIND + 1: last + 1]
        assert len(run) == WARMUP_STEPS_PER_KIND and len(set(run)) == 1, run  # a run of one kind, its last timed
        (rows, _, k), detached, sampled, ahead = run[0]
        assert (rows, k, detached, sampled) == key and ahead == max(k, 1)
        before = last - WARMUP_STEPS_PER_KIND
        assert before < 0 or calls[before] != run[0]  # (the run starts right after another kind)


def test_warmup_times_a_row_bucket_beyond_the_least_rounds_only_within_its_time_budget(target_dir, draft_dir,
                                                                                     monkeypatch):
    import specjax.engine as engine_module

    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
                      warmup=False, **KW)
    llm.runner.warmup = lambda *a, **kw: None  # (compiling is not what this checks)
    llm.runner.time_step = lambda *a, **kw: 1e-3
    assert WARMUP_ROUNDS[0] < WARMUP_ROUNDS[1]
    for budget, rounds in ((0.0, WARMUP_ROUNDS[0]), (3600.0, WARMUP_ROUNDS[1])):
        monkeypatch.setattr(engine_module, "WARMUP_TIMING_SECONDS", budget)
        seen = collections.Counter()
        llm.engine.controller.costs.observe = lambda key, seconds, seen=seen, **kw: seen.update([key])
        llm.engine.warmup(progress=False)
        assert len({key[0] for key in seen}) == len(llm.engine.config.row_buckets) > 1
        assert set(seen.values()) == {rounds}  # every kind of every row bucket


def test_adaptive_engine_is_lossless_varies_k_and_compiles_nothing_after_warmup(target_dir, draft_dir):
    plain = specjax.LLM(target_dir, warmup=False, **KW)
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 3}, **KW)
    warm = llm.num_compiles
    # Make drafting look cheap for two row buckets and dear for the others, so the chosen K changes.
    costs = llm.engine.controller.costs
    for rows, k, detached, sampled in list(costs.seconds):
        costs.set((rows, k, detached, sampled), 1.0 + (0.01 if rows <= 2 else 5.0) * k)
    costs.frozen = True  # keep the table fixed during the test
    loads = []
    for i, lengths in enumerate([[5], [9, 30], [3, 17, 41, 8], [12, 2, 6]]):
        prompts = _prompts(10 + i, lengths)
        params = [specjax.SamplingParams(temperature=0.0, max_tokens=10 + j) for j in range(len(lengths))]
        loads.append((prompts, params, [o.outputs[0].token_ids for o in plain.generate(prompts, params)]))
    with count_compiles() as counter:
        for i, (prompts, params, expected) in enumerate(loads):
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
            llm.generate(prompts, specjax.SamplingParams(temperature=0.8, top_k=5, max_tokens=6, seed=i))
    assert counter.count == 0 and llm.num_compiles == warm
    hist = llm.get_metrics()["k_histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0  # plain and drafting steps both happened


def test_plans_made_while_the_device_runs_serve_the_same_rows_and_are_undone_when_rows_change(target_dir, draft_dir):
    plain = specjax.LLM(target_dir, warmup=False, **KW)
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 3}, **KW)
    costs, eng = llm.engine.controller.costs, llm.engine
    for key in list(costs.seconds):  # drafting is cheap: the steps draft
        costs.set(key, 1.0 + 0.01 * key[1])
    costs.frozen = True
    counts = collections.Counter()
    plan, prepared_step, drop = eng._plan, eng._prepared_step, eng._drop_prepared

    def counted_plan(*args):
        counts["plans"] += 1
        return plan(*args)

    def counted_prepared_step(*args):
        got = prepared_step(*args)
        counts["used" if got is not None else "limits fell"] += 1
        return got

    def counted_drop():
        counts["dropped"] += eng._prepared is not None
        drop()

    eng._plan, eng._prepared_step, eng._drop_prepared = counted_plan, counted_prepared_step, counted_drop
    prompts = _prompts(3, [5, 9, 7])
    long = [specjax.SamplingParams(temperature=0.0, max_tokens=40) for _ in prompts]
    first = plain.generate(prompts[:1], long[:1])[0].outputs[0].token_ids
    # A stop token ends the first request where no plan could foresee it: the plan made for its rows is dropped.
    stop = next(t for i, t in enumerate(first) if i >= 10 and t not in first[:i])
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])] + long[1:]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert len(expected[0]) < 40 and counts["used"] > 0 and counts["dropped"] > 0
    # Each decoding step counted once: the dropped plans' counts were undone.
    assert sum(llm.get_metrics()["k_histogram"]) == counts["plans"]
    # A plan interrupted while made ahead (here: its decision raises) is undone when generate() aborts, and the
    # next call runs as before.
    decide, prepare = eng.controller.decide, eng._prepare

    def interrupted_prepare(*args):
        eng.controller.decide = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
        try:
            prepare(*args)
        finally:
            eng.controller.decide = decide

    eng._prepare = interrupted_prepare
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    assert eng._prepared is None and not eng.has_unfinished
    eng._prepare = prepare
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert sum(llm.get_metrics()["k_histogram"]) == counts["plans"]


def _dear_drafting(c: SpeculationController, factor: float = 10.0) -> None:
    """Pin the costs: every attached step (drafting or not) costs ``factor`` x a detached plain one, in every
    bucket."""
    for rows in (1, 2, 4):
        for sampled in (False, True):
            for k in range(c.k_max + 1):
                c.costs.set((rows, k, False, sampled), factor)
            c.costs.set((rows, 0, True, sampled), 1.0)
    c.costs.frozen = True


def _learned(c: SpeculationController) -> None:
    """Earlier requests verified enough drafts (every one accepted) for the method's prior to count."""
    for sampled in (False, True):
        for i in range(max(c.config.learn_drafts, c.config.learn_requests * LEARN_DRAFTS_PER_REQUEST)):
            c.observe(f"earlier{i % c.config.learn_requests}", sampled, c.k_max, c.k_max)
    assert not c.estimates.learning(False) and not c.estimates.learning(True)


def test_an_unlearned_method_drafts_to_learn_and_never_prefills_detached(target_dir, draft_dir):
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
                      warmup=False, **KW)
    c = llm.engine.controller
    # Drafting pays only if nearly every draft is accepted (3 tokens per K=2 step at 2.5x the cost): only
    # learning drafts, while the acceptance seen so far leaves that possible.
    _dear_drafting(c, 2.5)
    # 4 rows x >= 50/3 verifications each: past learn_drafts (32) with room to detach after.
    llm.generate(_prompts(5, [3, 4, 5, 6]), specjax.SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    m = llm.get_metrics()
    assert m["num_detached_prefills"] == 0 and m["num_draft_tokens"] > 0
    # Learning ended (all learn_drafts verified, or the random draft's failures bounded its acceptance below
    # what would pay), then the controller detached.
    assert not c._learning_k(4, 4, np.full(4, 2), False) and m["num_detached_steps"] > 0
    llm.generate(_prompts(6, [7]), specjax.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert llm.get_metrics()["num_detached_prefills"] > 0  # the next greedy request is not followed at all


def test_shadow_steps_change_no_output_and_time_the_target_alone(target_dir, draft_dir):
    spec = {"model": str(draft_dir), "num_speculative_tokens": 2}
    llms = [specjax.LLM(target_dir, speculative_config=spec, warmup=False, **KW) for _ in range(2)]
    shadows = []
    for llm, every_step in zip(llms, (True, False)):
        c = llm.engine.controller
        for rows in (1, 2, 4):  # drafting pays (K = 2 at 1.2x a plain step), decisions fixed
            for sampled in (False, True):
                for k in range(3):
                    c.costs.set((rows, k, False, sampled), 1.0 + 0.1 * k)
                c.costs.set((rows, 0, True, sampled), 1.0)
        _learned(c)
        c.costs.frozen = True
        c.shadow_due = lambda *a, every_step=every_step: every_step
        real = llm.engine._shadow_step
        llm.engine._shadow_step = lambda *a, real=real: (shadows.append(a[2]), real(*a))
    prompts = _prompts(4, [6, 13, 9])
    for params in (specjax.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                   specjax.SamplingParams(temperature=0.9, top_k=8, max_tokens=16, ignore_eos=True, seed=5,
                                          presence_penalty=0.5, frequency_penalty=0.3)):
        with_shadows, without = ([o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in llms)
        assert with_shadows == without
    assert len(shadows) > 10 and llms[0].get_metrics()["num_draft_tokens"] > 0
    # Unfrozen, a shadow step's time is the target alone's real measurement in the step's bucket.
    c = llms[0].engine.controller
    c.costs.frozen = False
    llms[0].generate(prompts[:1], specjax.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert c.costs.seen((1, 0, True, False)) and c.costs.age((1, 0, True, False)) == 0


def test_detached_steps_keep_greedy_output_and_stop_drafting_for_stale_rows(target_dir, draft_dir):
    plain = specjax.LLM(target_dir, warmup=False, **KW)
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
                      warmup=False, **KW)
    c = llm.engine.controller
    _dear_drafting(c)
    _learned(c)
    c.prefers_plain = lambda *a: False  # prefill attached, as when drafting was expected to pay
    prompts = _prompts(3, [6, 11])
    params = specjax.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    m = llm.get_metrics()
    assert m["num_detached_steps"] > 0 and m["num_detached_prefills"] == 0


def test_a_prefill_plan_holds_only_the_requests_being_prefilled(target_dir, draft_dir):
    """Detached rows decode beside a later request's prefill: the plan stands for the new request alone, so the
    explore_every count is of requests prefilled (it counted the decoding rows too, and eagle3 at batch 32
    explored every ~3 batches instead of every 16)."""
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2},
                      warmup=False, **{**KW, "max_num_seqs": 2})
    c = llm.engine.controller
    _dear_drafting(c)
    _learned(c)
    plans, prefers_plain = [], c.prefers_plain

    def spy(rows, plan, num_rows):
        decoding = {r.request_id for r in llm.engine.scheduler.running if r.output_token_ids}
        plans.append((list(plan.request_ids), decoding))
        return prefers_plain(rows, plan, num_rows)

    c.prefers_plain = spy
    # Two slots, three requests: the third is prefilled beside a row that decodes detached.
    llm.generate(_prompts(4, [6, 5, 9]), [specjax.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                          for n in (4, 20, 8)])
    assert llm.get_metrics()["num_detached_prefills"] == len(plans) >= 2
    assert any(decoding for _, decoding in plans)  # a prefill step with a decoding row beside it happened
    for ids, decoding in plans:
        assert ids and not set(ids) & decoding
    assert sum(len(ids) for ids, _ in plans) == 3 == c._detached_prefill_votes

def test_engine_plans_a_step_kept_plain_once_per_replan_every_steps(target_dir):
    """ngram cannot detach: where drafting cannot pay every step is an attached plain one, and the controller's
    plan (host lookup included) serves replan_every steps of the same rows; output as plain decoding's."""
    plain = specjax.LLM(target_dir, warmup=False, **KW)
    llm = specjax.LLM(target_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 3}, warmup=False, **KW)
    c = llm.engine.controller
    for rows in (1, 2, 4):  # a step with drafts costs 10x one without
        for sampled in (False, True):
            for k in range(c.k_max + 1):
                c.costs.set((rows, k, False, sampled), 10.0 if k else 1.0)
    c.costs.frozen = True
    _learned(c)
    plans = []
    decide = c.decide
    c.decide = lambda *a, **kw: plans.append(1) or decide(*a, **kw)
    prompts = _prompts(8, [5, 9])
    params = specjax.SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    hist = llm.get_metrics()["k_histogram"]
    decoding_steps = int(sum(hist))
    assert hist[0] == decoding_steps >= 29  # no drafts (no probe is due within 32 steps)
    assert len(plans) <= -(-decoding_steps // c.config.replan_every) + 1  # + 1: the rows changed at most once


def test_each_decoding_steps_cost_reaches_the_cost_model_once_in_order_while_a_later_step_runs(target_dir):
    """The engine hands steps' times to the cost model after launching a later step (host work there overlaps
    the device's): while a plan holds, several in one go, and always before the next plan, which then reads
    every step's time but the last one's; the batch's last steps' when the batch is done. Every decoding step
    is measured once, in the order they ran."""
    llm = specjax.LLM(target_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1, "prompt_lookup_max": 2}, **KW)
    c, runner = llm.engine.controller, llm.runner
    events = []  # ("launch", K or None for a prefill step), ("fetch",), ("cost", K), ("plan",) in order
    real_launch, real_fetch, real_observe, real_decide = runner.launch, runner.fetch, c.costs.observe, c.decide

    def launch(batch):
        events.append(("launch", batch.host_drafts.shape[1] if batch.tokens.shape[1] == 1 else None))
        return real_launch(batch)

    runner.launch = launch
    runner.fetch = lambda out: (events.append(("fetch",)), real_fetch(out))[1]
    c.costs.observe = lambda key, *a, **kw: (events.append(("cost", key[1])), real_observe(key, *a, **kw))
    c.decide = lambda *a, **kw: (events.append(("plan",)), real_decide(*a, **kw))[1]
    motif = np.random.default_rng(3).integers(4, 32, size=5).tolist()
    batched = 0  # costs given in one go
    for n in (12, 17):  # repetitive: lookups hit, K varies; one row at a time, so plans hold
        events.clear()
        llm.generate([{"prompt_token_ids": (motif * 4)[: n]}],
                     specjax.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        steps = [e[1] for e in events if e[0] == "launch" and e[1] is not None]
        assert [e[1] for e in events if e[0] == "cost"] == steps and len(set(steps)) > 1
        last = max(i for i, e in enumerate(events) if e[0] == "fetch")
        running = False  # a step was launched and not yet fetched
        for i, e in enumerate(events[:last]):
            running = e[0] == "launch" or (running and e[0] != "fetch")
            if e[0] == "cost":
                assert running, f"step cost measured outside a step's run: {events[i - 3:i + 2]}"
                batched += events[i - 1][0] == "cost"
            if e[0] == "plan":
                launched = sum(1 for x in events[:i] if x[0] == "launch" and x[1] is not None)
                assert sum(1 for x in events[:i] if x[0] == "cost") >= launched - 1, "a plan read stale costs"
        assert set(e[0] for e in events[last + 1:]) == {"cost"}
    assert batched > 0


def test_engine_with_a_host_lookup_that_drafts_matches_plain_decoding(target_dir):
    """ngram with drafting as cheap as a plain step: one row alone (its plans held, lookups every held step)
    and a draining batch of rows with different max_tokens (lookups of the longest rows first); output as
    plain decoding's, and drafts were verified."""
    plain = specjax.LLM(target_dir, warmup=False, **KW)
    llm = specjax.LLM(target_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1, "prompt_lookup_max": 2},
                      warmup=False, **KW)
    c = llm.engine.controller
    for rows in (1, 2, 4):
        for sampled in (False, True):
            for k in range(c.k_max + 1):
                c.costs.set((rows, k, False, sampled), 1.0 + 0.01 * k)
    c.costs.frozen = True
    _learned(c)
    rng = np.random.default_rng(3)
    motif = rng.integers(4, 32, size=5).tolist()
    prompts = [{"prompt_token_ids": (motif * 4)[: n]} for n in (12, 17, 9)]  # repetitive: lookups hit
    for batch, max_tokens in ((prompts[:1], [24]), (prompts, [6, 24, 15])):
        params = [specjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == \
            [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    assert sum(llm.get_metrics()["k_histogram"][1:]) > 0


def test_prefill_runs_detached_when_drafting_cannot_pay_and_the_proposer_is_never_touched(target_dir, draft_dir):
    plain = specjax.LLM(target_dir, warmup=False, **KW)
    llm = specjax.LLM(target_dir, speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2}, **KW)
    warm = llm.num_compiles
    c = llm.engine.controller
    _dear_drafting(c)  # even drafts always accepted cannot pay
    _learned(c)
    before = [np.asarray(a).copy() for a in jax.tree.leaves(llm.runner.state.proposer)]
    prompts = _prompts(4, [6, 11, 20])
    params = [specjax.SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              specjax.SamplingParams(temperature=0.7, max_tokens=9, seed=1, ignore_eos=True),
              specjax.SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    with count_compiles() as counter:
        outs = llm.generate(prompts, params)
    assert counter.count == 0 and llm.num_compiles == warm  # detached steps are the warmed-up executables
    expected = plain.generate(prompts, params)
    # Every step was plain, and sampling noise is keyed by request and position: even the sampled row matches.
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    m = llm.get_metrics()
    assert m["num_detached_prefills"] > 0 and m["num_draft_tokens"] == 0
    assert m["num_detached_steps"] == m["num_steps"] - m["num_detached_prefills"]  # every decoding step too
    after = jax.tree.leaves(llm.runner.state.proposer)
    assert len(before) == len(after) > 0
    for a, b in zip(before, after):  # the draft model's KV cache was never written
        np.testing.assert_array_equal(a, np.asarray(b))


def test_a_drafting_plan_is_held_for_draft_replan_every_steps_and_its_undrafted_rows_stay_idle():
    costs = {(2, k, False): 1.0 + 0.1 * k for k in range(K + 1)}
    c = _controller(costs, probe_every=5, draft_replan_every=4)
    _teach(c, "a", 0.9)
    _teach(c, "b", 0.0)
    d = _decide(c, 2, ["a", "b"], [False, False], [K, K], [True, True])
    assert d.k > 0 and d.caps.tolist() == [d.k, 0] and d.hold == 3
    for _ in range(d.hold):
        c.held_step(d.k)
    # "b" drafted in none of the 4 steps: idle for 4, so its probe falls due one plan later (probe_every 5) ...
    assert not c.row_caps(["a", "b"], [False, False], np.asarray([K, K]), np.asarray([True, True])).probing[1]
    d = _decide(c, 2, ["a", "b"], [False, False], [K, K], [True, True])
    assert d.caps[1] == 0
    probe = _decide(c, 2, ["a", "b"], [False, False], [K, K], [True, True])
    assert probe.caps[1] == 1 and probe.hold == 0  # ... and a plan that probes is not held
    assert sum(c.k_histogram) == 1 + 3 + 1 + 1  # three plans and the three held steps between
    every = _controller(costs, probe_every=5, draft_replan_every=1)
    _teach(every, "a", 0.9)
    assert _decide(every, 2, ["a"], [False], [K], [True]).hold == 0


def test_a_plan_drafting_what_a_host_lookup_found_is_held_for_one_row_only():
    costs = {(r, k, False): 1.0 + 0.1 * k for k in range(K + 1) for r in (1, 2)}
    c = _controller(costs, probe_every=0, draft_replan_every=4)
    _teach(c, "a", 0.9)
    _teach(c, "b", 0.9)
    plan = c.row_caps(["a", "b"], [False, False], np.asarray([K, K]), np.asarray([True, True]))
    d = c.decide(2, plan, found=np.asarray([K, K]))
    assert d.k > 0 and d.hold == 0  # which rows' lookups hit changes every step
    assert _decide(c, 2, ["a", "b"], [False, False], [K, K], [True, True]).hold == 3  # from a device proposer
    one = c.decide(1, c.row_caps(["a"], [False], np.asarray([K]), np.asarray([True])), found=np.asarray([K]))
    assert one.k > 0 and one.hold == 3  # one row: a held step verifies what its lookup finds, or runs plain


def test_a_request_that_finishes_during_a_held_plan_leaves_no_state_behind():
    costs = {(2, k, False): 3.0 for k in range(1, K + 1)} | {(2, 0, False): 1.0}
    c = _controller(costs, probe_every=0, replan_every=4)
    _teach(c, "a", 0.05)
    d = _decide(c, 2, ["a", "b"], [False, False], [K, K], [True, True])
    assert d.k == 0 and d.hold == 3
    c.held_step()
    c.finish("a")  # "a" finished during the hold: the next plan has "b" alone
    _decide(c, 2, ["b"], [False], [K], [True])
    assert "a" not in c._idle_steps and "a" not in c.estimates.requests


def test_a_draining_batch_drafts_only_where_drafts_shorten_its_longest_row():
    # Two rows with good drafts: a drafting step costs 2x a plain one, 3.4 expected accepted tokens per row.
    costs = {(2, k, False): 1.0 + 0.25 * k for k in range(K + 1)}
    c = _controller(costs, probe_every=0)
    _teach(c, "fast", 0.9)
    _teach(c, "slow", 0.9)

    def plan(remaining, found):
        wanted = c.row_caps(["fast", "slow"], [False, False], np.asarray([K, K]), np.asarray([True, True]),
                            remaining=None if remaining is None else np.asarray(remaining))
        return c.decide(2, wanted, found=np.asarray(found))

    # Only "fast" found drafts: worth it for tokens per second (requests wait), ...
    assert plan(None, [K, 0]).k > 0
    # ... not while draining if "slow" has at least as many tokens left: the drain ends with it either way.
    assert plan([30, 30], [K, 0]).k == 0
    assert plan([20, 30], [K, 0]).k == 0
    # The row with the most left has drafts and the other is far enough behind: they shorten the drain.
    assert plan([30, 20], [K, 0]).k == K
    # One token ahead: drafts take at most one token off the drain (30 left -> 29, where "slow" is), so one
    # draft (1.25x a plain step for 0.9 tokens more) and no more (K = 4: 2x for the same).
    assert plan([30, 29], [K, 0]).k == 1
    assert plan([30, 30], [K, K]).k > 0  # both found drafts: both advance


def test_a_draining_lookup_stops_at_a_longest_row_without_drafts():
    from types import SimpleNamespace

    from specjax.engine import Engine

    asked = []

    def propose_host(ids, histories, limits):
        asked.extend(ids)
        return [np.arange(min(lim, 2), dtype=np.int32) if i != "miss" else np.zeros(0, np.int32)
                for i, lim in zip(ids, limits)]

    fake = SimpleNamespace(scheduler=SimpleNamespace(slots=SimpleNamespace(history=lambda s: np.arange(5))),
                           proposer=SimpleNamespace(propose_host=propose_host))
    ids, slots, limits = ["a", "miss", "c"], np.arange(3), [K, K, K]
    drafts, found = Engine._lookup(fake, ids, slots, limits)
    assert asked == ids and found == [2, 0, 2]
    # Draining: "a" and "miss" have the most left; "miss" finds nothing, so "c" is not looked up.
    asked.clear()
    drafts, found = Engine._lookup(fake, ids, slots, limits, np.asarray([9, 9, 5]))
    assert asked == ["a", "miss"] and found == [2, 0, 0] and len(drafts[2]) == 0
    asked.clear()
    drafts, found = Engine._lookup(fake, ids, slots, limits, np.asarray([9, 5, 9]))  # the longest rows hit
    assert asked == ["a", "c", "miss"] and found == [2, 0, 2]
    asked.clear()
    drafts, found = Engine._lookup(fake, ids, slots, [0, K, K], np.asarray([9, 5, 5]))
    assert asked == [] and not any(found)  # the longest row may not draft: no lookup at all


def test_a_draining_batch_counts_its_drafting_rows_at_their_mean_acceptance():
    costs = {(2, k, False): 1.0 + 0.25 * k for k in range(K + 1)}
    c = _controller(costs, probe_every=0)
    _teach(c, "good", 0.9)
    _teach(c, "poor", 0.5)
    wanted = c.row_caps(["good", "poor"], [False, False], np.asarray([K, K]), np.asarray([True, True]),
                        remaining=np.asarray([30, 30]))
    # At the rows' mean (2.2 tokens at K = 4) long drafts pay: which of two drafting rows ends last is chance.
    assert c.decide(2, wanted).k >= 3
    # By "poor"'s own estimate, as when it drains alone, only one draft pays ((1 + 0.5) / 1.25).
    alone = c.row_caps(["poor"], [False], np.asarray([K]), np.asarray([True]), remaining=np.asarray([30]))
    assert c.decide(2, alone).k == 1


def test_a_kind_never_measured_goes_by_its_twin_of_the_other_sampling_where_that_one_was():
    c = SpeculationController(K, ControllerConfig(cost_max_age=64), can_detach=True)
    warm = {(8, 0, True): 1.0, (8, 1, False): 2.0}  # (rows, K, detached) -> warmup seconds, greedy
    for (rows, k, det), seconds in warm.items():
        c.costs.observe((rows, k, det, False), seconds, warmup=True)
        c.costs.observe((rows, k, det, True), 1.2 * seconds, warmup=True)  # sampling: 1.2x at warmup
    for _ in range(8):
        c.costs.observe((8, 1, False, True), 6.0)  # the sampled bucket's scale: 2.5
    assert c.costs.estimate(8, 0, True, True) == pytest.approx(1.2 * 2.5)  # no twin measured: the scale
    for _ in range(8):
        c.costs.observe((8, 0, True, False), 1.5)  # the greedy twin ran for real: 1.5x its warmup time
    assert c.costs.estimate(8, 0, True, True) == pytest.approx(1.5 * 1.2)
    for _ in range(64):  # K=1 greedy runs at the sampled K=1's speed: the twin keeps its relation
        c.costs.observe((8, 1, False, False), 5.0)
    assert c.costs.estimate(8, 0, True, True) == pytest.approx(1.5 * 1.2)
    c.costs.observe((8, 0, True, True), 2.0)  # measured itself: its own time
    assert c.costs.estimate(8, 0, True, True) == pytest.approx(2.0)


def test_several_rows_lookups_that_save_less_than_a_full_plan_costs_hold_plain_plans():
    def second_miss(plan_cost_share):
        c = _controller({(2, k, False): 1.0 + 0.1 * k for k in range(K + 1)}, replan_every=4, min_lookup_hits=0.1,
                        probe_every=0)
        _teach(c, "a", 0.9)
        _teach(c, "b", 0.9)
        plan = lambda: c.row_caps(["a", "b"], [False] * 2, np.asarray([K, K]), np.asarray([True] * 2))  # noqa: E731
        assert c.decide(2, plan(), found=np.asarray([K, K])).k > 0  # a hit: it saved part of a plain step
        saved = c.lookup_saving
        assert 0.2 < saved < 1.0
        first = c.decide(2, plan(), found=np.asarray([0, 0]))  # a miss: no full plan timed yet
        assert (first.k, first.hold) == (0, 0) and c.lookup_saving == pytest.approx(saved * 15 / 16)
        c.costs.observe_planning((2, False), plan_cost_share * saved)  # one full plan's host time
        d = c.decide(2, plan(), found=np.asarray([0, 0]))
        assert d.k == 0 and c.lookup_hit_rate > 0.1  # (lookups do not seldom hit)
        return d.hold

    assert second_miss(0.5) == 0  # lookups save twice what a plan costs: the next step plans again
    assert second_miss(1.0) == 3  # a plan costs more than the recent saving per plan: held replan_every steps
