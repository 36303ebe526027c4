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
are accepted only at their no-op values, any other field is an error. A line
without ``custom_id`` gets its line number (a string, counted from 1). Blank
lines are skipped and produce no record. custom_ids are not checked for
uniqueness: every record also carries its input ``line``.

Chat messages are rendered to one prompt string by the model's chat template
(:mod:`specjax.chat`: the tokenizer's jinja template rendered as transformers
does, then tokenized without adding special tokens, as the template writes its
own). The stdlib pair (builtin:target) has none (it is a code model); for it, and any tokenizer
without a template, :func:`specjax.chat.render_simple_chat` applies: one
``role: content`` line per message, then ``assistant:``.

Output: **every non-blank input line produces exactly one output record**, in
input order, whatever bytes the line holds::

    {"custom_id": "r1", "line": 1, "text": "...", "token_ids": [...], "finish_reason": "length",
     "usage": {"prompt_tokens": 5, "completion_tokens": 64},
     "metrics": {"num_draft_tokens": .., "num_accepted_tokens": .., "acceptance_rate": ..,
                 "num_spec_steps": .., "num_preemptions": .., "time_to_first_token_s": .., "latency_s": ..}}
    {"custom_id": "r2", "line": 2, "error": {"line": 2, "message": "body.temperature must be ..."}}
    {"custom_id": null, "line": 3, "error": {"line": 3, "message": "invalid JSON: the line ends inside ..."}}

Per-line isolation. Reading, validating, tokenizing and chat-rendering a line,
and encoding its record, cannot raise past the line (:mod:`specjax.batch.parse`,
:meth:`BatchJob.prepare`, :func:`specjax.batch.records.encode_record`): a
malformed line, a request the LLM rejects (``ValueError``: too long, token ids
outside the vocabulary, ...) or anything unforeseen (then the message names the
line, the field or stage, and the exception type) becomes that line's error
record, and the job goes on. An unreadable line (not UTF-8, not JSON, not an
object, or a ``custom_id`` that is not a valid string) has ``custom_id: null``.
If ``LLM.generate`` fails on a chunk, the chunk is bisected until the failure
is pinned on single requests: those get error records, the rest of the chunk
is retried without them (their output does not depend on batch composition).
A failure no request can be blamed for (the engine then fails a one-token
probe too) stops the job with the exception; rerunning resumes at that chunk.

Records are strict UTF-8 JSON. Text from the input that is not valid Unicode
(lone UTF-16 surrogates such as ``"\\ud800"`` written as JSON escapes, in
``custom_id``, prompts or messages) is the line's error, naming the field; no
such text reaches a record. A message quoting an exception that holds one
carries it as the six characters ``\\ud800`` (Python's ``backslashreplace``);
non-finite numbers are ``null``.

A request whose prompt + max_tokens exceeds the LLM's max_model_len stops there
with finish_reason "length". Latencies are measured from the moment a
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

Modules: :mod:`~specjax.batch.parse` (a line -> request or error),
:mod:`~specjax.batch.records` (record encoding, the crash-safe record file),
:mod:`~specjax.batch.config` (YAML configs), :mod:`~specjax.batch.job` (the
job), :mod:`~specjax.batch.merge` (part files, merge, summary).
"""

from specjax.batch.config import llm_argument_names, load_config
from specjax.batch.job import BatchJob, BatchOptions, run_batch
from specjax.batch.merge import find_parts, merge_and_summarize, merge_parts, summarize, summary_path, write_json_atomic
from specjax.batch.parse import (
    CHAT_URL,
    COMPLETIONS_URL,
    IGNORED_FIELDS,
    NOOP_VALUES,
    SAMPLING_FIELDS,
    URLS,
    BatchRequest,
    LineError,
    custom_id_of,
    default_custom_id,
    line_seed,
    parse_line,
)
from specjax.batch.records import (
    RecordFile,
    encode_record,
    error_record,
    iter_input,
    iter_records,
    result_record,
)
from specjax.chat import ChatTemplate, render_simple_chat

__all__ = [
    "CHAT_URL", "COMPLETIONS_URL", "IGNORED_FIELDS", "NOOP_VALUES", "SAMPLING_FIELDS", "URLS",
    "BatchJob", "BatchOptions", "BatchRequest", "ChatTemplate", "LineError", "RecordFile",
    "custom_id_of", "default_custom_id", "encode_record", "error_record", "find_parts", "iter_input",
    "iter_records", "line_seed", "llm_argument_names", "load_config", "merge_and_summarize", "merge_parts",
    "parse_line", "render_simple_chat", "result_record", "run_batch", "summarize", "summary_path",
    "write_json_atomic",
]
