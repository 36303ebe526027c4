"""Reading paired timing ratios on a noisy machine: the median over rounds and its confidence interval.

Every side-by-side benchmark here reports a system's speed-up as the median over rounds of each round's ratio
(the rounds are paired: both systems ran in it). On the project's 2-core hosts identical LLMs differ by up to
~8% over 5-8 rounds, so a median alone cannot say whether a load is 3% slower; its interval can.
"""

from __future__ import annotations

import math


def median_ci(values: list[float], conf: float = 0.95) -> tuple[float, float]:
    """A confidence interval for the median of ``values`` that assumes nothing of their distribution: the
    median lies between the k-th smallest and the k-th largest value with probability at least
    1 - 2 P(Binomial(n, 1/2) <= k - 1); k is the largest for which that reaches ``conf``. With too few values
    for any k (n < 6 at 95%) the interval is their whole range, which then covers less than ``conf``."""
    x = sorted(values)
    n, k = len(x), 1
    below = lambda j: sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n  # P(Binomial(n, 1/2) <= j)
    while k < n // 2 and 1 - 2 * below(k) >= conf:
        k += 1
    return x[k - 1], x[n - k]
