"""Prompts as users pass them: a str, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, validated.

Every check raises ``ValueError`` naming the field, so a bad prompt is rejected
before anything runs and the engine is left as it was. That holds for any
value, however hostile: text that is not valid Unicode (lone UTF-16
surrogates, which JSON's ``\\ud800`` escapes produce), token ids of any type or
size (a 64-bit or 1000-digit int is an id outside the vocabulary, not a float
or an overflow), containers of any depth. Whatever a check did not foresee is
still a ``ValueError`` naming the field and the exception type.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence

import numpy as np


class _ShortRepr(reprlib.Repr):
    """reprlib with bounded ints (``repr`` of a 5000-digit int raises, and a 4000-digit one helps nobody)."""

    def repr_int(self, x, level):
        if x.bit_length() > 128:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()
_SHORT.maxlevel = 3
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 6


def short_repr(value, limit: int = 120) -> str:
    """A bounded repr of any value for an error message: never raises, never walks a deep or long value.

    Lone surrogates come out escaped (``'\\ud800'``), so the message is always encodable.
    """
    try:
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not replace the error being reported
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_unicode(text: str, field: str) -> str:
    """``text`` if it encodes as UTF-8; else ValueError naming ``field`` and the first bad code point."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field} is not valid Unicode: lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start} "
            "(half of a UTF-16 pair, e.g. from a JSON \\ud800 escape)"
        ) from None
    return text


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise ValueError("prompts: a bare list of ints is ambiguous; pass {'prompt_token_ids': [...]}")
        return list(prompts)
    raise ValueError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")


def _token_ids(ids, field: str) -> list[int]:
    """Python ints of a flat list / tuple / integer array of token ids; ValueError naming ``field``."""
    if not isinstance(ids, (list, tuple)) and hasattr(ids, "__array__"):
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{field} must be a flat list of ints, got an array of shape {arr.shape} {arr.dtype}")
        return [int(t) for t in arr.tolist()]
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes, bytearray)):
        raise ValueError(f"{field} must be a flat list of ints, got {short_repr(ids)}")
    out = []
    for i, t in enumerate(ids):
        # Checked one by one: numpy would turn [1, 2**63 + 5] into floats and [1, 2**70] into objects.
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{field} must be a flat list of ints; item {i} is {short_repr(t)}")
        out.append(int(t))
    return out


def _parse_prompt(prompt, field: str, *, tokenizer, vocab_size: int, max_model_len: int,
                  name_keys: bool) -> tuple[str | None, list[int]]:
    key = (lambda k: f"{field}.{k}") if name_keys else (lambda k: field)  # noqa: E731
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            names = sorted(short_repr(k) for k in unknown)
            raise ValueError(f"{field} has unknown keys [{', '.join(names)}]; use 'prompt' or 'prompt_token_ids'")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if ids is None and text is None:
            raise ValueError(f"{field} needs 'prompt' or 'prompt_token_ids'")
    else:
        raise ValueError(f"{field} must be a str or a dict, got {type(prompt).__name__}")
    if ids is None:
        if not isinstance(text, str):
            raise ValueError(f"{key('prompt')} must be a str, got {type(text).__name__}")
        check_unicode(text, key("prompt"))
        if tokenizer is None:
            raise ValueError(f"{field} is text but the model has no tokenizer.json; pass prompt_token_ids")
        try:
            ids = tokenizer.encode(text).ids
        except Exception as exc:  # noqa: BLE001 - the tokenizer's failure is this prompt's, named as such
            raise ValueError(f"{key('prompt')}: the tokenizer failed: {type(exc).__name__}: {exc}") from None
    ids = _token_ids(ids, key("prompt_token_ids"))
    if not ids:
        raise ValueError(f"{field} is empty")
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        shown = ", ".join(short_repr(t) for t in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ValueError(f"{key('prompt_token_ids')} has ids outside [0, {vocab_size}), the model's vocabulary: "
                         f"[{shown}]")
    if len(ids) > max_model_len:
        raise ValueError(f"{field} has {len(ids)} tokens, more than max_model_len={max_model_len}")
    return text, ids


def parse_prompt(
    prompt, field: str, *, tokenizer, vocab_size: int, max_model_len: int, name_keys: bool = True
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt, checked against the model; ValueError naming ``field`` otherwise.

    ``prompt`` is a str, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``. With ``name_keys`` the
    messages name the dict key too (``field.prompt_token_ids``); without, ``field`` alone names the value.
    No other exception escapes: an unforeseen one becomes a ValueError naming ``field`` and its type.
    """
    try:
        return _parse_prompt(prompt, field, tokenizer=tokenizer, vocab_size=vocab_size,
                             max_model_len=max_model_len, name_keys=name_keys)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. RecursionError from a pathological container
        raise ValueError(f"{field}: unexpected {type(exc).__name__} while reading the prompt: {exc}") from exc
