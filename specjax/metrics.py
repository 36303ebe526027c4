"""Speculative-decoding and latency statistics (what ``LLM.get_metrics`` reports)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.spec_decode.acceptance import AcceptanceStats


@dataclasses.dataclass
class SpecDecodeStats:
    """Counts over verified drafts. A "draft" is one row of one step with at least one draft token."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    positions: AcceptanceStats = dataclasses.field(init=False)
    """Per position: drafts verified there with every draft before them accepted (``tried``) and accepted
    (so ``accepted_per_position / verified_per_position`` is each position's conditional acceptance)."""
    num_spec_steps: int = 0
    """Engine steps that verified at least one draft."""

    def __post_init__(self) -> None:
        self.positions = AcceptanceStats(self.num_speculative_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One row's verification: ``num_accepted_tokens`` of ``num_draft_tokens`` drafts were kept."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.positions.observe(num_draft_tokens, num_accepted_tokens)

    def as_dict(self) -> dict:
        drafted = self.num_draft_tokens
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            # vLLM's definition: the bonus/recovered token counts, so a draft with nothing accepted scores 1.
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "accepted_per_position": list(self.positions.accepted),
            "verified_per_position": list(self.positions.tried),
            "num_spec_steps": self.num_spec_steps,
        }


class LogHistogram:
    """Counts of non-negative values in logarithmic bins: percentiles in fixed memory.

    A serving process or a batch job commits billions of tokens; one float per token (the list this replaced)
    grew without bound and made every percentile a sort of all of them. Bins are ``1 / bins_per_decade`` of a
    decade wide from ``10**low`` to ``10**high`` (values outside land in the end bins), and zero has its own
    bin, so a percentile is within half a bin of the nearest-rank value: 0.58% relative at 200 per decade.
    """

    def __init__(self, low: int = -7, high: int = 5, bins_per_decade: int = 200):
        if not (isinstance(bins_per_decade, int) and bins_per_decade > 0 and low < high):
            raise ValueError(f"bins_per_decade must be an int > 0 and low < high, got {bins_per_decade!r}, "
                             f"{low!r}, {high!r}")
        self.low, self.per_decade = low, bins_per_decade
        self.counts = np.zeros(1 + (high - low) * bins_per_decade, np.int64)  # [1 + bins]: bin 0 holds zeros
        self.total = 0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (seconds, >= 0)."""
        if count <= 0:
            return
        if value > 0.0:
            i = int((math.log10(value) - self.low) * self.per_decade) + 1
            i = min(max(i, 1), len(self.counts) - 1)
        else:
            i = 0
        self.counts[i] += count
        self.total += count

    def percentile(self, q: float) -> float:
        """The nearest-rank ``q``-th percentile (0 < q <= 100), as its bin's geometric centre; 0.0 when empty."""
        if not self.total:
            return 0.0
        rank = max(1, math.ceil(q / 100.0 * self.total))  # 1-based nearest rank
        i = int(np.searchsorted(np.cumsum(self.counts), rank))
        return 0.0 if i == 0 else 10.0 ** (self.low + (i - 0.5) / self.per_decade)


class LatencyStats:
    """Time to first token and inter-token latency, in seconds, as :class:`LogHistogram` s."""

    def __init__(self) -> None:
        self.ttft = LogHistogram()
        self.itl = LogHistogram()

    def observe_tokens(self, since_previous: float, num_tokens: int, first: bool) -> None:
        """A request got ``num_tokens`` tokens ``since_previous`` seconds after its previous ones (or its arrival)."""
        if num_tokens <= 0:
            return
        if first:
            self.ttft.observe(since_previous)
            num_tokens -= 1
            since_previous = 0.0
        # Tokens committed together share the step's latency evenly (vLLM reports per-token ITL too).
        if num_tokens:
            self.itl.observe(since_previous / num_tokens, num_tokens)

    def as_dict(self) -> dict:
        return {f"{name}_p{q}_s": hist.percentile(q)
                for name, hist in (("ttft", self.ttft), ("itl", self.itl)) for q in (50, 95, 99)}
