"""The proposer protocol and the registry of speculative methods.

A proposer is everything one speculative method needs, behind one interface,
so the engine, the compiled step and the ``LLM`` facade never name a method:

* **what it declares**: which target features it reads from the verify pass
  (``features``), whether its drafts for step s+1 are made at the end of step s
  on device (``drafts_ahead``, the draft heads), whether drafts come from the
  host (``host_side``), and how many KV slots past the verified window it
  writes (``kv_lookahead``);
* **host side**: :meth:`Proposer.propose_host` (token-history drafters such as
  n-gram lookup) and :meth:`Proposer.finish`;
* **device side** (traced inside the one compiled step, pure functions of their
  arguments): :meth:`Proposer.propose` before the target's verify forward and
  :meth:`Proposer.update` after the rejection sampler. Its device state (a draft
  model's or head's paged KV, pending drafts) lives in ``DecodeState.proposer``
  and its weights in ``params``; both are passed in, never read from ``self``.

Each method module registers a builder with :func:`register`; ``build`` looks
it up by ``SpeculativeConfig.method``. Adding a method is one module plus its
registry line (the ``_MODULES`` table below) and its tests.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax.builtin import resolve_model
from specjax.spec_decode.acceptance import load_prior

EMPTY_DRAFTS = np.zeros((0,), dtype=np.int32)
EMPTY_DRAFTS.flags.writeable = False  # shared by every "no drafts" answer


class HostDrafter(Protocol):
    """Proposes drafts from each row's token history alone (n-gram, suffix trees)."""

    def propose(
        self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_drafts: Sequence[int]
    ) -> list[np.ndarray]:
        """For each row, up to ``max_drafts[i]`` (<= K) draft ids continuing ``token_ids[i]``
        (int32 1-D: prompt + committed output; a view the caller reuses). Empty = no drafts."""
        ...

    def finish(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A request ended (finished or aborted): drop its per-request state, learn from its output."""
        ...


@dataclasses.dataclass(frozen=True)
class Verified:
    """What the step knows after the rejection sampler (the input of :meth:`Proposer.update`)."""

    tokens: jax.Array
    """int32 [B, W]: the verify window: each row's catch-up tokens, then its drafts (left-aligned)."""
    positions: jax.Array
    """int32 [B, W]: absolute positions of the window."""
    slot_mapping: jax.Array
    """int32 [B, W]: KV slot of each window token; -1 = padding."""
    features: jax.Array | None
    """[B, W, F] target features of the window (``Proposer.features``), or None."""
    drafts: jax.Array
    """int32 [B, K]: the drafts that were verified."""
    out_tokens: jax.Array
    """int32 [B, K+1]: committed tokens (accepted drafts, then the corrected or bonus token; -1 after)."""
    accepted: jax.Array
    """int32 [B]: drafts accepted per row."""


class Proposer:
    """Base class: a method that proposes nothing (plain decoding). Subclasses override what they use."""

    features: str | None = None
    """Target features :meth:`update` reads from the verify pass: None, "hidden" (final-normed) or "aux"."""
    aux_layer_ids: tuple[int, ...] = ()
    """Target layers whose residual streams form the "aux" features."""
    drafts_ahead: bool = False
    """Drafts for step s+1 are made on device at the end of step s (valid only if the row sampled in s)."""
    chained_drafts: bool = False
    """Drafts made ahead come one after another (a proposer forward each), so a step makes only
    ``StepBatch.draft_ahead`` of them and the next step verifies no more."""
    host_side: bool = False
    """Drafts come from :meth:`propose_host` and reach the step as ``StepBatch.host_drafts``."""
    syncs: bool = False
    """Plain steps do device work to keep the proposer's state in step (a draft KV, a head's KV and drafts),
    so a *detached* plain step (the target alone) is cheaper, and leaves that state stale."""
    sampled_drafts: bool = False
    """:meth:`propose` returns draft distributions q [B, K, V] when a row samples (else one-hot drafts)."""
    params: Any = None
    """Device param pytree handed to every step (None: no weights)."""
    acceptance_prior: Any = None
    """The method's acceptance measured against this target (an
    :class:`~specjax.spec_decode.acceptance.AcceptancePrior` from its weights' directory, see :func:`prior_for`),
    where the adaptive controller starts; None: it learns from the first drafts."""

    def kv_lookahead(self, k: int) -> int:
        """KV slots past the verified window (committed + K + 1) the device side writes."""
        return 0

    # ------------------------------------------------------------------ host side

    def propose_host(self, request_ids, token_ids, max_drafts) -> list[np.ndarray]:
        raise NotImplementedError

    def finish(self, request_id: str, prompt_token_ids, output_token_ids) -> None:
        """A request ended: drop per-request host state."""

    # ------------------------------------------------------------------ device side

    def param_shardings(self, plan) -> Any:
        """Shardings of :attr:`params` on the engine's mesh (a pytree prefix)."""
        return plan.replicated if self.params is not None else None

    def init_state(self, *, num_slots: int, num_kv_blocks: int, block_size: int, kv_dtype, plan) -> Any:
        """The proposer's part of ``DecodeState`` (zeroed); None when it keeps nothing on device."""
        return None

    def state_shardings(self, plan) -> Any:
        return None

    def propose(self, params, target_params, state, batch, keys, *, k: int):
        """Drafts before the verify forward: (int32 [B, K], q float32 [B, K, V] or None, new state).

        ``batch`` is the step's ``StepBatch`` (``num_drafts`` says how many each row verifies) and ``keys``
        the per-row PRNG keys.
        """
        return batch.host_drafts, None, state

    def update(self, params, target_params, state, batch, verified: Verified, *, k: int):
        """After the rejection sampler: the new state (e.g. a head's KV and next drafts)."""
        return state


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildContext:
    """What a method's builder may use: the target, the engine's sizing and how weights are loaded."""

    spec: Any
    """The validated ``SpeculativeConfig``."""
    target_config: Any
    """The target's ``LlamaConfig``."""
    engine_config: Any
    """The ``EngineConfig``."""
    tokenizer: Any
    """The target's tokenizer (or None)."""
    dtype: str
    """Weight dtype name: "float32" or "bfloat16"."""
    tensor_parallel_size: int
    """The target's tp size (drafts may follow it or replicate)."""
    mesh: Any
    """The engine's device mesh."""
    target: str | None = None
    """The target model as given (a path or ``builtin:`` name; None: not known, so no measured prior applies)."""

    @property
    def jnp_dtype(self):
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[self.dtype]


Builder = Callable[[BuildContext], Proposer]
_BUILDERS: dict[str, Builder] = {}

# Where each method's builder lives: imported on first use, so a method's dependencies load only when used.
_MODULES = {
    "none": "specjax.spec_decode.synthetic",
    "ngram": "specjax.spec_decode.ngram",
    "suffix": "specjax.spec_decode.suffix",
    "draft_model": "specjax.spec_decode.draft_model",
    "eagle": "specjax.spec_decode.eagle",
    "eagle3": "specjax.spec_decode.eagle",
    "mtp": "specjax.spec_decode.eagle",
    "medusa": "specjax.spec_decode.medusa",
}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: ``@register("ngram") def build(ctx) -> Proposer``."""

    def deco(fn: Builder) -> Builder:
        _BUILDERS[name] = fn
        return fn

    return deco


def build(ctx: BuildContext) -> Proposer:
    """The proposer for ``ctx.spec.method`` (None = synthetic placeholder drafts)."""
    name = ctx.spec.method or "none"
    if name not in _MODULES:
        raise ValueError(f"speculative_config.method {name!r} has no registered proposer; known: {sorted(_MODULES)}")
    importlib.import_module(_MODULES[name])
    proposer = _BUILDERS[name](ctx)
    if getattr(ctx.spec, "model", None) is not None and proposer.acceptance_prior is None:
        proposer.acceptance_prior = prior_for(ctx, resolve_model(ctx.spec.model))
    return proposer


# --------------------------------------------------------------------------- shared checks


def prior_for(ctx: BuildContext, model_path: str):
    """The acceptance prior shipped in a draft's or head's directory for ``ctx``'s target, or None
    (:func:`~specjax.spec_decode.acceptance.load_prior`; a single weights file has no directory of its own)."""
    if ctx.target is None or not os.path.isdir(model_path):
        return None
    return load_prior(model_path, ctx.target)


def check_int(name: str, value, minimum: int) -> None:
    """Validate an int-valued proposer setting (numpy ints allowed), naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_batch(request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_drafts: Sequence[int]) -> None:
    """Shared argument check for host drafters: equal lengths, non-negative budgets."""
    if not (len(request_ids) == len(token_ids) == len(max_drafts)):
        raise ValueError(
            f"request_ids, token_ids and max_drafts must have equal lengths, got "
            f"{len(request_ids)}, {len(token_ids)}, {len(max_drafts)}"
        )
    for m in max_drafts:
        if m < 0:
            raise ValueError(f"max_drafts must be >= 0, got {m}")


class HostProposer(Proposer):
    """A method whose drafts come from a :class:`HostDrafter` on the host (n-gram lookup, suffix trees)."""

    host_side = True

    def __init__(self, drafter: HostDrafter):
        self.drafter = drafter

    def propose_host(self, request_ids, token_ids, max_drafts) -> list[np.ndarray]:
        return self.drafter.propose(request_ids, token_ids, max_drafts)

    def finish(self, request_id: str, prompt_token_ids, output_token_ids) -> None:
        self.drafter.finish(request_id, prompt_token_ids, output_token_ids)
