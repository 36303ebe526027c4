"""Per-position draft acceptance counts and their confidence bounds (the adaptive controller's evidence)."""

from __future__ import annotations

import math


def upper_bound(accepted: int, tried: int, z: float) -> float:
    """The Wilson score upper bound, ``z`` standard deviations up, of an acceptance rate seen as ``accepted`` of
    ``tried`` (1 when nothing was tried)."""
    if not tried:
        return 1.0
    p, t = accepted / tried, tried
    return min(1.0, (p + z * z / (2 * t) + z * math.sqrt(p * (1 - p) / t + z * z / (4 * t * t))) / (1 + z * z / t))


class AcceptanceStats:
    """Per-position counts: drafts verified at position i (``tried``) and accepted there (``accepted``).

    Python lists, as is the controller's arithmetic on them: it runs between steps on a few rows, where each
    numpy call costs microseconds (several times its microbenchmark right after a step has streamed the
    weights through the caches) and a plan made ~15 of them."""

    def __init__(self, k_max: int, sampled: bool | None = None):
        self.tried = [0] * k_max
        self.accepted = [0] * k_max
        self.sampled = sampled
        """A request's counts: it samples (None: not a request's)."""
        self.version = 0
        """Counts the observations (a cache key for values derived from the counts)."""

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verification: positions 1..min(num_accepted + 1, num_drafts) were reached."""
        tried, accepted = self.tried, self.accepted
        for i in range(min(num_accepted + 1, num_drafts)):
            tried[i] += 1
        for i in range(num_accepted):
            accepted[i] += 1
        self.version += 1


def expected_accepted_sums(reach: list[list[float]], cap_row: list[int], k_max: int) -> list[float]:
    """[k_max + 1]: for K = 0..k_max, the expected accepted drafts summed over rows, row r drafting
    ``min(K, cap_row[r])`` with P(draft j + 1 accepted) = ``reach[r][j]``."""
    sums = [0.0] * (k_max + 1)
    for row, cap in zip(reach, cap_row):
        if cap <= 0:
            continue
        total = 0.0
        for j in range(k_max):
            if j < cap:
                total += row[j]
            sums[j + 1] += total
    return sums


MIN_REQUESTS_FOR_SPREAD = 8
"""Finished requests (with drafts verified) before their spread sets the prior's strength."""


def prior_strength(requests: list[tuple[int, int]], floor: float, ceiling: float) -> float:
    """How many pseudo-observations of the method's average acceptance a request's own estimate should weigh,
    from finished requests' (accepted, tried) drafts (empirical Bayes, by moments): chance alone spreads their
    rates by about ``p (1 - p) / tried`` around the method's ``p``; the spread beyond that, ``s^2``, is how much
    requests really differ, and a Beta prior with that spread weighs ``p (1 - p) / s^2 - 1`` observations.
    Within ``[floor, ceiling]``; ``floor`` until ``MIN_REQUESTS_FOR_SPREAD`` requests."""
    rows = [(a, t) for a, t in requests if t > 0]
    if len(rows) < MIN_REQUESTS_FOR_SPREAD:
        return floor
    p = sum(a for a, _ in rows) / sum(t for _, t in rows)
    if not 0.0 < p < 1.0:
        return ceiling  # every draft accepted, or none: requests do not differ
    spread = sum((a / t - p) ** 2 for a, t in rows) / (len(rows) - 1)
    chance = p * (1.0 - p) * sum(1.0 / t for _, t in rows) / len(rows)
    if spread <= chance:
        return ceiling
    return min(ceiling, max(floor, p * (1.0 - p) / (spread - chance) - 1.0))
