"""Prompts as users pass them: a str, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, validated.

Every check raises ``ValueError`` naming the field, so a bad prompt is rejected
before anything runs and the engine is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise ValueError("prompts: a bare list of ints is ambiguous; pass {'prompt_token_ids': [...]}")
        return list(prompts)
    raise ValueError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")


def parse_prompt(
    prompt, field: str, *, tokenizer, vocab_size: int, max_model_len: int, name_keys: bool = True
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt, checked against the model; ValueError naming ``field`` otherwise.

    ``prompt`` is a str, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``. With ``name_keys`` the
    messages name the dict key too (``field.prompt_token_ids``); without, ``field`` alone names the value.
    """
    key = (lambda k: f"{field}.{k}") if name_keys else (lambda k: field)  # noqa: E731
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"{field} has unknown keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids'")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if ids is None and text is None:
            raise ValueError(f"{field} needs 'prompt' or 'prompt_token_ids'")
    else:
        raise ValueError(f"{field} must be a str or a dict, got {type(prompt).__name__}")
    if ids is None:
        if not isinstance(text, str):
            raise ValueError(f"{key('prompt')} must be a str, got {type(text).__name__}")
        if tokenizer is None:
            raise ValueError(f"{field} is text but the model has no tokenizer.json; pass prompt_token_ids")
        ids = tokenizer.encode(text).ids
    ids_arr = np.asarray(ids)
    if ids_arr.ndim != 1 or (ids_arr.size and not np.issubdtype(ids_arr.dtype, np.integer)):
        raise ValueError(f"{key('prompt_token_ids')} must be a flat list of ints")
    ids = [int(t) for t in ids_arr]
    if not ids:
        raise ValueError(f"{field} is empty")
    vocab = vocab_size
    bad = [t for t in ids if t < 0 or t >= vocab]
    if bad:
        raise ValueError(f"{key('prompt_token_ids')} has ids outside [0, {vocab}): {bad[:5]}")
    if len(ids) > max_model_len:
        raise ValueError(
            f"{field} has {len(ids)} tokens, more than max_model_len={max_model_len}"
        )
    return text, ids
