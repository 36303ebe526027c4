"""Speculative-decoding and latency statistics (what ``LLM.get_metrics`` reports)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SpecDecodeStats:
    """Counts over verified drafts. A "draft" is one row of one step with at least one draft token."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: np.ndarray = dataclasses.field(init=False)
    num_spec_steps: int = 0
    """Engine steps that verified at least one draft."""

    def __post_init__(self) -> None:
        self.accepted_per_position = np.zeros(self.num_speculative_tokens, np.int64)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One row's verification: ``num_accepted_tokens`` of ``num_draft_tokens`` drafts were kept."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.accepted_per_position[:num_accepted_tokens] += 1

    def as_dict(self) -> dict:
        drafted = self.num_draft_tokens
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            # vLLM's definition: the bonus/recovered token counts, so a draft with nothing accepted scores 1.
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "accepted_per_position": self.accepted_per_position.tolist(),
            "num_spec_steps": self.num_spec_steps,
        }


@dataclasses.dataclass
class LatencyStats:
    """Time to first token and inter-token latency samples, in seconds."""

    ttft: list[float] = dataclasses.field(default_factory=list)
    itl: list[float] = dataclasses.field(default_factory=list)

    def observe_tokens(self, since_previous: float, num_tokens: int, first: bool) -> None:
        """A request got ``num_tokens`` tokens ``since_previous`` seconds after its previous ones (or its arrival)."""
        if num_tokens <= 0:
            return
        if first:
            self.ttft.append(since_previous)
            num_tokens -= 1
            since_previous = 0.0
        # Tokens committed together share the step's latency evenly (vLLM reports per-token ITL too).
        self.itl.extend([since_previous / num_tokens] * num_tokens if num_tokens else [])

    def as_dict(self) -> dict:
        out = {}
        for name, values in (("ttft", self.ttft), ("itl", self.itl)):
            for q in (50, 95, 99):
                out[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if values else 0.0
        return out
