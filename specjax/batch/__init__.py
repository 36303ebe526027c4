"""Offline batch jobs (``specjax batch``): a JSONL file of requests in, a JSONL file of results out.

Input, one request per line, in either form:

* the OpenAI batch format that vLLM's ``run_batch`` reads::

      {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
       "body": {"prompt": "def f(x):", "max_tokens": 64, "temperature": 0}}
      {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
       "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}}

* a plain form: ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``, with
  the same sampling fields beside it and an optional ``custom_id``.

``body.prompt`` is a string, a list of token ids, or a one-element list of
either. Sampling fields map onto :class:`specjax.SamplingParams`:
``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop_token_ids``, ``ignore_eos``; a missing
field takes the job's default (``--max-tokens`` / ``--temperature``, else
SamplingParams' own: 16 tokens at temperature 1, as OpenAI's API). ``model`` and
``user`` are ignored (one job serves one model); OpenAI fields specjax does not
implement (``n``, ``stop`` strings, penalties, ``logprobs``, ``stream``, ...)
are accepted only at their no-op values, any other field is an error. The
default ``custom_id`` is the line number (a string, counted from 1). Blank lines
are skipped and produce no record. custom_ids are not checked for uniqueness:
every record also carries its input ``line``.

Chat messages are rendered to one prompt string by the tokenizer's chat
template when it has one (``chat_template.jinja`` or ``chat_template`` in
``tokenizer_config.json``, rendered with jinja2 like transformers does, then
tokenized without adding special tokens, as the template writes its own). The
shipped pair has none (it is a code model); for it, and any tokenizer without a
template, :func:`render_simple_chat` applies: one ``role: content`` line per
message, then ``assistant:``.

Output, one record per non-blank input line, in input order::

    {"custom_id": "r1", "line": 1, "text": "...", "token_ids": [...], "finish_reason": "length",
     "usage": {"prompt_tokens": 5, "completion_tokens": 64},
     "metrics": {"num_draft_tokens": .., "num_accepted_tokens": .., "acceptance_rate": ..,
                 "num_spec_steps": .., "num_preemptions": .., "time_to_first_token_s": .., "latency_s": ..}}
    {"custom_id": "r2", "line": 2, "error": {"line": 2, "message": "body.temperature must be ..."}}

A malformed line, or a request the LLM rejects (``ValueError``: too long,
token ids outside the vocabulary, ...), becomes an error record; the job goes
on. A request whose prompt + max_tokens exceeds the LLM's max_model_len stops
there with finish_reason "length". Latencies are measured from the moment a
request's chunk is submitted.

Crash safety. Requests run in chunks of ``chunk_size`` through
``LLM.generate``; after each chunk its records are appended in line order, each
as one complete line by a single ``write`` on an ``O_APPEND`` descriptor
followed by ``fsync``. A killed job therefore leaves a file of complete records
plus at most one torn last line. Rerunning the same command locks the file,
truncates the torn tail, checks that every record's ``custom_id`` matches its
input line (so a different input cannot be appended to an old output), and
skips the lines already there: nothing is lost, nothing duplicated, and since
records are always appended in ascending line order the file stays in input
order (unless records are deleted by hand from its middle: those lines are
then redone and appended at the end). At most one chunk of work is redone.
Requests without a ``seed`` get one derived from the LLM's ``seed`` and their
line number, so a resumed or multi-host job samples exactly what one
uninterrupted run would.

Multi-host (see :mod:`specjax.parallel.multihost`): process ``i`` of ``n``
takes lines with ``(line - 1) % n == i`` and writes ``OUTPUT.part-0000i-of-0000n``
with the same guarantees; :func:`merge_parts` (process 0 after a barrier, or
``specjax batch --merge``) checks that the parts cover every input line exactly
once and writes ``OUTPUT`` in input order (atomically: temp file + rename). The
parts are kept (rerunning the job then finds nothing to do and merges again).
The output must sit on storage every host can read for process 0 to merge.

A summary JSON (default ``OUTPUT`` with ``.jsonl`` replaced by
``.summary.json``) gives request / error / token counts, acceptance over all
records, latency percentiles and, for this invocation, throughput and the
LLM's own metrics.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import glob
import hashlib
import heapq
import inspect
import json
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.parallel import multihost

logger = logging.getLogger(__name__)

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_URL)

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
IGNORED_FIELDS = ("model", "user")
# OpenAI / vLLM fields specjax does not implement: accepted only at a value that changes nothing.
NOOP_VALUES: dict[str, tuple] = {
    "n": (1,),
    "best_of": (1,),
    "stream": (False,),
    "echo": (False,),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "stop": (None, "", []),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
}

# --------------------------------------------------------------------------- chat templates


def render_simple_chat(messages: Sequence[Mapping[str, str]]) -> str:
    """``role: content`` per line, then ``assistant:`` — the fallback for tokenizers without a template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A tokenizer's jinja chat template, or (``source=None``) :func:`render_simple_chat`."""

    source: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @property
    def add_special_tokens(self) -> bool:
        """Whether the rendered text is tokenized with special tokens: a real template writes its own BOS."""
        return self.source is None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ChatTemplate":
        """The template next to a tokenizer: ``chat_template.jinja``, else ``tokenizer_config.json``'s."""
        path = Path(path)
        source = None
        config: dict = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if source is not None and not isinstance(source, str):
            raise ValueError(f"{path}: chat_template must be a string, got {type(source).__name__}")

        def token(name: str) -> str:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return value if isinstance(value, str) else ""

        return cls(source=source or None, bos_token=token("bos_token"), eos_token=token("eos_token"))

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        if self.source is None:
            return render_simple_chat(messages)
        return _compiled_template(self.source).render(
            messages=list(messages), add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token,
        )


