"""One batch job: this process's lines -> records, a chunk at a time, resuming what is there.

Per-line isolation is built in, not hoped for: :meth:`BatchJob.prepare` turns a
line into its request and LLM prompt or into its error record and cannot
raise; :meth:`BatchJob.generate` runs a chunk and, when ``LLM.generate``
fails, bisects the chunk until the failure is pinned on single requests, so
only those fail and the rest of the chunk is retried without them. A failure
that no request can be blamed for (the engine fails even a one-token probe)
stops the job: nothing is recorded for the chunk, and a rerun resumes there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from specjax.batch.merge import merge_and_summarize, summarize, summary_path, write_json_atomic
from specjax.batch.parse import BatchRequest, LineError, custom_id_of, default_custom_id, parse_line
from specjax.batch.records import RecordFile, error_record, iter_input, result_record, unexpected_error
from specjax.chat import ChatTemplate
from specjax.config import SamplingParams
from specjax.parallel import multihost

logger = logging.getLogger(__name__)

# LLM.get_metrics() keys a run summary keeps (those present: the engine's metrics are still growing).
_KEPT_METRICS = ("num_requests", "num_generated_tokens", "num_steps", "num_spec_steps", "num_preemptions",
                 "num_compiles", "compile_seconds", "generation_tokens_per_s", "acceptance_rate",
                 "mean_acceptance_length", "accepted_per_position", "verified_per_position", "num_drafts",
                 "num_draft_tokens", "num_accepted_tokens")


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


Prepared = tuple[BatchRequest, dict[str, Any]]
"""A runnable line: its request and the prompt as ``LLM.generate`` takes it (validated token ids)."""


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
        self._template: ChatTemplate | ValueError | None = None
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

    def chat_template(self) -> ChatTemplate:
        """The model's chat template, read at the first chat line; a broken one is every chat line's error."""
        if self._template is None:
            try:
                self._template = ChatTemplate.for_model(self.llm_kwargs.get("tokenizer") or self.llm.model_path)
            except ValueError as exc:
                self._template = exc
            except Exception as exc:  # noqa: BLE001 - e.g. a GGUF file that cannot be read: tried once, not per line
                self._template = ValueError(f"cannot load the chat template: {type(exc).__name__}: {exc}")
        if isinstance(self._template, ValueError):
            raise ValueError(f"body.messages: {self._template}")
        return self._template

    def _pending(self, done: Mapping[int, str | None]) -> list[tuple[int, str | bytes]]:
        """This process's input lines without a record, checking the records that exist belong to this input."""
        pending, seen = [], set()
        for line, text in iter_input(self.options.input):
            if not self.process.owns(line - 1):
                continue
            if line in done:
                seen.add(line)
                cid = custom_id_of(text, line)
                # Before custom_id null, an unreadable line's record carried its line number.
                if done[line] != cid and not (cid is None and done[line] == default_custom_id(line)):
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
        ids = llm.validate_prompt(prompt, field=request.prompt_field, name_keys=False)
        return {"prompt_token_ids": ids}

    def prepare(self, line: int, text: str | bytes) -> Prepared | dict[str, Any]:
        """The line's request and prompt, or its error record. Raises nothing: one line stops at itself."""
        try:
            request = parse_line(text, line, chat_template=self.chat_template, base_seed=self.base_seed,
                                 defaults=self.options.defaults)
        except LineError as exc:
            return error_record(line, exc.custom_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - parse_line raises only LineError; this is the guard
            return unexpected_error(line, custom_id_of(text, line), "reading the line", exc)
        try:
            return request, self._llm_prompt(request)
        except ValueError as exc:
            return error_record(line, request.custom_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer on text it cannot take
            return unexpected_error(line, request.custom_id, f"{request.prompt_field} (tokenizing)", exc)

    def _engine_alive(self, prompt: Mapping[str, Any]) -> bool:
        """Whether the LLM still generates (one token from the first token of ``prompt``)."""
        probe = {"prompt_token_ids": list(prompt["prompt_token_ids"][:1])}
        try:
            self.llm.generate([probe], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
        except Exception:  # noqa: BLE001
            logger.exception("the LLM fails a one-token probe too")
            return False
        return True

    def generate(self, runnable: list[Prepared], records: dict[int, dict]) -> None:
        """Records of ``runnable``: one ``LLM.generate`` call, bisected on failure down to the culprit requests."""
        try:
            outputs = self.llm.generate([p for _, p in runnable], [r.params for r, _ in runnable], use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 - pinned on requests below, or re-raised
            if len(runnable) > 1:
                logger.warning("a chunk of %d requests failed (%s: %s); splitting it to find the request",
                               len(runnable), type(exc).__name__, exc)
                half = len(runnable) // 2
                self.generate(runnable[:half], records)
                self.generate(runnable[half:], records)
                return
            (request, prompt), = runnable
            # The LLM's ValueError is a verdict on the request; anything else counts against the request
            # only if the engine still generates without it.
            if not isinstance(exc, ValueError) and not self._engine_alive(prompt):
                raise
            logger.warning("line %d failed alone: %s: %s", request.line, type(exc).__name__, exc)
            if isinstance(exc, ValueError):
                records[request.line] = error_record(request.line, request.custom_id, str(exc))
            else:
                records[request.line] = unexpected_error(request.line, request.custom_id, "generation", exc)
            return
        for (request, _), out in zip(runnable, outputs):
            try:
                records[request.line] = result_record(request, out)
            except Exception as exc:  # noqa: BLE001
                records[request.line] = unexpected_error(request.line, request.custom_id, "the output", exc)

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
                            prepared = self.prepare(line, text)
                            if isinstance(prepared, dict):
                                records[line] = prepared
                            else:
                                runnable.append(prepared)
                        if runnable:
                            self.generate(runnable, records)
                        for line in sorted(records):
                            out.append(records[line])
                            written += 1
                            errors += "error" in records[line]
                            generated += len(records[line].get("token_ids", ()))
                        if bar is not None:
                            bar.update(len(records))
                            postfix = {"tok/s": f"{generated / (time.perf_counter() - gen_start):.1f}"}
                            m = llm.get_metrics()
                            if m.get("num_draft_tokens") and m.get("acceptance_rate") is not None:
                                postfix["acc"] = f"{m['acceptance_rate']:.3f}"
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
            run["llm_metrics"] = {k: m[k] for k in _KEPT_METRICS if k in m}
            spec = getattr(self._llm, "speculative_config", None)
            run["speculative_method"] = None if spec is None else (spec.method or "synthetic")
        return run


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
