"""Acceptance evidence: how much a request's own drafts should move its estimate away from the method's."""

import numpy as np
import pytest

from specjax.spec_decode.acceptance import MIN_REQUESTS_FOR_SPREAD, prior_strength
from specjax.spec_decode.controller import ControllerConfig, SpeculationController


def _requests(rates, tried: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.binomial(tried, p)), tried) for p in rates]


def test_requests_drawn_from_a_beta_prior_give_back_its_strength():
    # True rates ~ Beta(7, 3): a prior worth 10 observations; 2000 requests of 50 drafts each.
    rng = np.random.default_rng(1)
    strength = prior_strength(_requests(rng.beta(7.0, 3.0, 2000), 50), 1.0, 1000.0)
    assert strength == pytest.approx(10.0, rel=0.25)


def test_requests_that_differ_by_chance_alone_weigh_the_method_at_the_ceiling():
    assert prior_strength(_requests([0.7] * 200, 30), 4.0, 64.0) == 64.0


def test_requests_that_really_differ_keep_their_own_estimates():
    assert prior_strength(_requests([0.2, 0.9] * 20, 30), 4.0, 64.0) == 4.0


def test_too_few_requests_or_no_drafts_give_the_floor():
    few = _requests([0.7] * (MIN_REQUESTS_FOR_SPREAD - 1), 30)
    assert prior_strength(few, 4.0, 64.0) == 4.0
    assert prior_strength([(0, 0)] * 20, 4.0, 64.0) == 4.0


def test_a_request_whose_first_drafts_fail_stays_near_the_method_when_requests_differ_by_chance():
    c = SpeculationController(4, ControllerConfig(), can_detach=False)
    rng = np.random.default_rng(0)
    for i in range(40):  # finished requests, every draft accepted with probability 0.75
        for _ in range(12):
            accepted = 0
            while accepted < 4 and rng.random() < 0.75:
                accepted += 1
            c.observe(f"old{i}", True, 4, accepted)
        c.finish(f"old{i}")
    c.observe("new", True, 4, 0)
    c.observe("new", True, 4, 0)
    method = c.conditional_acceptance("other", True)[0]  # no drafts of its own: the method's estimate
    assert method == pytest.approx(0.75, abs=0.05)
    # Two rejections weigh against ~64 observations of the method, not 4 (there: 0.75 * 4 / 6 = 0.5).
    assert c.conditional_acceptance("new", True)[0] > method - 0.05
    assert c.as_dict()["prior_strength"]["sampled"] > 32 and c.as_dict()["prior_strength"]["greedy"] == 4.0
