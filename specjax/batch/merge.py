"""Multi-process outputs: part files, their merge into one file in input order, and the summary JSON."""

from __future__ import annotations

import glob
import heapq
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from specjax.batch.records import iter_input, iter_records
from specjax.parallel import multihost

logger = logging.getLogger(__name__)


def summary_path(output: str | os.PathLike) -> str:
    """Where the summary of ``output`` goes: ``.jsonl`` replaced by ``.summary.json``."""
    output = os.fspath(output)
    stem = output[: -len(".jsonl")] if output.endswith(".jsonl") else output
    return stem + ".summary.json"


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
        for line, _, raw in iter_records(path):
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
        for _, _, raw in iter_records(path):
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
        "num_spec_steps": spec_steps,
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
