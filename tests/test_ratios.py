"""The benchmarks' confidence interval for a median of paired ratios (benchmarks/ratios.py)."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from ratios import median_ci  # noqa: E402


def coverage(n: int, k: int) -> float:
    """P(the k-th smallest of n <= the median <= the k-th largest), written out for the cases below."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n


def test_interval_is_the_widest_order_statistics_reaching_95_percent():
    # n = 9: k = 2 covers 1 - 2 * 10/512 = 0.961, k = 3 only 1 - 2 * 46/512 = 0.820.
    assert coverage(9, 2) >= 0.95 > coverage(9, 3)
    assert median_ci([float(v) for v in range(9, 0, -1)]) == (2.0, 8.0)
    # n = 21: k = 6 covers 0.973, k = 7 0.922.
    assert coverage(21, 6) >= 0.95 > coverage(21, 7)
    assert median_ci([float(v) for v in range(1, 22)]) == (6.0, 16.0)


def test_too_few_values_give_their_whole_range():
    # n = 5: even min..max covers only 1 - 2/32 = 0.9375.
    assert median_ci([1.3, 0.9, 1.1, 1.0, 1.2]) == (0.9, 1.3)
    assert median_ci([1.0]) == (1.0, 1.0)
