"""What drafts are worth in a draining batch, checked against simulated drains."""

import math

import numpy as np
import pytest

from specjax.spec_decode.controller import ControllerConfig, SpeculationController
from specjax.spec_decode.drain import drain_gains, expected_max, step_tokens

K = 4


def _simulated_drain(rows: int, tokens: int, alpha: list[float], drafts: int, runs: int, seed: int = 0) -> float:
    """Mean steps until the last of ``rows`` rows has committed ``tokens`` tokens, each step drafting ``drafts``
    per row, draft j accepted with conditional probability ``alpha[j]`` (reference: plain simulation)."""
    rng = np.random.default_rng(seed)
    total = 0
    for _ in range(runs):
        left = np.full(rows, tokens)
        steps = 0
        while left.max() > 0:
            accepted = np.zeros(rows, np.int64)
            alive = np.ones(rows, bool)
            for j in range(drafts):
                alive &= rng.random(rows) < alpha[j]
                accepted += alive
            left -= np.minimum(1 + accepted, left)
            steps += 1
        total += steps
    return total / runs


def test_step_tokens_matches_the_distribution_of_committed_tokens():
    reach = [0.8, 0.5, 0.2, 0.1]  # P(X >= 2), P(X >= 3), ...
    probs = np.array([1 - 0.8, 0.8 - 0.5, 0.5 - 0.2, 0.2 - 0.1, 0.1])  # P(X = 1..5)
    x = np.arange(1, 6)
    mean, var = step_tokens(reach, 4)
    assert mean == pytest.approx(float(probs @ x))
    assert var == pytest.approx(float(probs @ x**2 - (probs @ x) ** 2))
    assert step_tokens(reach, 0) == (1.0, 0.0)


@pytest.mark.parametrize("moments", [
    {(10.0, 4.0): 1, (11.0, 2.0): 1, (9.5, 6.0): 1, (12.0, 0.5): 1},
    {(30.0, 3.0): 8},
    {(30.0, 3.0): 20, (31.0, 1.0): 5, (29.0, 0.0): 1},
    {(5.0, 1.0): 1, (40.0, 0.0): 1},  # one variable far above: the others cannot be the maximum
])
def test_expected_max_matches_sampled_maxima(moments):
    rng = np.random.default_rng(0)
    draws = [rng.normal(m, math.sqrt(v), 200_000) for (m, v), n in moments.items() for _ in range(n)]
    sampled = float(np.mean(np.max(draws, axis=0)))
    spread = max(math.sqrt(v) for m, v in moments)
    assert expected_max(moments) == pytest.approx(sampled, abs=0.03 * spread + 1e-9)


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_closed_batch_drafting_pays_what_its_simulated_drain_pays(rows):
    # Every row starts with 64 tokens and drafts 2 a step, accepted with conditional probability 0.75 / 0.7: the
    # drain takes ~28 steps for one row, ~31 for 8 (whichever row is unluckiest ends it).
    alpha = [0.75, 0.7, 0.0, 0.0]
    reach = list(np.cumprod(alpha))
    gains = drain_gains([reach] * rows, [2] * rows, [64] * rows, K)
    steps = _simulated_drain(rows, 64, alpha, 2, runs=400 if rows < 32 else 150)
    # A step drafting 2 is worth 1 + gain plain steps of the drain: plain decoding takes exactly 64 steps. (The
    # simulation also loses part of a step at the end, where a row commits fewer tokens than it could.)
    assert 64 / (1 + gains[2]) == pytest.approx(steps, rel=0.03)
    if rows == 1:
        assert gains[2] == pytest.approx(reach[0] + reach[1])  # one row: its expected accepted drafts
    else:
        assert gains[2] < reach[0] + reach[1] - 0.1


def test_one_row_drains_as_it_does_beside_a_row_that_never_ends_the_drain():
    # A finished row beside it (no tokens left, no drafts) changes nothing, and takes the general path.
    rng = np.random.default_rng(3)
    for _ in range(20):
        reach = list(np.cumprod(rng.uniform(0.2, 1.0, K)))
        cap, left = int(rng.integers(1, K + 1)), int(rng.integers(8, 200))
        alone = drain_gains([reach], [cap], [left], K)
        beside = drain_gains([reach, reach], [cap, 0], [left, 0], K)
        assert alone == pytest.approx(beside, rel=1e-12, abs=1e-12)


