"""The acceptance the controller plans with: each request's per-position estimate, and the method's behind it.

A request's conditional acceptance at position i is a Beta-style mean of its own counts with the method's
running average as prior (weighing ``strength`` observations, learned from finished requests: see
:func:`~specjax.spec_decode.acceptance.prior_strength`); greedy and sampled requests are kept apart. Plain Python
lists throughout (see :class:`~specjax.spec_decode.acceptance.AcceptanceStats`)."""

from __future__ import annotations

import collections
import itertools
import operator

from specjax.spec_decode.acceptance import AcceptancePrior, AcceptanceStats, prior_strength, upper_bound
from specjax.spec_decode.controller_config import LEARN_DRAFTS_PER_REQUEST, ControllerConfig


class AcceptanceEstimates:
    """Acceptance counts of the method and of each running request, and the estimates drawn from them."""

    def __init__(self, k_max: int, config: ControllerConfig, prior: AcceptancePrior | None = None):
        self.k_max = k_max
        self.config = config
        self.method_stats = {False: AcceptanceStats(k_max), True: AcceptanceStats(k_max)}  # sampled -> stats
        self.primed = {False: False, True: False}
        """sampled -> the method's stats start from a measured prior (``acceptance.json``)."""
        for smp in (False, True):
            counts = None if prior is None else prior.counts(smp)
            if counts and counts[1][0] > 0:
                scale = min(1.0, config.prior_drafts / counts[1][0])
                self.method_stats[smp].seed([a * scale for a in counts[0]], [t * scale for t in counts[1]])
                self.primed[smp] = True
        self.requests: dict[str, AcceptanceStats] = {}
        """Each running request's own counts (from its first verified draft)."""
        self.strength = {False: config.prior_strength, True: config.sampled_prior_strength}
        """sampled -> the observations the method's average weighs in a request's estimate (see max_prior_strength)."""
        self.learned_from = {False: set(), True: set()}
        """sampled -> requests with LEARN_DRAFTS_PER_REQUEST drafts verified (up to learn_requests of them)."""
        self._finished = {False: collections.deque(maxlen=64), True: collections.deque(maxlen=64)}  # sampled ->
        # finished requests' (accepted, tried) drafts
        self._priors: dict[bool, tuple[int, list[float], list[float]]] = {}  # sampled -> (version, prior, reach)
        self._optimistic: dict[bool, tuple[tuple[int, float], list[float]]] = {}  # sampled -> (key, reach)

    def prior(self, sampled: bool) -> tuple[list[float], list[float]]:
        """([K_max] the method's conditional acceptance per position, [K_max] its running product), cached."""
        s = self.method_stats[sampled]
        cached = self._priors.get(sampled)
        if cached is None or cached[0] != s.version:
            init, m = self.config.initial_acceptance, self.config.prior_strength
            prior = [(a + m * init) / (t + m) for a, t in zip(s.accepted, s.tried)]
            cached = self._priors[sampled] = (s.version, prior, list(itertools.accumulate(prior, operator.mul)))
        return cached[1], cached[2]

    def conditional(self, request_id: str, sampled: bool) -> list[float] | None:
        """[K_max]: the request's estimated P(accept draft i | drafts before it accepted); None: no draft of it
        verified yet (the method's prior stands)."""
        s = self.requests.get(request_id)
        if s is None:
            return None
        m = self.strength[sampled]
        return [(a + m * p) / (t + m) for a, t, p in zip(s.accepted, s.tried, self.prior(sampled)[0])]

    def reach(self, request_id: str, sampled: bool) -> list[float]:
        """[K_max]: the request's estimated P(draft j accepted) (a product of its conditional acceptances)."""
        alpha = self.conditional(request_id, sampled)
        return self.prior(sampled)[1] if alpha is None else list(itertools.accumulate(alpha, operator.mul))

    def detach_reach(self, request_id: str, sampled: bool) -> list[float]:
        """[K_max]: :meth:`reach` with each position's conditional acceptance no lower than the method's unless the
        request's own drafts put it below with confidence (``detach_z``)."""
        s = self.requests.get(request_id)
        if s is None:
            return self.prior(sampled)[1]
        z = self.config.detach_z
        alpha = [max(x, min(p, upper_bound(a, t, z))) for x, p, a, t in
                 zip(self.conditional(request_id, sampled), self.prior(sampled)[0], s.accepted, s.tried)]
        return list(itertools.accumulate(alpha, operator.mul))

    def observe(self, request_id: str, sampled: bool, num_drafts: int, num_accepted: int) -> None:
        """One verification of the request's ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        if num_drafts <= 0:
            return
        self.method_stats[sampled].observe(num_drafts, num_accepted)
        own = self.requests.get(request_id)
        if own is None:
            own = self.requests[request_id] = AcceptanceStats(self.k_max, sampled=sampled)
        own.observe(num_drafts, num_accepted)
        sources = self.learned_from[sampled]
        if len(sources) < self.config.learn_requests and own.tried[0] >= LEARN_DRAFTS_PER_REQUEST:
            sources.add(request_id)

    def finish(self, request_id: str) -> None:
        """The request ended: its counts go, and teach the prior's strength."""
        s = self.requests.pop(request_id, None)
        if s is not None and s.sampled is not None:
            done = self._finished[s.sampled]
            done.append((sum(s.accepted), sum(s.tried)))
            cfg = self.config
            initial = cfg.sampled_prior_strength if s.sampled else cfg.prior_strength
            self.strength[s.sampled] = prior_strength(list(done), cfg.prior_strength, cfg.max_prior_strength,
                                                      initial)

    def learning(self, sampled: bool) -> bool:
        """Too few of the method's drafts (``learn_drafts``), or of requests (``learn_requests``), verified yet to
        trust its acceptance prior."""
        if self.method_stats[sampled].tried[0] < self.config.learn_drafts:
            return True
        # A measured prior stands for many requests' drafts.
        return not self.primed[sampled] and len(self.learned_from[sampled]) < self.config.learn_requests

    def optimistic_reach(self, sampled: bool) -> list[float]:
        """[K_max]: P(draft j accepted) with each position's conditional acceptance at the Wilson upper bound
        (``learn_z``) of the method's verified drafts there (1 where none was verified)."""
        s, z = self.method_stats[sampled], self.config.learn_z
        key = (s.version, z)
        cached = self._optimistic.get(sampled)
        if cached is not None and cached[0] == key:  # (a plan asks up to twice)
            return cached[1]
        reach = list(itertools.accumulate((upper_bound(a, t, z) for a, t in zip(s.accepted, s.tried)),
                                          operator.mul))
        self._optimistic[sampled] = (key, reach)
        return reach
