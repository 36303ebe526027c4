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


def test_sampled_requests_weigh_the_method_more_than_greedy_ones_until_enough_finished():
    cfg = ControllerConfig()
    c = SpeculationController(4, cfg, can_detach=False)
    for sampled in (False, True):
        for i in range(MIN_REQUESTS_FOR_SPREAD - 1):  # finished requests: not yet enough for their spread
            for _ in range(10):
                c.observe(f"old{i}{sampled}", sampled, 4, 3)  # 3 of 4 accepted: position 1 always
            c.finish(f"old{i}{sampled}")
        for _ in range(3):
            c.observe(f"new{sampled}", sampled, 4, 0)  # its first three drafts rejected
    for sampled, m in ((False, cfg.prior_strength), (True, cfg.sampled_prior_strength)):
        method = c.conditional_acceptance("other", sampled)[0]  # the method's estimate (no drafts of its own)
        assert c.conditional_acceptance(f"new{sampled}", sampled)[0] == pytest.approx(m * method / (3 + m))
    assert c.as_dict()["prior_strength"] == {"greedy": cfg.prior_strength, "sampled": cfg.sampled_prior_strength}
    for _ in range(10):
        c.observe("last", True, 4, 0)
    c.finish("last")  # the 8th sampled request: their spread decides (they differ a lot: 0.75 vs 0)
    assert c.as_dict()["prior_strength"]["sampled"] == cfg.prior_strength


# --------------------------------------------------------------------------- a proposer's measured prior

def _prior(greedy, sampled=None, target="builtin:target"):
    from specjax.spec_decode.acceptance import AcceptancePrior

    return AcceptancePrior(target=target, greedy=greedy, sampled=sampled)


def test_a_prior_round_trips_through_its_file_and_bad_counts_name_the_field(tmp_path):
    from specjax.spec_decode.acceptance import PRIOR_FILE, AcceptancePrior, load_prior

    prior = _prior(((30, 20), (40, 30)), ((10, 2), (20, 10)))
    assert AcceptancePrior.from_json(prior.to_json(command="x")) == prior
    for greedy in [((5, 1), (4, 1)),  # accepted > tried
                   ((30, 20), (40, 31)),  # position 2 reached more often than position 1 accepted
                   ((1,), (2, 1)), ((), ()), ((1.5,), (2,)), ((-1,), (2,))]:
        with pytest.raises(ValueError, match="greedy"):
            _prior(greedy)
    with pytest.raises(ValueError, match="sampled"):
        _prior(((1,), (2,)), ((3,), (2,)))
    for bad in ('{"target": "builtin:target", "greedy": {"accepted": [1]}}',
                '{"target": "builtin:target", "greedy": {"accepted": 5, "tried": 4}}', "[]", "{"):
        (tmp_path / PRIOR_FILE).write_text(bad)
        with pytest.raises(ValueError, match=PRIOR_FILE):
            load_prior(tmp_path, "builtin:target")


def test_a_prior_applies_only_to_the_target_it_was_measured_with(tmp_path):
    from specjax.builtin import resolve_model
    from specjax.spec_decode.acceptance import PRIOR_FILE, load_prior

    assert load_prior(tmp_path, "builtin:target") is None  # no file
    (tmp_path / PRIOR_FILE).write_text(_prior(((3,), (4,))).to_json())
    assert load_prior(tmp_path, resolve_model("builtin:target")).greedy == ((3,), (4,))  # by path or name
    assert load_prior(tmp_path, "builtin:smollm2") is None
    (tmp_path / PRIOR_FILE).write_text(_prior(((3,), (4,)), target="builtin:no_such_model").to_json())
    assert load_prior(tmp_path, "builtin:target") is None  # a name this install cannot resolve: not this target
    # The shipped draft and heads carry theirs, for the shipped target.
    for name in ("draft", "eagle3", "smollm2_eagle3"):
        target = "builtin:smollm2" if name.startswith("smollm2") else "builtin:target"
        assert load_prior(resolve_model(f"builtin:{name}"), target).sampled is not None


def test_a_prior_ends_learning_and_weighs_prior_drafts_at_position_one():
    c = SpeculationController(4, ControllerConfig(prior_drafts=32), can_detach=True,
                              prior=_prior(((320, 160), (640, 320))))
    assert not c.estimates.learning(False) and c.estimates.learning(True)  # no sampled counts: those are learned
    stats = c.estimates.method_stats[False]
    assert stats.tried[:2] == [32, 16] and stats.accepted[:2] == [16, 8]
    assert c.conditional_acceptance("new", False)[:2] == pytest.approx([(16 + 4 * 0.6) / 36, (8 + 4 * 0.6) / 20])
    assert c.as_dict()["acceptance_prior"] == {"greedy": True, "sampled": False}
    # Fewer measured drafts than prior_drafts weigh as many as there are, and learning waits for the rest.
    few = SpeculationController(4, ControllerConfig(prior_drafts=32), can_detach=True, prior=_prior(((5,), (10,))))
    assert few.estimates.method_stats[False].tried[0] == 10 and few.estimates.learning(False)


def test_with_a_poor_prior_the_first_request_is_prefilled_detached_on_warmup_costs():
    # Warmup timed every kind (K drafts cost 1 + 0.1 K, the target alone 0.9); nothing ran for real yet.
    # Without a prior the first requests learn the method (prefilled attached); with one measured at 0.1 per
    # position, drafting cannot pay, and a prefill detaches on warmup's costs.
    def controller(prior):
        c = SpeculationController(4, ControllerConfig(), can_detach=True, prior=prior)
        for k in range(5):
            c.costs.observe((1, k, False, False), 1.0 + 0.1 * k, warmup=True)
        c.costs.observe((1, 0, True, False), 0.9, warmup=True)
        return c, c.row_caps(["new"], [False], np.asarray([4]), np.asarray([True]))

    c, new = controller(None)
    assert c.estimates.learning(False) and not c.prefers_plain(1, new, 1)
    c, new = controller(_prior(((10, 1, 0, 0), (100, 10, 1, 0))))
    assert not c.estimates.learning(False) and c.prefers_plain(1, new, 1)
    # A good prior drafts from the first decoding step, at the K its acceptance and the costs make best.
    c, new = controller(_prior(((95, 90, 85, 80), (100, 95, 90, 85))))
    assert not c.prefers_plain(1, new, 1)
    d = c.decide(1, new, can_draft=np.asarray([True]))
    assert d.k >= 3 and not d.detached  # K = 4, or its neighbour, explored while no kind ran for real


def test_an_llm_starts_its_controller_from_the_prior_its_draft_ships_for_that_target(tmp_path):
    import shutil

    import specjax
    from specjax.builtin import STDLIB_SPEC, resolve_model

    kw = dict(speculative_config=dict(STDLIB_SPEC), max_model_len=128, max_num_seqs=1, warmup=False)
    llm = specjax.LLM("builtin:target", **kw)
    assert llm.get_metrics()["acceptance_prior"] == {"greedy": True, "sampled": True}
    assert not llm.engine.controller.estimates.learning(False)
    # The same weights under another path are another target as far as the prior knows: it learns.
    copy = shutil.copytree(resolve_model("builtin:target"), tmp_path / "target")
    other = specjax.LLM(str(copy), **kw)
    assert other.get_metrics()["acceptance_prior"] == {"greedy": False, "sampled": False}
    assert other.engine.controller.estimates.learning(False)
