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
