"""Latency percentiles in fixed memory (specjax.metrics.LogHistogram) against numpy's nearest-rank percentile."""

import numpy as np
import pytest

from specjax.metrics import LatencyStats, LogHistogram


def test_percentiles_match_nearest_rank_within_half_a_bin():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.lognormal(np.log(3e-3), 1.0, 20_000), np.zeros(500), rng.uniform(1, 30, 300)])
    rng.shuffle(values)
    hist = LogHistogram()
    for v in values:
        hist.observe(float(v))
    half_bin = 10 ** (0.5 / hist.per_decade) - 1  # 0.58%
    for q in (1, 2, 10, 50, 90, 95, 99, 99.9, 100):
        want = np.percentile(values, q, method="inverted_cdf")
        got = hist.percentile(q)
        if want == 0:
            assert got == 0.0, q
        else:
            assert abs(got / want - 1) <= half_bin * 1.0001, (q, got, want)


def test_counts_are_weights_and_memory_does_not_grow():
    a, b = LogHistogram(), LogHistogram()
    size = a.counts.nbytes
    for v, n in ((0.01, 7), (0.2, 1), (0.0, 3), (5e-4, 1_000_000)):
        a.observe(v, n)
        for _ in range(min(n, 7)):
            b.observe(v)
    assert a.counts.nbytes == size and a.total == 1_000_011
    assert a.percentile(50) == pytest.approx(5e-4, rel=0.006)
    assert a.percentile(100) == pytest.approx(0.2, rel=0.006)
    b.observe(5e-4, 1_000_000 - 7)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert LogHistogram().percentile(50) == 0.0


def test_values_outside_the_range_land_in_the_end_bins():
    hist = LogHistogram(low=-3, high=1, bins_per_decade=10)
    hist.observe(1e-9)
    hist.observe(1e6)
    assert hist.counts[1] == 1 and hist.counts[-1] == 1
    with pytest.raises(ValueError, match="bins_per_decade"):
        LogHistogram(bins_per_decade=0)


def test_latency_stats_split_a_step_among_its_tokens():
    stats = LatencyStats()
    stats.observe_tokens(0.5, 3, first=True)  # first token: TTFT 0.5 s; the two committed with it: ITL 0
    stats.observe_tokens(0.03, 3, first=False)  # three tokens in one 30 ms step: 10 ms each
    assert stats.ttft.total == 1 and stats.itl.total == 5
    out = stats.as_dict()
    assert out["ttft_p50_s"] == pytest.approx(0.5, rel=0.006)
    assert out["itl_p50_s"] == pytest.approx(0.01, rel=0.006)  # ranks: 0, 0, 10 ms, 10 ms, 10 ms
    assert out["itl_p99_s"] == pytest.approx(0.01, rel=0.006)
    stats.observe_tokens(0.03, 0, first=False)
    assert stats.itl.total == 5