@functools.lru_cache(maxsize=4)
def _compiled_template(source: str):
    """A sandboxed jinja2 template, set up as transformers' ``apply_chat_template`` sets it up."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


# --------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchRequest:
    """One parsed input line."""

    line: int
    """1-based input line number: the record key (resume, sharding, merge order)."""
    custom_id: str
    url: str | None
    """COMPLETIONS_URL, CHAT_URL, or None for the plain form."""
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    add_special_tokens: bool = True
    """False for text rendered by a tokenizer's chat template (it already holds BOS etc.)."""
    prompt_field: str = "prompt"
    """Where the prompt came from, for error messages: 'body.prompt', 'body.messages', 'prompt_token_ids', ..."""


def default_custom_id(line: int) -> str:
    return str(line)


def custom_id_of(text: str | bytes, line: int) -> str:
    """The custom_id a line's record carries, also for lines that do not parse (then the default)."""
    if isinstance(text, bytes):
        return default_custom_id(line)
    try:
        obj = json.loads(text)
    except ValueError:
        return default_custom_id(line)
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else default_custom_id(line)


def line_seed(base_seed: int, line: int) -> int:
    """The sampling seed of a request that has none: stable across processes, resumes and Python versions."""
    digest = hashlib.sha256(f"specjax-batch:{base_seed}:{line}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt_from_body(value, field: str) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of a completions ``prompt``: a string, token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _is_token_list(value[0])):
        value = value[0]
    if isinstance(value, str):
        return value, None
    if _is_token_list(value):
        return None, tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise ValueError(f"{field} holds {len(value)} prompts; put one prompt per line")
    raise ValueError(f"{field} must be a string or a non-empty list of token ids, got {value!r:.80}")


def _chat_messages(value, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field} must be a non-empty list of messages, got {value!r:.80}")
    out = []
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content', got {m!r:.80}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string, got {role!r:.80}")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}, got {part!r:.80}")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts, got {content!r:.80}")
        out.append({**{k: v for k, v in m.items() if k not in ("role", "content")}, "role": role, "content": content})
    return out


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


def _check_fields(fields: Mapping[str, Any], allowed: Sequence[str], prefix: str) -> None:
    for name, value in fields.items():
        if name in allowed or name in IGNORED_FIELDS:
            continue
        if name in NOOP_VALUES:
            ok = NOOP_VALUES[name]
            if not (value is None or value in ("", [], {}) or value in ok):
                raise ValueError(f"{prefix}{name}={value!r:.80} is not supported (only {list(ok)!r})")
            continue
        raise ValueError(f"{prefix}{name} is not a supported field; supported: {sorted(allowed)}")


def parse_line(
    text: str | bytes,
    line: int,
    *,
    chat_template: ChatTemplate | None = None,
    base_seed: int = 0,
    defaults: Mapping[str, Any] | None = None,
) -> BatchRequest:
    """Parse one input line (see the module doc); ValueError naming the field for anything malformed.

    ``defaults`` fill sampling fields the line leaves out (e.g. ``{"max_tokens": 64}``);
    ``base_seed`` seeds requests without a ``seed`` (:func:`line_seed`).
    """
    defaults = dict(defaults or {})
    if isinstance(text, bytes):
        raise ValueError(f"not valid UTF-8: {text[:60]!r}")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a request must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id", default_custom_id(line))
    if not isinstance(custom_id, str):
        raise ValueError(f"custom_id must be a string, got {custom_id!r:.80}")
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
                raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {ids!r:.80}")
            return BatchRequest(line=line, custom_id=custom_id, url=None, prompt_token_ids=tuple(ids),
                                params=_sampling_params(fields, "", **seed_args), prompt_field="prompt_token_ids")
        if "prompt" not in fields:
            raise ValueError("missing 'prompt' (or 'prompt_token_ids'); for the OpenAI form give 'url' and 'body'")
        prompt, ids = _prompt_from_body(fields["prompt"], "prompt")
        return BatchRequest(line=line, custom_id=custom_id, url=None, prompt=prompt, prompt_token_ids=ids,
                            params=_sampling_params(fields, "", **seed_args), prompt_field="prompt")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown keys {unknown}; an OpenAI batch line has custom_id, method, url, body")
    method = obj.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method must be 'POST', got {method!r:.80}")
    url = obj.get("url")
    if url not in URLS:
        raise ValueError(f"url must be one of {list(URLS)}, got {url!r:.80}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {body!r:.80}")
    if url == COMPLETIONS_URL:
        _check_fields(body, ("prompt", *SAMPLING_FIELDS), "body.")
        if "prompt" not in body:
            raise ValueError("body.prompt is missing")
        prompt, ids = _prompt_from_body(body["prompt"], "body.prompt")
        return BatchRequest(line=line, custom_id=custom_id, url=url, prompt=prompt, prompt_token_ids=ids,
                            params=_sampling_params(body, "body.", **seed_args), prompt_field="body.prompt")
    _check_fields(body, ("messages", "max_completion_tokens", *SAMPLING_FIELDS), "body.")
    if "messages" not in body:
        raise ValueError("body.messages is missing")
    messages = _chat_messages(body["messages"], "body.messages")
    fields = dict(body)
    if fields.get("max_completion_tokens") is not None:
        if fields.get("max_tokens") is not None:
            raise ValueError("give body.max_tokens or body.max_completion_tokens, not both")
        fields["max_tokens"] = fields["max_completion_tokens"]
    template = chat_template or ChatTemplate()
    try:
        rendered = template.render(messages)
    except Exception as exc:  # noqa: BLE001 - a template error is this line's problem, not the job's
        raise ValueError(f"body.messages: the chat template failed: {type(exc).__name__}: {exc}") from None
    return BatchRequest(line=line, custom_id=custom_id, url=url, prompt=rendered,
                        add_special_tokens=template.add_special_tokens,
                        params=_sampling_params(fields, "body.", **seed_args), prompt_field="body.messages")


# --------------------------------------------------------------------------- records


def error_record(line: int, custom_id: str, message: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "line": line, "error": {"line": line, "message": message}}


def result_record(request: BatchRequest, output) -> dict[str, Any]:
    """The record of a finished request (``output`` is a :class:`specjax.RequestOutput`)."""
    completion = output.outputs[0]
    return {
        "custom_id": request.custom_id,
        "line": request.line,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(completion.token_ids)},
        "metrics": dict(output.metrics),
    }


