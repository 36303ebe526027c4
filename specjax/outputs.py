"""What ``LLM.generate`` returns (vLLM's shapes), stop strings, banned words and prompt log-probabilities.

Text is detokenized incrementally as tokens are committed, so a stop string is
found on the committed text the moment it completes, even inside a block of
accepted drafts; everything after it is dropped (and the string itself unless
``include_stop_str_in_output``). Log-probabilities are the target's raw ones
(log-softmax of its logits before any processor or sampling transform, vLLM's
default ``raw_logprobs``), for every committed token, accepted drafts included.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    """1 = the most likely token at that position."""
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the completion (None: EOS-free stop, length, ...)."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per output token: its own and the top-``logprobs`` tokens' log-probabilities (requests with logprobs)."""
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per-request counters: num_draft_tokens, num_accepted_tokens, acceptance_rate (None without drafts),
    num_spec_steps, num_preemptions, time_to_first_token_s, latency_s."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Per prompt token (None for the first): its and the top-``prompt_logprobs`` tokens' log-probabilities."""


class StopStrings:
    """Called with each committed token id; returns the stop string its text completes, else None."""

    def __init__(self, tokenizer, stops: tuple[str, ...], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stops = stops
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""
        self._longest = max(len(s) for s in stops)

    def __call__(self, token: int) -> str | None:
        piece = self.stream.step(self.tokenizer, int(token)) or ""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        window = self.text[start:]
        for s in self.stops:
            if s in window:
                return s
        return None


def banned_token_ids(tokenizer, bad_words: tuple[str, ...], vocab_size: int) -> list[int]:
    """Token ids of ``bad_words`` (each word as it stands and with a leading space, as vLLM encodes them).

    A word that is more than one token cannot be banned by a per-token bias: ValueError naming ``bad_words``.
    """
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer")
    out = set()
    for word in bad_words:
        for form in (word, " " + word.lstrip(" ")):
            ids = tokenizer.encode(form, add_special_tokens=False).ids
            if len(ids) != 1:
                if form == word:
                    raise ValueError(f"bad_words: {word!r} is {len(ids)} tokens; only single-token words can be "
                                     "banned exactly (multi-token bad words are not supported)")
                continue  # the spaced form is a longer sequence: nothing of it is banned alone
            if ids[0] < vocab_size:
                out.add(ids[0])
    return sorted(out)


def completion(index: int, request, tokenizer) -> CompletionOutput:
    """The output of one finished request: text (cut at a stop string), logprobs, stop reason."""
    p = request.params
    ids = list(request.output_token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens) if tokenizer is not None else ""
    stop = request.stop_reason
    if isinstance(stop, str):
        at = text.rfind(stop)
        if at < 0:  # decode() normalized the text differently from the stream: cut the streamed text instead
            text = request.stop_checker.text
            at = text.rfind(stop)
        text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
    logprobs, cumulative = None, None
    if request.output_logprobs is not None:
        logprobs = []
        for token, (lp, rank, top_ids, top_lps) in zip(ids, request.output_logprobs):
            entry = {int(t): Logprob(float(v), r + 1, _piece(tokenizer, t)) for r, (t, v) in
                     enumerate(zip(top_ids.tolist(), top_lps.tolist()))}
            entry[int(token)] = Logprob(lp, rank, _piece(tokenizer, token))
            logprobs.append(entry)
        cumulative = float(sum(lp for lp, *_ in request.output_logprobs))
    return CompletionOutput(index, text, ids, request.finish_reason, stop_reason=stop, logprobs=logprobs,
                            cumulative_logprob=cumulative)


def _piece(tokenizer, token: int) -> str | None:
    return tokenizer.decode([int(token)], skip_special_tokens=False) if tokenizer is not None else None


@functools.partial(jax.jit, static_argnames=("config", "top_n"))
def _prompt_logprob_table(params, tokens: jax.Array, length: jax.Array, *, config, top_n: int):
    """log p(token i | tokens < i) [L] and the top-``top_n`` (ids, logprobs) [L, N] at each position i >= 1."""
    from models.llama import forward
    from specjax.kv_cache import AttentionMetadata, KVCache

    n = tokens.shape[0]
    positions = jnp.arange(n, dtype=jnp.int32)[None]  # [1, L]
    cache = KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=1, block_size=n,
                             num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                             dtype=jax.tree.leaves(params)[0].dtype)
    md = AttentionMetadata(slot_mapping=jnp.where(positions < length, positions, -1),
                           block_tables=jnp.zeros((1, 1), jnp.int32))
    logits, _, _ = forward(params, tokens[None], positions, cache, md, config=config)  # [1, L, V]
    lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)  # [L-1, V]: predicts tokens 1..L-1
    nxt = tokens[1:]
    chosen = jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]  # [L-1]
    rank = 1 + jnp.sum(lp > chosen[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, max(1, min(top_n, lp.shape[-1])))
    return chosen, rank, top_ids, top_lp


def prompt_logprobs(params, config, token_ids: list[int], top_n: int, tokenizer) -> list[dict[int, Logprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then each token's and the top-``top_n`` entries.

    One dense forward over the prompt (padded to a power of two, so lengths share compiled shapes).
    """
    n = len(token_ids)
    if n < 2:
        return [None] * n
    padded = 1 << (n - 1).bit_length()
    tokens = np.zeros(padded, np.int32)
    tokens[:n] = token_ids
    chosen, rank, top_ids, top_lp = jax.device_get(
        _prompt_logprob_table(params, tokens, np.int32(n), config=config, top_n=top_n))
    out: list[dict[int, Logprob] | None] = [None]
    for i in range(1, n):
        entry = {int(t): Logprob(float(v), r + 1, _piece(tokenizer, t))
                 for r, (t, v) in enumerate(zip(top_ids[i - 1].tolist()[:top_n], top_lp[i - 1].tolist()[:top_n]))}
        entry[int(token_ids[i])] = Logprob(float(chosen[i - 1]), int(rank[i - 1]), _piece(tokenizer, token_ids[i]))
        out.append(entry)
    return out
