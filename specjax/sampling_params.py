"""``SamplingParams``: how one request is sampled, with vLLM's field names and semantics.

Every field is exact under speculative decoding: the same logits processors
(logit bias, banned tokens, min_tokens, penalties) and the same sampling
transforms (temperature, min-p, top-k, top-p) are applied to the target's
distribution at each verified position (with the drafts before it counted as
context) as in plain decoding, so greedy output equals plain decoding and
sampled output follows the target's distribution. A value that cannot be
honoured raises ``ValueError`` naming the field; an unknown field raises
``ValueError`` listing the supported ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

MAX_SEED = 2**32 - 1
MAX_LOGPROBS = 20
"""Most top log-probabilities one position may return (vLLM's default ``max_logprobs``)."""
MAX_N = 1024
"""Most completions one request may ask for (``n``): a bound, so one line of a batch job cannot exhaust memory."""
MAX_LOGIT_BIAS = 300
"""Most entries of ``logit_bias`` (and banned single-token ``bad_words``) per request (OpenAI's limit)."""


def _check_int(name: str, value, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return float(value)


def _check_strings(name: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    out = []
    for s in value:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must hold non-empty strings, got {s!r}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name} holds text that is not valid Unicode: {s!r}") from None
        out.append(s)
    return tuple(out)


@dataclasses.dataclass(frozen=True, init=False)
class SamplingParams:
    """How to sample one request (vLLM's names and defaults); see README's table for each field.

    temperature 0 is greedy; ``top_k`` 0 or -1, ``top_p`` 1.0 and ``min_p`` 0.0 switch those filters
    off. A request with a ``seed`` draws the same tokens whatever else shares its batch (with a fixed
    speculation length; see README).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    bad_words: tuple[str, ...] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __init__(self, **kwargs) -> None:
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise ValueError(f"SamplingParams has no field(s) {unknown}; supported: {sorted(fields)}")
        for name, f in fields.items():
            object.__setattr__(self, name, kwargs.get(name, f.default))
        self._validate()

    def _validate(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        set_("temperature", _check_float("temperature", self.temperature, 0.0, math.inf))
        _check_int("top_k", self.top_k, minimum=-1)
        set_("top_p", _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        set_("min_p", _check_float("min_p", self.min_p, 0.0, 1.0))
        set_("presence_penalty", _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        set_("repetition_penalty", _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                                lo_open=True))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed > MAX_SEED:
                raise ValueError(f"seed must be <= {MAX_SEED}, got {self.seed}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
                raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            for tok in self.stop_token_ids:
                _check_int("stop_token_ids", tok, minimum=0)
            set_("stop_token_ids", tuple(self.stop_token_ids))
        set_("stop", _check_strings("stop", self.stop) or None)
        set_("bad_words", _check_strings("bad_words", self.bad_words) or None)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, (Mapping, list, tuple)):
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}")
            items = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
            bias = []
            for entry in items:
                if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                    raise ValueError(f"logit_bias must map token ids to floats, got entry {entry!r}")
                tok, value = entry
                if isinstance(tok, str) and tok.lstrip("-").isdigit():
                    tok = int(tok)  # OpenAI's JSON form has string keys
                _check_int("logit_bias", tok, minimum=0)
                bias.append((tok, _check_float(f"logit_bias[{tok}]", value, -100.0, 100.0)))
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
            set_("logit_bias", tuple(sorted(dict(bias).items())) or None)

    @property
    def top_k_or_off(self) -> int:
        """top_k with -1 folded into 0 (off), the form the device sampler takes."""
        return max(self.top_k, 0)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