def iter_input(path: str | os.PathLike) -> Iterator[tuple[int, str | bytes]]:
    """(1-based line number, text) of every non-blank input line; the raw bytes of a line that is not UTF-8."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield n, raw  # parse_line turns it into this line's error record


def _iter_records(path: str, *, repair_fd: int | None = None) -> Iterator[tuple[int, str, bytes]]:
    """(line, custom_id, raw bytes) of each complete record of an output file, in file order.

    A torn last line (no trailing newline: the writer was killed mid-write) is
    skipped, and truncated away through ``repair_fd`` when one is given. Any
    complete line that is not a record raises ValueError: the file is not ours.
    """
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(raw))
                if repair_fd is not None:
                    os.ftruncate(repair_fd, offset)
                    os.fsync(repair_fd)
                return
            try:
                rec = json.loads(raw)
                line, cid = rec["line"], rec["custom_id"]
                if isinstance(line, bool) or not isinstance(line, int) or not isinstance(cid, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{path}:{n} is not a specjax batch record; refusing to append to it (move it away or pick "
                    "another --output)"
                ) from None
            offset += len(raw)
            yield line, cid, raw


class RecordFile:
    """An append-only JSONL record file that survives ``kill -9`` at any instant (see the module doc).

    Opening it takes an exclusive ``flock`` (a second writer on the same file is
    an error), drops a torn last line, and collects the records already there
    (``done``: line -> custom_id). Each :meth:`append` is one ``write`` of one
    complete line plus ``fsync``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._lock()
            self.done: dict[int, str] = {}
            for line, cid, _ in _iter_records(self.path, repair_fd=self._fd):
                if line in self.done:
                    raise ValueError(f"{self.path}: two records for input line {line}")
                self.done[line] = cid
        except BaseException:
            os.close(self._fd)
            raise

    def _lock(self) -> None:
        try:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX
            logger.warning("no fcntl: cannot lock %s against a second writer", self.path)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"{self.path} is being written by another specjax batch process") from None
            logger.warning("cannot lock %s (%s); make sure no other job writes it", self.path, exc)

    def append(self, record: Mapping[str, Any]) -> None:
        data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        while data:
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "RecordFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- configs


