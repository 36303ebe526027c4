"""What drafts are worth in a draining batch: no request waits, so the batch ends with its last row.

A step's drafts then count for how much they shorten the drain, not for their tokens. Per step, the drafts of
the rows with the most tokens left take that many tokens off it (:func:`drain_gains`). Over the drain, luck
matters too: each drafting row commits a random number of tokens a step, so the rows drift apart and the last
to finish ends later than a typical row (simulated, 64 tokens a row drafting 2 a step, accepted with conditional
probability 0.75 and 0.71: ~28.4 steps for one row, ~31.2 for the last of 8). Counting tokens alone, draft_model
at batch 8, T 0.8 on the shipped pair looked worth 1.03x the target alone at K = 2 and ran 0.94-0.95x plain in a
closed batch. Plain steps commit one token a row, so the drain they leave is exactly the most tokens any row has
left; drafting is charged the ratio of the two, with each row's steps to finish taken as a normal variable (a
renewal process: mean ``m / mu``, variance ``m var / mu^3`` for ``m`` tokens left at ``mu``, ``var`` tokens a
step) and their maximum by Clark's moment matching (C. E. Clark, "The greatest of a finite set of random
variables", Operations Research 9(2), 1961).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from specjax.spec_decode.acceptance import expected_accepted_sums

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def step_tokens(reach: list[float], drafts: int) -> tuple[float, float]:
    """(mean, variance) of the tokens a row commits in a step of ``drafts`` drafts, where ``reach[j]`` is
    P(draft j + 1 accepted): P(X >= 1) = 1, P(X >= j + 2) = reach[j]."""
    mean, second = 1.0, 1.0  # E[X], E[X^2] = sum_x (2x - 1) P(X >= x)
    for j in range(drafts):
        mean += reach[j]
        second += (2 * j + 3) * reach[j]
    return mean, max(second - mean * mean, 0.0)


def expected_max(moments: dict[tuple[float, float], int]) -> float:
    """E[max_i T_i] of independent normal variables given as {(mean, variance): how many} (Clark's
    approximation: the running maximum is taken as normal with matched moments; equal variables are taken
    together, exactly). Variables that cannot be the maximum (8 standard deviations, theirs and another's, below
    that one's mean) are skipped."""
    floor = max(m - 4.0 * math.sqrt(v) for m, v in moments)
    mean = var = None
    for (m, v), count in moments.items():
        if m + 4.0 * math.sqrt(v) < floor:
            continue
        if count > 1:  # the greatest of ``count`` equal normals: m + sd e_n, variance var s_n^2
            e, s2 = _iid_max(count)
            m, v = m + math.sqrt(v) * e, v * s2
        if mean is None:
            mean, var = m, v
            continue
        theta2 = var + v
        if theta2 <= 1e-12:
            mean = max(mean, m)
            continue
        theta = math.sqrt(theta2)
        a = (mean - m) / theta
        p, q = 0.5 * math.erfc(-a / _SQRT2), 0.5 * math.erfc(a / _SQRT2)  # Phi(a), Phi(-a)
        density = theta * _INV_SQRT_2PI * math.exp(-0.5 * a * a)
        first = mean * p + m * q + density
        second = (mean * mean + var) * p + (m * m + v) * q + (mean + m) * density
        mean, var = first, max(second - first * first, 0.0)
    return mean


@functools.lru_cache(maxsize=None)
def _iid_max(n: int) -> tuple[float, float]:
    """(mean, variance) of the greatest of ``n`` independent standard normal variables (numerically: its
    density is n phi(x) Phi(x)^(n-1))."""
    x, dx = np.linspace(-9.0, 9.0, 3601, retstep=True)
    integral = lambda y: float(dx * (y.sum() - 0.5 * (y[0] + y[-1])))  # trapezoids  # noqa: E731
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = np.concatenate([[0.0], np.cumsum(phi[1:] + phi[:-1]) * (0.5 * dx)])
    density = n * phi * np.clip(cdf, 0.0, 1.0) ** (n - 1)
    density /= integral(density)
    mean = integral(x * density)
    return mean, integral((x - mean) ** 2 * density)


def drain_gains(reach: list[list[float]], cap_row: list[int], remaining: list[int], k_max: int) -> list[float]:
    """Gains [k_max + 1] of a step of K drafts (row r drafting ``min(K, cap_row[r])``) in a draining batch: the
    tokens it takes off the drain beyond a plain step's one (see the module docstring), for K = 0..k_max.

    Per step: ``max(remaining) - max(remaining - accepted)``, with each drafting row at the drafting rows' mean
    expected accepted drafts (which of several similar rows ends last is chance, so the last row's own estimate
    is biased low: with it, draft_model at batch 8 ran 0.94-0.96x plain, against 0.975x counting tokens). Rows
    that finish early free no slot for anyone, and drafting for them alone makes each step dearer while the last
    row waits (ngram at batch 8: the rows whose lookups found drafts finished first, the batch then waited on two
    rows that never found any, 0.89-0.92x plain). Then one plus that (the drain's tokens per step) is scaled by
    the drain's expected length drafting at K with every row at its mean pace, over its expected length with
    each row's luck (<= 1; 1 for a single row); where the drafts take nothing off the drain, the gain is 0.
    """
    drafting = [r for r, c in enumerate(cap_row) if c > 0]
    if not drafting:
        return [0.0] + [math.nan] * k_max
    if len(cap_row) == 1:
        # One row: the drain is its own tokens, and a step takes off it just the drafts it accepts (a single
        # row has no luck against others). The same gains as below without the work: plans are made every few
        # steps at batch 1, where the general path took ~40 us of a ~2.8 ms step.
        return expected_accepted_sums(reach, cap_row, k_max)
    n = len(drafting)
    mean_reach = [sum(reach[r][j] for r in drafting) / n for j in range(k_max)]
    last_drafting = max(remaining[r] for r in drafting)
    last_other = max((m for m, c in zip(remaining, cap_row) if c <= 0), default=-math.inf)
    last = max(last_drafting, last_other)
    accepted = expected_accepted_sums(reach, cap_row, k_max)  # summed over the drafting rows
    rows: dict[tuple[int, int], int] = {}
    for r in drafting:
        key = (remaining[r], cap_row[r])
        rows[key] = rows.get(key, 0) + 1
    gains = [0.0]
    for k in range(1, k_max + 1):
        per_step = last - max(last_drafting - accepted[k] / n, last_other)
        # Drafts that take nothing off the drain (a row without drafts ends it) gain nothing; their luck
        # (<= 1) would only lower that, and is the costly part of a plan (ngram at batch 8: most plans, where
        # a last row's lookup found nothing).
        gains.append((1.0 + per_step) * _luck(mean_reach, rows, k, last_other) - 1.0 if per_step > 0 else 0.0)
    return gains


def _luck(mean_reach: list[float], rows: dict[tuple[int, int], int], k: int, last_other: float) -> float:
    """max_r E[steps of row r] / E[max_r steps of row r] drafting at K, for drafting rows given as
    {(tokens left, cap): how many} (rows that do not draft take exactly their tokens left)."""
    moments: dict[tuple[float, float], int] = {}
    paces: dict[int, tuple[float, float]] = {}
    for (m, c), count in rows.items():
        d = min(k, c)
        if d not in paces:
            paces[d] = step_tokens(mean_reach, d)
        mu, var = paces[d]
        key = (m / mu, m * var / mu ** 3)
        moments[key] = moments.get(key, 0) + count
    if last_other > -math.inf:
        key = (float(last_other), 0.0)
        moments[key] = moments.get(key, 0) + 1
    typical = max(m for m, _ in moments)
    longest = expected_max(moments)
    return min(1.0, typical / longest) if longest > 0 else 1.0
