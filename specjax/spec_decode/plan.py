"""What the adaptive controller plans with: each row's worthwhile drafts (:class:`RowCaps`), and a step's plan
(:class:`Decision`)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RowCaps:
    """Per row of a decoding step: how far its drafts are worth verifying (before any drafts are looked up)."""

    request_ids: list[str]
    reach: list[list[float]]
    """[R][K_max]: estimated P(draft j accepted), the expected gain of drafting position j."""
    caps: list[int]
    """[R]: drafts worth verifying (a probe counts one), within the row's limit."""
    probing: list[bool]
    """[R]: the row drafts only to re-test its estimate."""
    sampled: bool
    """Some row samples (its step kinds' costs are the sampled ones)."""
    until_probe: int
    """Decoding steps until the next of these rows falls due a probe (a large number when none will)."""
    remaining: list[int] | None = None
    """[R]: tokens each row may still generate, given when no request waits to take a finished row's
    place (the batch is draining): a step is then worth how much it shortens the drain, not its tokens."""
    row_sampled: list[bool] | None = None
    """[R]: the row samples (None: every row as ``sampled``)."""
    open_caps: list[int] | None = None
    """[R]: ``caps`` were all the row's draft positions ready; given for a proposer that chains its drafts ahead
    (it made only as many as the last plan asked for: see :attr:`Decision.ahead`), else None."""


@dataclasses.dataclass
class Decision:
    """One step's plan."""

    k: int
    """Drafts per row at most (0 = no drafts)."""
    caps: np.ndarray
    """int32 [R]: each row's draft cap (<= k)."""
    detached: bool
    """Run the target alone (proposer state of these rows goes stale); only for proposers that sync."""
    hold: int = 0
    """The next this-many decoding steps of the same rows may run this decision without planning
    (:meth:`SpeculationController.held_step`): ``replan_every`` without drafts, ``draft_replan_every`` with."""
    ahead: int = 1
    """Drafts a proposer with chained drafts makes in this step for the rows' next one (each costs a proposer
    forward): the most it may then verify. ``max(k, 1)``, more where the rows' ``open_caps`` would draft more."""
    held: tuple[int, np.ndarray] | None = None
    """(K, int32 caps [R]) the held steps run, where not this step's: one row whose host lookup found nothing
    holds the plan a hit would have made (each held step verifies what its lookup finds)."""
