"""The proposer protocols.

Host proposers (ngram, suffix) look only at token ids and run on the CPU next to
the scheduler; model proposers (draft_model, later EAGLE/Medusa/MTP) run on the
device inside one jitted function per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class HostProposer(Protocol):
    """Proposes drafts from each row's token history alone."""

    def propose(
        self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_drafts: Sequence[int]
    ) -> list[np.ndarray]:
        """For each row, up to ``max_drafts[i]`` (<= K) draft ids continuing ``token_ids[i]``
        (int32 1-D: prompt + committed output). An empty array means no drafts for that row."""
        ...

    def finish(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A request ended (finished or aborted): drop its per-request state, learn from its output."""
        ...


EMPTY_DRAFTS = np.zeros((0,), dtype=np.int32)
EMPTY_DRAFTS.flags.writeable = False  # shared by every "no drafts" answer


def check_int(name: str, value, minimum: int) -> None:
    """Validate an int-valued proposer setting (numpy ints allowed), naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_batch(request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_drafts: Sequence[int]) -> None:
    """Shared argument check for host proposers: equal lengths, non-negative budgets."""
    if not (len(request_ids) == len(token_ids) == len(max_drafts)):
        raise ValueError(
            f"request_ids, token_ids and max_drafts must have equal lengths, got "
            f"{len(request_ids)}, {len(token_ids)}, {len(max_drafts)}"
        )
    for m in max_drafts:
        if m < 0:
            raise ValueError(f"max_drafts must be >= 0, got {m}")
