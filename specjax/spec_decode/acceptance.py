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

    def __init__(self, k_max: int):
        self.tried = [0] * k_max
        self.accepted = [0] * k_max
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
