"""One input line -> a :class:`BatchRequest`, or a :class:`LineError` naming the field (formats: the package doc).

:func:`parse_line` raises nothing but :class:`LineError`, whatever the line
holds: JSON nested past the parser's recursion limit, numbers of any size,
strings with lone surrogates, values of any type at any field. The error
carries the ``custom_id`` the line's record gets (None when the line cannot be
read far enough to have one), the same value :func:`custom_id_of` gives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specjax.chat import ChatTemplate
from specjax.config import SamplingParams
from specjax.prompts import check_unicode, short_repr

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_URL)

SAMPLING_FIELDS = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words", "logprobs",
                   "skip_special_tokens")
CHAT_ONLY_FIELDS = ("top_logprobs",)
"""Chat requests ask for log-probabilities OpenAI's way: ``logprobs: true`` plus ``top_logprobs: N``."""
IGNORED_FIELDS = ("model", "user")
# OpenAI / vLLM fields specjax does not implement: accepted only at a value that changes nothing.
NOOP_VALUES: dict[str, tuple] = {
    "best_of": (1,),
    "stream": (False,),
    "echo": (False,),
    "suffix": (None, ""),
}


class LineError(ValueError):
    """A line that cannot run. The message names the field; ``custom_id`` is what its error record carries."""

    def __init__(self, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.custom_id = custom_id


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchRequest:
    """One parsed input line."""

    line: int
    """1-based input line number: the record key (resume, sharding, merge order)."""
    custom_id: str
    """The line's ``custom_id``, or its line number as a string when it has none."""
    url: str | None
    """COMPLETIONS_URL, CHAT_URL, or None for the plain form."""
    params: SamplingParams
    prompt: str | None = None
    """Text to tokenize (valid Unicode); None when the prompt came as token ids."""
    prompt_token_ids: tuple[int, ...] | None = None
    add_special_tokens: bool = True
    """False for text rendered by a tokenizer's chat template (it already holds BOS etc.)."""
    prompt_field: str = "prompt"
    """Where the prompt came from, for error messages: 'body.prompt', 'body.messages', 'prompt_token_ids', ..."""


def default_custom_id(line: int) -> str:
    """The custom_id of a readable line that gives none."""
    return str(line)


def line_seed(base_seed: int, line: int) -> int:
    """The sampling seed of a request that has none: stable across processes, resumes and Python versions."""
    digest = hashlib.sha256(f"specjax-batch:{base_seed}:{line}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _json_error(text: str, exc: ValueError) -> str:
    """What a ``json.loads`` failure means for the user (the bare messages mislead on the common cases)."""
    if isinstance(exc, json.JSONDecodeError):
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            return f"invalid JSON: the line ends inside a JSON value (truncated?): {exc}"
        if exc.msg.startswith("Invalid control character"):
            return f"invalid JSON: {exc} (control characters inside strings must be escaped, e.g. \\n or \\u0000)"
        return f"invalid JSON: {exc}"
    if "Exceeds the limit" in str(exc):  # int() refuses numbers of more than sys.get_int_max_str_digits() digits
        return f"invalid JSON: a number has too many digits ({exc})"
    return f"invalid JSON: {exc}"


def _read_object(text: str | bytes) -> dict:
    """The JSON object of a line; LineError (custom_id None) when there is none."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            shown = short_repr(text[:60].rstrip(b"\r\n"))
            raise LineError(f"not valid UTF-8 (byte 0x{text[exc.start]:02x} at offset {exc.start}): {shown}") from None
    body = text.rstrip("\r\n")  # the line terminator is not part of the value
    try:
        obj = json.loads(body)
    except RecursionError:
        raise LineError("invalid JSON: nested deeper than the JSON parser allows (RecursionError)") from None
    except ValueError as exc:
        raise LineError(_json_error(body, exc)) from None
    if not isinstance(obj, dict):
        raise LineError(f"a request must be a JSON object, got {type(obj).__name__}")
    return obj


def _custom_id(obj: dict, line: int) -> str:
    if "custom_id" not in obj:
        return default_custom_id(line)
    cid = obj["custom_id"]
    if not isinstance(cid, str):
        raise LineError(f"custom_id must be a string, got {short_repr(cid)}")
    try:
        return check_unicode(cid, "custom_id")
    except ValueError as exc:
        raise LineError(str(exc)) from None


def custom_id_of(text: str | bytes, line: int) -> str | None:
    """The custom_id a line's record carries: None when the line is unreadable or its custom_id unusable."""
    try:
        return _custom_id(_read_object(text), line)
    except Exception:  # noqa: BLE001 - unreadable, whatever the reason
        return None


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_from_body(value, field: str) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of a completions ``prompt``: a string, token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _is_token_list(value[0])):
        value = value[0]
    if isinstance(value, str):
        return check_unicode(value, field), None
    if _is_token_list(value):
        return None, tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ValueError(f"{field} holds {len(value)} prompts; put one prompt per line")
    raise ValueError(f"{field} must be a string or a non-empty list of token ids, got {short_repr(value)}")


def _sampling_params(
    fields: Mapping[str, Any], prefix: str, *, line: int, base_seed: int, defaults: Mapping[str, Any],
) -> SamplingParams:
    kwargs = {name: fields[name] for name in SAMPLING_FIELDS if name in fields and fields[name] is not None}
    for name, value in defaults.items():
        kwargs.setdefault(name, value)
    if "seed" not in kwargs:
        kwargs["seed"] = line_seed(base_seed, line)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        raise ValueError(f"{prefix}{exc}") from None


def _key(name: str) -> str:
    """A JSON key as it goes into a message: as it is when short and printable, else a bounded repr."""
    return name if len(name) <= 60 and name.isprintable() else short_repr(name)


def _check_fields(fields: Mapping[str, Any], allowed: Sequence[str], prefix: str) -> None:
    for name, value in fields.items():
        if name in allowed or name in IGNORED_FIELDS:
            continue
        if name in NOOP_VALUES:
            ok = NOOP_VALUES[name]
            if not (value is None or value in ("", [], {}) or value in ok):
                raise ValueError(f"{prefix}{name}={short_repr(value)} is not supported (only {list(ok)!r})")
            continue
        raise ValueError(f"{prefix}{_key(name)} is not a supported field; supported: {sorted(allowed)}")


def _parse_object(
    obj: dict, custom_id: str, line: int, *, chat_template, base_seed: int, defaults: Mapping[str, Any],
) -> BatchRequest:
    seed_args = dict(line=line, base_seed=base_seed, defaults=defaults)
    if not {"url", "body", "method"} & set(obj):
        # The plain form: prompt / prompt_token_ids with sampling fields beside them.
        fields = {k: v for k, v in obj.items() if k != "custom_id"}
        _check_fields(fields, ("prompt", "prompt_token_ids", *SAMPLING_FIELDS), "")
        if "prompt" in fields and "prompt_token_ids" in fields:
            raise ValueError("give 'prompt' or 'prompt_token_ids', not both")
        if "prompt_token_ids" in fields:
            ids = fields["prompt_token_ids"]
            if not _is_token_list(ids):
                raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {short_repr(ids)}")
            return BatchRequest(line=line, custom_id=custom_id, url=None, prompt_token_ids=tuple(ids),
                                params=_sampling_params(fields, "", **seed_args), prompt_field="prompt_token_ids")
        if "prompt" not in fields:
            raise ValueError("missing 'prompt' (or 'prompt_token_ids'); for the OpenAI form give 'url' and 'body'")
        prompt, ids = _prompt_from_body(fields["prompt"], "prompt")
        return BatchRequest(line=line, custom_id=custom_id, url=None, prompt=prompt, prompt_token_ids=ids,
                            params=_sampling_params(fields, "", **seed_args), prompt_field="prompt")
    unknown = sorted(short_repr(k) for k in set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown keys [{', '.join(unknown)}]; an OpenAI batch line has custom_id, method, url, body")
    method = obj.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method must be 'POST', got {short_repr(method)}")
    url = obj.get("url")
    if url not in URLS:
        raise ValueError(f"url must be one of {list(URLS)}, got {short_repr(url)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {short_repr(body)}")
    if url == COMPLETIONS_URL:
        _check_fields(body, ("prompt", *SAMPLING_FIELDS), "body.")
        if "prompt" not in body:
            raise ValueError("body.prompt is missing")
        prompt, ids = _prompt_from_body(body["prompt"], "body.prompt")
        return BatchRequest(line=line, custom_id=custom_id, url=url, prompt=prompt, prompt_token_ids=ids,
                            params=_sampling_params(body, "body.", **seed_args), prompt_field="body.prompt")
    _check_fields(body, ("messages", "max_completion_tokens", *SAMPLING_FIELDS, *CHAT_ONLY_FIELDS), "body.")
    if "messages" not in body:
        raise ValueError("body.messages is missing")
    fields = dict(body)
    top = fields.pop("top_logprobs", None)
    if fields.get("logprobs") is not None:
        if not isinstance(fields["logprobs"], bool):
            raise ValueError(f"body.logprobs must be true or false for chat requests, got {short_repr(fields['logprobs'])}")
        fields["logprobs"] = (0 if top is None else top) if fields["logprobs"] else None
    elif top is not None:
        raise ValueError("body.top_logprobs needs body.logprobs = true")
    if fields.get("max_completion_tokens") is not None:
        if fields.get("max_tokens") is not None:
            raise ValueError("give body.max_tokens or body.max_completion_tokens, not both")
        fields["max_tokens"] = fields["max_completion_tokens"]
    params = _sampling_params(fields, "body.", **seed_args)
    template = chat_template() if callable(chat_template) else chat_template or ChatTemplate()
    rendered = template.render(body["messages"], field="body.messages")
    return BatchRequest(line=line, custom_id=custom_id, url=url, prompt=rendered,
                        add_special_tokens=template.add_special_tokens, params=params, prompt_field="body.messages")


def parse_line(
    text: str | bytes,
    line: int,
    *,
    chat_template: ChatTemplate | Callable[[], ChatTemplate] | None = None,
    base_seed: int = 0,
    defaults: Mapping[str, Any] | None = None,
) -> BatchRequest:
    """Parse one input line (see the package doc); :class:`LineError` naming the field for anything else.

    ``chat_template`` renders chat lines (None: :func:`specjax.chat.render_simple_chat`); it may be a
    zero-argument callable, called only for a chat line (a ValueError it raises is that line's error).
    ``defaults`` fill sampling fields the line leaves out (e.g. ``{"max_tokens": 64}``);
    ``base_seed`` seeds requests without a ``seed`` (:func:`line_seed`).
    """
    try:
        obj = _read_object(text)
        custom_id = _custom_id(obj, line)
    except LineError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the line holds, it stops at this line
        raise LineError(f"line {line}: unexpected {type(exc).__name__} while reading the line: {exc}") from None
    try:
        return _parse_object(obj, custom_id, line, chat_template=chat_template, base_seed=base_seed,
                             defaults=dict(defaults or {}))
    except ValueError as exc:
        raise LineError(str(exc), custom_id) from None
    except Exception as exc:  # noqa: BLE001
        raise LineError(f"line {line}: unexpected {type(exc).__name__} while reading the request: {exc}",
                        custom_id) from None
