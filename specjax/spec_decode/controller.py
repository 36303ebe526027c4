"""Choosing the speculation length every step, from measured step costs and each request's acceptance.

The controller picks, for a decoding step of ``R`` rows, one of

* ``K in 1..K_max`` drafts (rows draft up to their own cap),
* ``K = 0`` with the proposer attached (it keeps its device state in step; a draft
  head also drafts ahead for the next step), or
* a *detached* plain step: the target alone, exactly what plain decoding runs. Rows
  whose proposer state misses a detached step can never draft again (their draft
  KV lacks that token), so detaching is held back until it has won several steps
  in a row (``detach_after``).

It maximizes expected committed tokens per second,
``(R + sum_r E[accepted_r | cap_r]) / cost(bucket, K)``, where
``E[accepted | c] = sum_{j<=c} prod_{i<=j} alpha_i`` with per-position
conditional acceptance ``alpha_i`` estimated per request (a Beta-style mean with
the method's running average as prior, kept apart for greedy and sampled
requests), and ``cost`` is the wall time of that step kind: measured once per
bucket when warmup runs it, then an exponential moving average of measured
steps. A row's cap stops where one more draft adds less than ``min_gain``
expected tokens, so a request whose drafts keep failing stops drafting while
others go on; when no row would draft, the step is plain. Rows that have not
speculated for ``probe_every`` decoding steps get a one-draft probe so their
estimate can recover (a step that would be plain drafts one token for them).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Knobs of the adaptive controller (defaults are what ``"adaptive": true`` uses)."""

    prior_strength: float = 4.0
    """Pseudo-observations of the method's running average in each request's estimate."""
    initial_acceptance: float = 0.6
    """Per-position conditional acceptance assumed before any draft of the method was verified."""
    min_gain: float = 0.02
    """A row drafts position j only while it adds at least this many expected tokens."""
    cost_ema: float = 0.2
    """Weight of a new measurement in a step kind's cost estimate."""
    detach_after: int = 8
    """Consecutive decoding steps a detached plain step must win before the controller detaches."""
    probe_every: int = 32
    """A row that has not drafted for this many decoding steps drafts one token (0 = never probe)."""

    def __post_init__(self) -> None:
        for name in ("prior_strength", "min_gain", "cost_ema"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (0.0 < self.cost_ema <= 1.0):
            raise ValueError(f"cost_ema must be in (0, 1], got {self.cost_ema!r}")
        if not (0.0 <= self.initial_acceptance <= 1.0):
            raise ValueError(f"initial_acceptance must be in [0, 1], got {self.initial_acceptance!r}")
        for name in ("detach_after", "probe_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")


class AcceptanceStats:
    """Per-position counts: drafts verified at position i (``tried``) and accepted there (``accepted``)."""

    def __init__(self, k_max: int):
        self.tried = np.zeros(k_max, np.float64)
        self.accepted = np.zeros(k_max, np.float64)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verification: positions 1..min(num_accepted + 1, num_drafts) were reached."""
        reached = min(num_accepted + 1, num_drafts)
        self.tried[:reached] += 1
        self.accepted[:num_accepted] += 1


class CostModel:
    """Wall time per step kind ``(rows bucket, K, detached)``: warmup measurements, then an EMA of real steps."""

    def __init__(self, ema: float):
        self.ema = ema
        self.seconds: dict[tuple, float] = {}

    def observe(self, key: tuple, seconds: float) -> None:
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def get(self, key: tuple) -> float | None:
        return self.seconds.get(key)

    def estimate(self, rows: int, k: int, detached: bool) -> float:
        """The measured cost, or a conservative guess from the nearest measured kinds when unmeasured."""
        got = self.seconds.get((rows, k, detached))
        if got is not None:
            return got
        base = self.seconds.get((rows, 0, True)) or self.seconds.get((rows, 0, False))
        if base is None:
            return 1.0 + 0.25 * k  # nothing measured for this row bucket yet: unit costs, K costs extra
        # Unmeasured drafting steps are assumed expensive (a verify over K+1 tokens plus drafting).
        return base * (1.0 + 0.25 * k) if not detached else base


@dataclasses.dataclass
class Decision:
    """One step's plan."""

    k: int
    """Drafts per row at most (0 = no drafts)."""
    caps: np.ndarray
    """int32 [R]: each row's draft cap (<= k)."""
    detached: bool
    """Run the target alone (proposer state of these rows goes stale); only for proposers that sync."""


class SpeculationController:
    """Picks K and per-row caps each decoding step (see the module docstring)."""

    def __init__(self, k_max: int, config: ControllerConfig, *, can_detach: bool):
        self.k_max = k_max
        self.config = config
        self.can_detach = can_detach
        self.costs = CostModel(config.cost_ema)
        self.method_stats = {False: AcceptanceStats(k_max), True: AcceptanceStats(k_max)}  # sampled -> stats
        self._request_stats: dict[str, AcceptanceStats] = {}
        self._idle_steps: dict[str, int] = {}
        self._detach_votes = 0
        self.k_histogram = np.zeros(k_max + 1, np.int64)
        self.num_detached_steps = 0

    # ------------------------------------------------------------------ estimates

    def _prior(self, sampled: bool) -> np.ndarray:
        s = self.method_stats[sampled]
        init = self.config.initial_acceptance
        m = self.config.prior_strength
        return (s.accepted + m * init) / (s.tried + m)  # [K_max]

    def conditional_acceptance(self, request_id: str, sampled: bool) -> np.ndarray:
        """float64 [K_max]: the request's estimated P(accept draft i | drafts before it accepted)."""
        prior = self._prior(sampled)
        s = self._request_stats.get(request_id)
        if s is None:
            return prior
        m = self.config.prior_strength
        return (s.accepted + m * prior) / (s.tried + m)

    @staticmethod
    def expected_accepted(alpha: np.ndarray) -> np.ndarray:
        """[K_max + 1]: E[accepted | cap c] for c = 0..K_max given conditional rates ``alpha``."""
        return np.concatenate([[0.0], np.cumsum(np.cumprod(alpha))])

    def observe(self, request_id: str, sampled: bool, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.method_stats[sampled].observe(num_drafts, num_accepted)
        self._request_stats.setdefault(request_id, AcceptanceStats(self.k_max)).observe(num_drafts, num_accepted)

    def finish(self, request_id: str) -> None:
        self._request_stats.pop(request_id, None)
        self._idle_steps.pop(request_id, None)

    # ------------------------------------------------------------------ the choice

    def decide(self, rows: int, request_ids: list[str], sampled: list[bool], limits: np.ndarray,
               can_draft: np.ndarray) -> Decision:
        """Plan a decoding step of ``rows`` (its row bucket) with one entry per request.

        ``limits`` int [R]: the most drafts each row can commit (max_tokens / max_model_len) and, for host
        proposers, how many drafts were found; ``can_draft`` bool [R]: the row's proposer state is current.
        """
        cfg = self.config
        n = len(request_ids)
        limits = np.minimum(np.asarray(limits, np.int64), self.k_max) * np.asarray(can_draft, bool)
        gains = np.zeros((n, self.k_max + 1))  # [R, K_max + 1]: expected accepted drafts at each K
        caps_at = np.zeros((n, self.k_max + 1), np.int64)
        probing = np.zeros(n, bool)
        for i, (rid, smp) in enumerate(zip(request_ids, sampled)):
            alpha = self.conditional_acceptance(rid, smp)
            reach = np.cumprod(alpha)  # [K_max]: P(draft j accepted) = expected gain of position j
            useful = int(np.sum(np.cumprod(reach >= cfg.min_gain)))  # positions worth drafting
            probing[i] = bool(cfg.probe_every and limits[i] and self._idle_steps.get(rid, 0) >= cfg.probe_every)
            cap_row = min(max(useful, int(probing[i])), int(limits[i]))
            exp = self.expected_accepted(alpha)
            for k in range(self.k_max + 1):
                caps_at[i, k] = min(k, cap_row)
                gains[i, k] = exp[caps_at[i, k]]
        best_k, best_rate = 0, -1.0
        for k in range(self.k_max + 1):
            if k and not caps_at[:, k].any():
                continue
            rate = (n + gains[:, k].sum()) / self.costs.estimate(rows, k, False)
            if rate > best_rate:
                best_k, best_rate = k, rate
        detached = False
        if self.can_detach:
            plain_rate = n / self.costs.estimate(rows, 0, True)
            if plain_rate > best_rate:
                self._detach_votes += 1
                detached = self._detach_votes >= cfg.detach_after or not np.any(can_draft)
            else:
                self._detach_votes = 0
        k = 0 if detached else best_k
        if k == 0 and not detached and probing.any():
            k = 1  # a probe: one draft for the rows whose estimate has not been tested for a while
        caps = caps_at[:, k].astype(np.int32) if k else np.zeros(n, np.int32)
        for rid, c in zip(request_ids, caps):
            self._idle_steps[rid] = 0 if c else self._idle_steps.get(rid, 0) + 1
        self.k_histogram[k] += 1
        self.num_detached_steps += int(detached)
        return Decision(k=k, caps=caps, detached=detached)

    def as_dict(self) -> dict:
        """Metrics: how often each K was chosen for a decoding step, and the share of plain ones."""
        steps = int(self.k_histogram.sum())
        return {
            "k_histogram": self.k_histogram.tolist(),
            "plain_step_share": float(self.k_histogram[0] / steps) if steps else 0.0,
            "num_detached_steps": self.num_detached_steps,
        }
