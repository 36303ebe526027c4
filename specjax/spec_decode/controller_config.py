"""The adaptive controller's knobs (:class:`ControllerConfig`; the controller itself is in
:mod:`specjax.spec_decode.controller`)."""

from __future__ import annotations

import dataclasses
import math

LEARN_DRAFTS_PER_REQUEST = 4
"""Verified drafts after which a request counts towards ``learn_requests``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Knobs of the adaptive controller (defaults are what ``"adaptive": true`` uses)."""

    prior_strength: float = 4.0
    """Pseudo-observations of the method's running average in each request's estimate, at least (see
    ``max_prior_strength``)."""
    max_prior_strength: float = 64.0
    """At most this many: between the two, the weight the spread of the last 64 finished requests' acceptance
    beyond chance gives (:func:`~specjax.spec_decode.acceptance.prior_strength`). Sampled drafts are noisy: the
    shipped EAGLE-3 head at batch 1, T 0.8 saw requests' estimates swing from 0.3 to 0.8 at position 1 (the
    method's 0.68) and detached requests whose drafts paid 1.2x the target alone."""
    sampled_prior_strength: float = 32.0
    """The weight for sampled requests until ``MIN_REQUESTS_FOR_SPREAD`` of them finished (greedy ones start at
    ``prior_strength``). A sampled request's acceptance differs from another's little beyond chance, a greedy
    one's a lot: over 24 held-out prompts x 128 tokens on the shipped pair (fixed K = 4, traces scored offline),
    predicting each step's acceptance per position from the request's earlier steps, the log-loss was least at
    32-256 pseudo-observations for T 0.8 (4: 0.017-0.021 nats an observation worse than the method's average
    alone), at 2-4 for greedy (0.05-0.085 better than it; ``benchmarks/bench_acceptance_weight.py``). With 4, an
    eagle3 request at batch 1, T 0.8 whose first drafts failed drafted K = 1 for most of its steps (its estimate
    at position 1 0.33-0.64, the method's 0.68), where fixed K = 3 is the fastest."""
    initial_acceptance: float = 0.6
    """Per-position conditional acceptance assumed before any draft of the method was verified (and no measured
    prior came with the proposer)."""
    prior_drafts: float = 32.0
    """Drafts a proposer's measured acceptance prior (``acceptance.json``,
    :class:`~specjax.spec_decode.acceptance.AcceptancePrior`) counts as at position 1 in the method's running
    average (its counts scaled down to this; the later positions alike): as many as learning asks for
    (``learn_drafts``), so the controller starts from it, and few enough that the workload's own drafts soon
    outweigh it."""
    min_gain: float = 0.02
    """A row drafts position j only while it adds at least this many expected tokens."""
    cost_window: int = 32
    """A step kind's relation to its batch size's level is the mean of its first this-many real measurements; past
    them only a step right after another kind moves it (see ``CostModel``). Also how many warmup, planning and
    between-step times are kept. (A median of the last 8 steps, before the level, read ngram at batch 1 K = 4
    1.26x dearer than K = 3 on steps within ~5% of each other, and drafted K = 3 in a third of drafting steps.)"""
    cost_max_age: int = 64
    """A neighbouring drafting K not measured in this many real steps of its bucket is explored (0 = never; see
    ``explore_margin``), and the target alone re-timed in a shadow step (see ``shadow_band``): a kind measured
    in a slow moment, or whose relation to the others moved, is measured again."""
    explore_margin: float = 0.1
    """A neighbouring K measured in ``RELATION_MIN_STEPS`` real steps is explored again (``cost_max_age``) only
    while its expected tokens per second are within this share of the chosen K's. Where the rows' caps shrink (a
    request's last tokens) the kinds below are far worse: exploring each as it fell due, eagle3 at batch 1 with
    q8_0 drafts took 2312 steps for 120 requests of 64 tokens where fixed K = 4 took 2190 (2201 with the margin).
    Fewer measurements may be one slow moment: draft_model at batch 1 put K = 3 11% above K = 4 from two steps,
    where a run of K = 3 costs ~10% less, and never tried it again."""
    min_speedup: float = 1.1
    """Drafting must promise this many times the expected tokens per second of a plain step: the rates leave
    out measurement noise and the proposer's prefill, and "never slower than plain" wants a margin."""
    learn_drafts: int = 32
    """Drafts of the method (greedy and sampled apart) verified before its prior may stop drafting: until
    then the controller drafts to learn the acceptance, at the K that is best with the acceptance at its
    optimistic bound (``learn_z``), and never prefills detached, as long as drafting could pay at that bound."""
    learn_requests: int = 4
    """Learning lasts, and ends early (``learn_z``), only until this many requests had
    ``LEARN_DRAFTS_PER_REQUEST`` drafts verified; where the bound cannot pay before that, a request with fewer
    learns at K = 1. One request's drafts are not independent: the shipped EAGLE-3 head at T 0.8 saw its first
    8 sampled drafts, all of one prompt, rejected, and every later request was prefilled detached (0.97x
    plain, fixed K = 4 1.09x); with two requests, its first 40 drafts read 0.43 at position 1 (0.73 over four)
    and the same happened (0.96x)."""
    learn_z: float = 2.0
    """While learning, each position's acceptance is taken at its Wilson upper bound, this many standard
    deviations above the verified drafts (1 before any): when even that cannot pay, learning ends early (a
    head whose first 8 drafts all fail is bounded at 0.33, after 16 at 0.2)."""
    detach_after: int = 8
    """Consecutive decoding steps a detached plain step must win before the controller detaches."""
    detach_z: float = 2.0
    """Detaching (irreversible) takes each row's acceptance no lower than the method's where the row's own
    drafts do not put it below with confidence: their Wilson upper bound this many standard deviations up.
    Without it a few unlucky sampled drafts detached whole requests: eagle3 at batch 1, T 0.8 on the shipped
    pair, each request accepting 0.64-1.0 of its first drafts, ran 27% of its steps detached. 0: the row's
    estimate alone."""
    probe_every: int = 32
    """A row that has not drafted for this many decoding steps drafts one token (0 = never probe); the wait
    doubles after each probe of the same request."""
    replan_every: int = 8
    """A decision without drafts serves this many decoding steps of the same rows (0 or 1 = plan every step),
    twice as many for each such decision in a row for the same rows (up to 8x): without drafts nothing it rests
    on changes but the step costs, which move slowly, and planning is host work a plain step pays over plain
    decoding (0.3-0.4 ms of a 3.6 ms step on the shipped target with numpy arithmetic). It ends sooner where a
    probe falls due, while detaching is being voted on, and when the rows change; where only a host lookup's
    misses kept the step from drafting, it holds only while such lookups seldom hit (``min_lookup_hits``)."""
    draft_replan_every: int = 4
    """A decision with drafts serves this many decoding steps of the same rows (0 or 1 = plan every step), twice as
    many for each plan in a row that made the same decision (up to 4x; for a new request too), each row drafting up
    to its cap, unless it probes, explores a neighbouring K, learns the method's acceptance, detaching is being voted
    on, or the drafts of several rows come from a host lookup (whether verifying what a lookup finds pays changes
    every step: ngram at batch 8 held such plans at 0.89x plain; one row's held step verifies what its lookup
    finds, up to the cap, or runs plain, and a plan whose lookup found fewer drafts or none holds the same
    decision, doubling alike): planning is host work (5-13% of a drafting step on the shipped target with numpy
    arithmetic), and a row's estimate moves little in a few steps."""
    explore_every: int = 16
    """Of the new requests whose prefill the controller would run detached, one per this many batches' worth
    (x 32 at batch 32) is prefilled attached and probes one draft in its first decoding step (0 = never): else
    the method's estimate sees no more drafts once prefills detach, and a low early estimate stands for good
    (eagle3 at batch 1, T 0.8: 0.90x plain, fixed K = 2 1.04x). Per batch, as at batch 32 every row's steps
    run attached until the vote detaches again (one per 16 prefill decisions: 0.95x plain, none 0.99x)."""
    min_lookup_hits: float = 0.1
    """A plan kept plain only because a host lookup found no drafts is held only while fewer than this share of
    recent such lookups found any (ngram at batch 1: about half of greedy lookups hit, ~5% at T 0.8), or, with
    several rows, while their lookups saved less step time per plan than a full plan costs
    (:attr:`SpeculationController.lookup_saving`)."""
    max_planning_share: float = 0.01
    """Where only a host lookup's misses keep steps plain and lookups seldom hit, such a plan is held for
    ``replan_every`` steps, and twice as long for each such plan in a row, whichever requests it plans for (up to
    8x; a probe falling due does not end it), while the controller's planning costs more than this share of a
    plain step (ngram at batch 1, T 0.8 on the shipped
    target: a plan with its lookup every 8 steps, ~0.33 ms each in a ~2 ms step, read 0.93-0.97x plain)."""

    shadow_band: float = 1.5
    """Where the target alone (a detached step) could be chosen but was not timed in the bucket's last
    ``cost_max_age`` real steps (twice as many for each measurement behind its cost, up to 8x; never timed: its
    cost is warmup's scaled guess), and the kind a plan chose promises less than this many times its tokens per
    second, the engine times it on the step's rows right after that step, twice, in a *shadow* step that writes
    nothing (0 = never). Warmup's all-padding steps and the scale the drafting kinds' real steps put on them had
    put the target alone 50% above its cost: eagle3 at batch 8 greedy on the shipped pair read 3.4 ms where it
    takes 2.2 and drafted at 0.85x plain. Once measured, its relation to the kinds that run is kept (see
    ``CostModel``), and shadow steps every 64 steps took eagle3 at batch 1, T 0.8 ~1.6% of its run."""

    def __post_init__(self) -> None:
        for name in ("prior_strength", "sampled_prior_strength", "max_prior_strength", "prior_drafts", "min_gain",
                     "min_speedup", "explore_margin", "learn_z", "detach_z", "min_lookup_hits", "max_planning_share",
                     "shadow_band"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.max_prior_strength < max(self.prior_strength, self.sampled_prior_strength):
            raise ValueError(f"max_prior_strength must be >= prior_strength ({self.prior_strength}) and "
                             f"sampled_prior_strength ({self.sampled_prior_strength}), got "
                             f"{self.max_prior_strength!r}")
        if not (0.0 <= self.initial_acceptance <= 1.0):
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance!r}")
        for name, low in (("cost_window", 1), ("cost_max_age", 0), ("learn_drafts", 0), ("learn_requests", 1),
                          ("detach_after", 0),
                          ("probe_every", 0), ("replan_every", 0), ("draft_replan_every", 0), ("explore_every", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
