"""Records and the crash-safe record file (guarantees: the package doc).

A record is one JSON object on one line, always strict UTF-8 JSON:
:func:`encode_record` cannot fail. Input text fields that are not valid
Unicode never reach a record (the parser makes them the line's error), so the
only strings that can hold lone surrogates are messages quoting an exception;
those carry each one as the six characters ``\\udXXX`` (Python's
``backslashreplace``). Non-finite floats become ``null``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from specjax.batch.parse import BatchRequest

logger = logging.getLogger(__name__)


def error_record(line: int, custom_id: str | None, message: str) -> dict[str, Any]:
    """The record of a line that produced no completion; ``custom_id`` None for an unreadable line."""
    return {"custom_id": custom_id, "line": line, "error": {"line": line, "message": message}}


def unexpected_error(line: int, custom_id: str | None, where: str, exc: BaseException) -> dict[str, Any]:
    """The error record of an exception nobody foresaw: names the line, the field or stage, and the type."""
    return error_record(line, custom_id, f"line {line}, {where}: unexpected {type(exc).__name__}: {exc}")


def result_record(request: BatchRequest, output) -> dict[str, Any]:
    """The record of a finished request (``output`` is a :class:`specjax.RequestOutput`)."""
    completion = output.outputs[0]
    record = {
        "custom_id": request.custom_id,
        "line": request.line,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "usage": {"prompt_tokens": len(output.prompt_token_ids),
                  "completion_tokens": sum(len(c.token_ids) for c in output.outputs)},
        "metrics": dict(output.metrics),
    }
    if completion.stop_reason is not None:
        record["stop_reason"] = completion.stop_reason
    top_n = request.params.logprobs
    if completion.logprobs is not None:
        record["logprobs"] = _logprobs(completion, top_n)
    if len(output.outputs) > 1:  # n > 1: every completion, the first repeated at the top level
        record["choices"] = [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              **({"logprobs": _logprobs(c, top_n)} if c.logprobs is not None else {})}
                             for c in output.outputs]
    return record


def _logprobs(completion, top_n: int) -> list[dict[str, Any]]:
    """Per token: its id and log-probability, then the ``top_n`` most likely (OpenAI's ``top_logprobs`` shape)."""
    out = []
    for token, entry in zip(completion.token_ids, completion.logprobs):
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= top_n)
        out.append({"token_id": token, "logprob": entry[token].logprob,
                    "top_logprobs": [{"token_id": t, "logprob": v} for _, t, v in top]})
    return out


def _dumps(record: Mapping[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _escape(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _plain(value, depth: int = 0):
    """``value`` with JSON's types only: strings escaped, non-finite floats None, anything else its str."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return _escape(value)
    if depth < 8 and isinstance(value, Mapping):
        return {_escape(str(k)): _plain(v, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _plain(value.tolist(), depth + 1)
    return _escape(str(value))


def encode_record(record: Mapping[str, Any]) -> bytes:
    """One line of strict UTF-8 JSON for ``record``; never raises (see the module doc for the escaped form).

    A record that cannot be written even in the escaped form is replaced by its
    line's error record, which keeps its ``line`` and ``custom_id``.
    """
    try:
        return _dumps(record)
    except Exception:  # noqa: BLE001 - fall through to the escaped form
        pass
    try:
        return _dumps(_plain(record))
    except Exception as exc:  # noqa: BLE001
        line, cid = record.get("line"), record.get("custom_id")
        line = line if isinstance(line, int) and not isinstance(line, bool) else None
        cid = _escape(cid) if isinstance(cid, str) else None
        return _dumps(error_record(line, cid, f"the record could not be encoded: {type(exc).__name__}"))


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


def iter_records(path: str, *, repair_fd: int | None = None) -> Iterator[tuple[int, str | None, bytes]]:
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
                if isinstance(line, bool) or not isinstance(line, int) or not isinstance(cid, (str, type(None))):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{path}:{n} is not a specjax batch record; refusing to append to it (move it away or pick "
                    "another --output)"
                ) from None
            offset += len(raw)
            yield line, cid, raw


class RecordFile:
    """An append-only JSONL record file that survives ``kill -9`` at any instant (see the package doc).

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
            self.done: dict[int, str | None] = {}
            for line, cid, _ in iter_records(self.path, repair_fd=self._fd):
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
        """Write ``record`` (:func:`encode_record`) as one complete line and fsync it."""
        data = memoryview(encode_record(record))
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
