"""Token-level mapping between a target's and a draft's vocabularies (``use_heterogeneous_vocab``).

A draft model whose tokenizer differs from the target's can still propose
tokens for it, as long as both vocabularies share tokens. Tokens are matched by
their vocabulary string (for byte-level BPE these strings are the byte
sequences, so equal strings are equal bytes); special tokens are matched only
to special tokens, by content.

Two arrays do the work on device:

- ``target_to_draft`` int32 [V_target]: the draft id the draft consumes at a
  position where the target has this token. The draft sees the context one
  draft token per target token, at the target's positions, so its paged KV stays
  aligned with the target's block tables. A target token the draft lacks maps
  to a *fallback*: the draft id of the longest draft token that is a suffix of
  the target token's string (byte-level vocabularies always have the single
  final byte, so this is never empty between two of them). The suffix keeps the
  text nearest the next position, which is what the draft's next-token
  prediction leans on most. A special token the draft lacks (or a string with
  no suffix in the draft's vocabulary) maps to the draft's unk token if it has
  one, else its first special token, else id 0. Model rows past the
  tokenizer's size (padding) use the same last-resort id.
- ``draft_to_target`` int32 [V_draft]: the target id of the same token, or -1
  where the target has none (and for the draft's padding rows). Draft logits at
  -1 entries are masked to -inf before the argmax, so every draft maps to a
  real target token.

Drafting is greedy only; the target verifies the mapped ids exactly, so greedy
output equals plain decoding whatever the draft proposes.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class VocabMap:
    """The two id maps (see the module docstring) and how many tokens each side shares."""

    target_to_draft: np.ndarray
    """int32 [V_target]: draft id for each target id (exact match or fallback)."""
    draft_to_target: np.ndarray
    """int32 [V_draft]: target id for each draft id, -1 where the target has no such token."""
    num_shared: int
    """Tokens present in both vocabularies."""

    def __post_init__(self) -> None:
        for name in ("target_to_draft", "draft_to_target"):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype != np.int32:
                raise ValueError(f"{name} must be a 1-D int32 numpy array, got {value!r}")
        v_target, v_draft = len(self.target_to_draft), len(self.draft_to_target)
        t2d, d2t = self.target_to_draft, self.draft_to_target
        if t2d.size and (t2d.min() < 0 or t2d.max() >= v_draft):
            raise ValueError(f"target_to_draft must hold draft ids in [0, {v_draft}), got [{t2d.min()}, {t2d.max()}]")
        if d2t.size and (d2t.min() < -1 or d2t.max() >= v_target):
            raise ValueError(
                f"draft_to_target must hold target ids in [0, {v_target}) or -1, got [{d2t.min()}, {d2t.max()}]"
            )
        shared = int((d2t >= 0).sum())
        if isinstance(self.num_shared, bool) or not isinstance(self.num_shared, int) or self.num_shared != shared:
            raise ValueError(f"num_shared must be the count of mapped draft ids ({shared}), got {self.num_shared!r}")
        if shared == 0:
            raise ValueError("num_shared must be >= 1: the target's and draft's vocabularies share no token")

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(target_to_draft, draft_to_target): the pair the jitted draft function takes."""
        return self.target_to_draft, self.draft_to_target


def _token_keys(tokenizer) -> dict[tuple[str, str], int]:
    """``{(kind, string): id}``; kind "special" for special added tokens, else "text"."""
    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return {("special" if i in special else "text", s): i for s, i in vocab.items()}


def _last_resort_id(tokenizer, keys: dict[tuple[str, str], int]) -> int:
    """The draft's unk token if its model has one, else its lowest-id special token, else 0."""
    unk = getattr(tokenizer.model, "unk_token", None)
    if unk is not None and tokenizer.token_to_id(unk) is not None:
        return int(tokenizer.token_to_id(unk))
    specials = [i for (kind, _), i in keys.items() if kind == "special"]
    return min(specials) if specials else 0


def build_vocab_map(target_tokenizer, draft_tokenizer, *, target_vocab_size: int, draft_vocab_size: int) -> VocabMap:
    """Map between two ``tokenizers.Tokenizer`` vocabularies, sized to the models' vocab sizes.

    The model sizes may exceed the tokenizers' (padded embeddings); tokenizer ids at or past a model's
    size are left out, since that model cannot consume or emit them.
    """
    for name, size in (("target_vocab_size", target_vocab_size), ("draft_vocab_size", draft_vocab_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    target_keys = {k: i for k, i in _token_keys(target_tokenizer).items() if i < target_vocab_size}
    draft_keys = {k: i for k, i in _token_keys(draft_tokenizer).items() if i < draft_vocab_size}
    last_resort = _last_resort_id(draft_tokenizer, draft_keys)
    if last_resort >= draft_vocab_size:
        last_resort = 0
    t2d = np.full((target_vocab_size,), last_resort, np.int32)  # [V_target]
    d2t = np.full((draft_vocab_size,), -1, np.int32)  # [V_draft]
    draft_text = {s: i for (kind, s), i in draft_keys.items() if kind == "text"}
    num_suffix = 0
    for key, t_id in target_keys.items():
        d_id = draft_keys.get(key)
        if d_id is not None:
            t2d[t_id] = d_id
            d2t[d_id] = t_id
            continue
        kind, s = key
        if kind == "text":
            # Longest proper suffix first; at least the final byte exists in a byte-level vocabulary.
            for start in range(1, len(s)):
                hit = draft_text.get(s[start:])
                if hit is not None:
                    t2d[t_id] = hit
                    num_suffix += 1
                    break
    shared = int((d2t >= 0).sum())
    logger.info(
        "heterogeneous vocab: %d tokens shared (target %d, draft %d); %d target tokens drafted from a suffix, "
        "%d from id %d", shared, target_vocab_size, draft_vocab_size, num_suffix,
        target_vocab_size - shared - num_suffix, last_resort,
    )
    return VocabMap(target_to_draft=t2d, draft_to_target=d2t, num_shared=shared)


def load_vocab_map(target_tokenizer, draft_dir: str | os.PathLike, *, target_vocab_size: int,
                   draft_vocab_size: int) -> VocabMap:
    """The map between the target's loaded tokenizer and the one in ``draft_dir`` (its ``tokenizer.json``)."""
    from models.loading import load_tokenizer

    if target_tokenizer is None:
        raise ValueError("use_heterogeneous_vocab needs the target's tokenizer.json (or LLM(tokenizer=...))")
    draft_tokenizer = load_tokenizer(draft_dir)
    if draft_tokenizer is None:
        raise ValueError(f"use_heterogeneous_vocab needs the draft's tokenizer.json in {os.fspath(draft_dir)!r}")
    return build_vocab_map(
        target_tokenizer, draft_tokenizer, target_vocab_size=target_vocab_size, draft_vocab_size=draft_vocab_size
    )