def llm_argument_names() -> tuple[str, ...]:
    """The keyword arguments of :class:`specjax.LLM`: what a YAML config may set."""
    from specjax.llm import LLM

    return tuple(p for p in inspect.signature(LLM.__init__).parameters if p != "self")


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file of ``LLM`` keyword arguments, keys checked (values are checked by ``LLM`` itself).

    ``speculative_config``'s keys are checked against :class:`SpeculativeConfig`
    here too, but the config is not built: a file naming a method that is not
    implemented yet (eagle3) still loads, and ``LLM(...)`` raises on it.
    """
    import yaml

    path = os.fspath(path)
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"config {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path!r} must be a mapping of LLM arguments, got {type(data).__name__}")
    known = llm_argument_names()
    for key in data:
        if key not in known:
            raise ValueError(f"config {path!r}: unknown key {key!r}; known keys: {list(known)}")
    spec = data.get("speculative_config")
    if spec is not None:
        if not isinstance(spec, dict):
            raise ValueError(f"config {path!r}: speculative_config must be a mapping, got {type(spec).__name__}")
        fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        for key in spec:
            if key not in fields:
                raise ValueError(
                    f"config {path!r}: unknown key 'speculative_config.{key}'; known keys: {sorted(fields)}"
                )
    return data


# --------------------------------------------------------------------------- the job


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchOptions:
    """One batch job (what ``specjax batch`` parses its flags into)."""

    input: str
    output: str
    chunk_size: int | None = None
    """Requests per ``LLM.generate`` call; None = 8 x max_num_seqs (enough to keep the batch full
    most of a chunk; a crash redoes at most one chunk)."""
    max_tokens: int | None = None
    """Default for lines without max_tokens (None: SamplingParams' 16)."""
    temperature: float | None = None
    """Default for lines without temperature (None: SamplingParams' 1.0)."""
    summary: str | None = None
    """Summary JSON path; None = OUTPUT with .jsonl replaced by .summary.json."""
    progress: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if os.path.abspath(self.input) == os.path.abspath(self.output):
            raise ValueError(f"output must differ from input, both are {self.input!r}")

    @property
    def defaults(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            out["temperature"] = self.temperature
        return out


def summary_path(output: str | os.PathLike) -> str:
    output = os.fspath(output)
    stem = output[: -len(".jsonl")] if output.endswith(".jsonl") else output
    return stem + ".summary.json"


class BatchJob:
    """Run one process's share of a batch file into its record file (resuming what is there)."""

    def __init__(
        self,
        options: BatchOptions,
        llm_kwargs: Mapping[str, Any] | None = None,
        *,
        llm=None,
        process: multihost.ProcessInfo | None = None,
    ):
        self.options = options
        self.llm_kwargs = dict(llm_kwargs or {})
        self._llm = llm
        self.process = process or multihost.process_info()
        count = self.process.count
        self.record_path = (
            options.output if count == 1 else multihost.part_path(options.output, self.process.index, count)
        )
        self.base_seed = self.llm_kwargs.get("seed", 0) if llm is None else llm.engine_config.seed
        self._template: ChatTemplate | None = None
        self.load_seconds = 0.0
        """Time spent constructing the LLM (loading + warmup compiles) in this run."""

    @property
    def llm(self):
        if self._llm is None:
            from specjax.llm import LLM  # jax is imported only after jax.distributed.initialize

            start = time.perf_counter()
            self._llm = LLM(**self.llm_kwargs)
            self.load_seconds = time.perf_counter() - start
        return self._llm

    @property
    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            tok = self.llm_kwargs.get("tokenizer") or self.llm.model_path
            self._template = ChatTemplate.from_dir(tok)
        return self._template

    def _pending(self, done: Mapping[int, str]) -> list[tuple[int, str]]:
        """This process's input lines without a record, checking the records that exist belong to this input."""
        pending, seen = [], set()
        for line, text in iter_input(self.options.input):
            if not self.process.owns(line - 1):
                continue
            if line in done:
                seen.add(line)
                cid = custom_id_of(text, line)
                if done[line] != cid:
                    raise ValueError(
                        f"{self.record_path}: the record of input line {line} has custom_id {done[line]!r} but "
                        f"{self.options.input} line {line} has {cid!r}; the output belongs to another input "
                        "(move it away or pick another --output)"
                    )
            else:
                pending.append((line, text))
        stray = sorted(set(done) - seen)
        if stray:
            raise ValueError(
                f"{self.record_path} has records for lines {stray[:5]} that are not this process's non-blank lines "
                f"of {self.options.input}; the output belongs to another input or process layout"
            )
        return pending

    def _llm_prompt(self, request: BatchRequest) -> dict[str, Any]:
        """The prompt as ``LLM.generate`` takes it, validated by the LLM now so one bad line cannot fail a chunk."""
        llm = self.llm
        if request.prompt_token_ids is not None:
            prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        elif request.add_special_tokens or llm.tokenizer is None:
            prompt = {"prompt": request.prompt}
        else:
            prompt = {"prompt_token_ids": llm.tokenizer.encode(request.prompt, add_special_tokens=False).ids}
        llm.validate_prompt(prompt, field=request.prompt_field, name_keys=False)
        return prompt

    def _generate(self, runnable: list[tuple[BatchRequest, dict]], records: dict[int, dict]) -> None:
        llm = self.llm
        try:
            outputs = llm.generate([p for _, p in runnable], [r.params for r, _ in runnable], use_tqdm=False)
        except ValueError as exc:
            # Pre-validation should have caught it; find the culprit one request at a time.
            logger.warning("a chunk was rejected (%s); running its requests one by one", exc)
            for request, prompt in runnable:
                try:
                    (out,) = llm.generate([prompt], [request.params], use_tqdm=False)
                except ValueError as one:
                    records[request.line] = error_record(request.line, request.custom_id, str(one))
                else:
                    records[request.line] = result_record(request, out)
            return
        for (request, _), out in zip(runnable, outputs):
            records[request.line] = result_record(request, out)

    def run(self) -> dict[str, Any]:
        """Process every pending line; returns this run's numbers (see :func:`summarize`)."""
        start = time.perf_counter()
        with RecordFile(self.record_path) as out:
            resumed = len(out.done)
            pending = self._pending(out.done)
            if resumed:
                logger.info("%s: %d records already written, %d lines to go", self.record_path, resumed, len(pending))
            written = errors = generated = 0
            bar = gen_start = None
            llm = self.llm if pending else None  # load + compile before the clock and the bar start
            if pending and self.options.progress:
                from tqdm.auto import tqdm

                desc = "batch" if self.process.count == 1 else f"batch {self.process.index}/{self.process.count}"
                bar = tqdm(total=len(pending), desc=desc, unit="req", dynamic_ncols=True)
            try:
                if pending:
                    chunk = self.options.chunk_size or 8 * llm.engine_config.max_num_seqs
                    gen_start = time.perf_counter()
                    for i in range(0, len(pending), chunk):
                        records: dict[int, dict] = {}
                        runnable = []
                        for line, text in pending[i:i + chunk]:
                            try:
                                request = parse_line(text, line, chat_template=self.chat_template,
                                                     base_seed=self.base_seed, defaults=self.options.defaults)
                                runnable.append((request, self._llm_prompt(request)))
                            except ValueError as exc:
                                records[line] = error_record(line, custom_id_of(text, line), str(exc))
                        if runnable:
                            self._generate(runnable, records)
                        for line in sorted(records):
                            out.append(records[line])
                            written += 1
                            errors += "error" in records[line]
                            generated += len(records[line].get("token_ids", ()))
                        if bar is not None:
                            bar.update(len(records))
                            postfix = {"tok/s": f"{generated / (time.perf_counter() - gen_start):.1f}"}
                            rate = llm.get_metrics().get("acceptance_rate")
                            if rate is not None:
                                postfix["acc"] = f"{rate:.3f}"
                            bar.set_postfix(postfix)
            finally:
                if bar is not None:
                    bar.close()
        gen_seconds = time.perf_counter() - gen_start if gen_start is not None else 0.0
        run = {
            "process_index": self.process.index,
            "process_count": self.process.count,
            "records_resumed": resumed,
            "records_written": written,
            "errors_written": errors,
            "generated_tokens": generated,
            "load_seconds": self.load_seconds,
            "generate_seconds": gen_seconds,
            "elapsed_seconds": time.perf_counter() - start,
            "throughput_tokens_per_s": generated / gen_seconds if gen_seconds else 0.0,
        }
        if self._llm is not None and written:
            m = self._llm.get_metrics()
            keep = ("num_requests", "num_generated_tokens", "num_steps", "num_preemptions", "num_compiles",
                    "compile_seconds", "generation_tokens_per_s", "acceptance_rate", "mean_acceptance_length",
                    "accepted_per_position", "num_drafts", "num_draft_tokens", "num_accepted_tokens")
            run["llm_metrics"] = {k: m[k] for k in keep if k in m}
        return run


# --------------------------------------------------------------------------- merge and summary


def find_parts(output: str | os.PathLike, count: int | None = None) -> list[str]:
    """The part files of ``output``, index order; all ``count`` (or all of the count found on disk) must exist."""
    output = os.fspath(output)
    if count is None:
        pattern = re.compile(re.escape(os.path.basename(output)) + r"\.part-(\d{5})-of-(\d{5})$")
        counts = {int(m.group(2)) for p in glob.glob(glob.escape(output) + ".part-*-of-*")
                  if (m := pattern.match(os.path.basename(p)))}
        if not counts:
            raise ValueError(f"no part files {output}.part-*-of-* to merge")
        if len(counts) > 1:
            raise ValueError(
                f"part files of {output} disagree on the process count: {sorted(counts)}; give --num-processes"
            )
        count = counts.pop()
    parts = [multihost.part_path(output, i, count) for i in range(count)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"missing part files: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    return parts


def merge_parts(input_path: str | os.PathLike, output: str | os.PathLike, count: int | None = None) -> int:
    """Merge the part files into ``output`` in input order; returns the number of records.

    Every non-blank input line must have exactly one record, in the part of the
    process that owns it (else ValueError naming the lines: rerun that process).
    ``output`` is replaced atomically, so a crash here leaves the parts intact
    and the merge can simply be run again.
    """
    output = os.fspath(output)
    parts = find_parts(output, count)
    count = len(parts)

    def index(i: int, path: str) -> list[tuple[int, int, int, int]]:
        """(line, part, offset, length) of each record, sorted by line: a part is in order unless edited by hand."""
        out, offset, seen = [], 0, set()
        for line, _, raw in _iter_records(path):
            if line in seen:
                raise ValueError(f"{path}: two records for input line {line}")
            if (line - 1) % count != i:
                raise ValueError(f"{path}: holds line {line}, which belongs to process {(line - 1) % count}")
            seen.add(line)
            out.append((line, i, offset, len(raw)))
            offset += len(raw)
        return sorted(out)

    expected = (line for line, _ in iter_input(input_path))
    tmp = f"{output}.merge-tmp"
    n = 0
    files = [open(p, "rb") for p in parts]
    try:
        with open(tmp, "wb") as f:
            for line, part, offset, length in heapq.merge(*(index(i, p) for i, p in enumerate(parts))):
                files[part].seek(offset)
                raw = files[part].read(length)
                want = next(expected, None)
                if want != line:
                    missing = line if want is None else want
                    raise ValueError(
                        f"cannot merge: input line {missing} has no record (or a stray record) in the parts of "
                        f"{output}; rerun process {(missing - 1) % count} of {count}"
                    )
                f.write(raw)
                n += 1
            want = next(expected, None)
            if want is not None:
                raise ValueError(
                    f"cannot merge: input line {want} has no record in the parts of {output}; rerun process "
                    f"{(want - 1) % count} of {count}"
                )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        for f in files:
            f.close()
    return n


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def summarize(paths: Sequence[str], runs: Sequence[Mapping[str, Any]] = (), **extra) -> dict[str, Any]:
    """Counts, acceptance and latency over all records in ``paths``, plus this invocation's ``runs``.

    Acceptance here is summed over records (so it covers resumed work);
    ``runs[i]["llm_metrics"]`` holds ``LLM.get_metrics()`` of the process that
    wrote in this invocation. Throughput is this invocation's generated tokens
    over the longest process's generate time.
    """
    ok = err = prompt_tokens = gen_tokens = drafted = accepted = spec_steps = 0
    latency, ttft = [], []
    reasons: Counter = Counter()
    for path in paths:
        for _, _, raw in _iter_records(path):
            rec = json.loads(raw)
            if "error" in rec:
                err += 1
                continue
            ok += 1
            reasons[rec.get("finish_reason")] += 1
            usage, m = rec.get("usage", {}), rec.get("metrics", {})
            prompt_tokens += usage.get("prompt_tokens", 0)
            gen_tokens += usage.get("completion_tokens", 0)
            drafted += m.get("num_draft_tokens") or 0
            accepted += m.get("num_accepted_tokens") or 0
            spec_steps += m.get("num_spec_steps") or 0
            if m.get("latency_s") is not None:
                latency.append(m["latency_s"])
            if m.get("time_to_first_token_s") is not None:
                ttft.append(m["time_to_first_token_s"])
    run_tokens = sum(r.get("generated_tokens", 0) for r in runs)
    run_seconds = max((r.get("generate_seconds", 0.0) for r in runs), default=0.0)
    return {
        **extra,
        "num_records": ok + err,
        "num_requests": ok,
        "num_errors": err,
        "finish_reasons": dict(reasons),
        "num_prompt_tokens": prompt_tokens,
        "num_generated_tokens": gen_tokens,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1.0 + accepted / spec_steps if spec_steps else None,
        "latency_s": _percentiles(latency),
        "time_to_first_token_s": _percentiles(ttft),
        "throughput_tokens_per_s": run_tokens / run_seconds if run_seconds else None,
        "runs": list(runs),
    }


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def run_batch(
    options: BatchOptions,
    llm_kwargs: Mapping[str, Any] | None = None,
    *,
    llm=None,
    process: multihost.ProcessInfo | None = None,
    merge: bool = True,
) -> dict[str, Any]:
    """Run this process's share; with several processes, wait for all and let process 0 merge.

    Returns the summary (the merged one on process 0 of a multi-process job,
    this process's part summary on the others); it is also written as JSON.
    """
    process = process or multihost.process_info()
    job = BatchJob(options, llm_kwargs, llm=llm, process=process)
    run = job.run()
    extra = {"input": options.input, "output": options.output, "num_processes": process.count}
    if process.count == 1:
        summary = summarize([options.output], [run], **extra)
        write_json_atomic(options.summary or summary_path(options.output), summary)
        return summary
    part_summary = summary_path(job.record_path)
    summary = summarize([job.record_path], [run], **extra)
    write_json_atomic(part_summary, summary)
    if not merge:
        return summary
    # Named by the output's base name: hosts may mount the shared storage at different paths.
    multihost.barrier(f"specjax-batch-done:{os.path.basename(options.output)}")
    if process.index != 0:
        return summary
    return merge_and_summarize(options.input, options.output, process.count, summary_out=options.summary)


def merge_and_summarize(
    input_path: str, output: str, count: int | None = None, *, summary_out: str | None = None,
) -> dict[str, Any]:
    """:func:`merge_parts`, then one summary over the merged file with every part's run numbers."""
    parts = find_parts(output, count)
    n = merge_parts(input_path, output, len(parts))
    runs = []
    for p in parts:
        s = summary_path(p)
        if os.path.isfile(s):
            with open(s) as f:
                runs.extend(json.load(f).get("runs", []))
    summary = summarize([output], runs, input=input_path, output=output, num_processes=len(parts))
    write_json_atomic(summary_out or summary_path(output), summary)
    logger.info("merged %d parts into %s (%d records)", len(parts), output, n)
    return summary