def test_rows_behind_a_row_without_drafts_gain_nothing_and_a_row_ahead_gains_its_lead():
    reach = [[0.9, 0.81, 0.73, 0.66]] * 2
    assert drain_gains(reach, [K, 0], [30, 30], K)[1:] == [0.0] * K  # the drain ends with the plain row
    ahead = drain_gains(reach, [K, 0], [30, 29], K)
    assert ahead[1] == pytest.approx(0.9, abs=0.01) and ahead[K] == pytest.approx(1.0, abs=0.01)  # one token
    assert math.isnan(drain_gains(reach, [0, 0], [30, 29], K)[1])


def test_a_draining_closed_batch_stays_plain_where_one_row_would_draft():
    # Drafting 2 costs 2x a plain step and adds 1.44 tokens a row: 1.22x for one row, but 32 rows draining
    # together finish with the unluckiest of them (~1.08x, short of the 1.1 margin).
    c = SpeculationController(K, ControllerConfig(learn_requests=1, probe_every=0), can_detach=False)
    for k in range(K + 1):
        for sampled in (False, True):
            c.costs.observe((32, k, False, sampled), 1.0 if k == 0 else 2.0 + 0.5 * (k - 2) * (k > 2))
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(32)]
    for rid in ids:
        for _ in range(200):
            accepted = 0
            while accepted < 2 and rng.random() < 0.8:
                accepted += 1
            c.observe(rid, False, 2, accepted)

    def decide(n, remaining):
        wanted = c.row_caps(ids[:n], [False] * n, np.full(n, K), np.ones(n, bool),
                            None if remaining is None else np.full(n, remaining))
        return c.decide(32, wanted).k

    assert decide(1, 64) == 2
    assert decide(32, None) == 2  # requests wait: every token counts
    assert decide(32, 64) == 0


def test_a_closed_batch_is_prefilled_detached_where_its_drain_would_not_pay_for_drafts():
    # 8 new requests of 64 tokens, nobody else waiting: drafting 2 pays 1.16x the target alone counting tokens,
    # less than the 1.1x margin counting the drain. The prefill follows the drain, as its decoding steps will.
    c = SpeculationController(K, ControllerConfig(learn_requests=1, probe_every=0, explore_every=0), can_detach=True)
    costs = {(0, True): 1.0, (0, False): 1.05, (1, False): 1.9, (2, False): 2.1, (3, False): 2.8, (4, False): 3.3}
    for (k, detached), seconds in costs.items():
        for sampled in (False, True):
            c.costs.observe((8, k, detached, sampled), seconds)
    rng = np.random.default_rng(0)
    for _ in range(400):
        accepted = 0
        while accepted < K and rng.random() < 0.8:
            accepted += 1
        c.observe("old", False, K, accepted)
    ids = [f"new{i}" for i in range(4)]  # prefilled 4 at a time, standing for 8

    def prefill(remaining):
        plan = c.row_caps(ids, [False] * 4, np.full(4, K), np.ones(4, bool),
                          None if remaining is None else np.full(4, remaining))
        return c.prefers_plain(8, plan, 8)

    assert not prefill(None)  # requests wait: every token counts, drafting 2 pays
    assert prefill(64)
    assert not prefill(1000)  # long requests: their luck evens out over the drain


def test_drafts_that_take_nothing_off_the_drain_gain_nothing():
    # Row 1 has the most tokens left and no drafts: whatever row 0 accepts, the drain is as long.
    gains = drain_gains([[0.9] * 4, [0.9] * 4], [4, 0], [30, 40], 4)
    assert gains == [0.0] * 5
    # With row 1 drafting too, the drain shortens (and each K gains more).
    both = drain_gains([[0.9] * 4, [0.9] * 4], [4, 4], [30, 40], 4)
    assert 0.0 < both[1] < both[2] < both[4]
