"""Issue 18: no input line can stop a batch job. Hostile lines (hypothesis) through the parser, the LLM's prompt
checks and the record writer; the issue's three job-killing lines in a real job."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.batch import (
    BatchJob,
    BatchOptions,
    LineError,
    RecordFile,
    custom_id_of,
    error_record,
    iter_input,
    parse_line,
    result_record,
    run_batch,
)
from specjax.llm import CompletionOutput, RequestOutput
from specjax.prompts import check_unicode
from test_batch import LLM_KW, VOCAB, llm, tiny  # noqa: F401 - module fixtures: the tiny model and its LLM

# --------------------------------------------------------------------------- hostile lines

# Every code point, lone surrogates (category Cs) and control characters included.
_ANY_CHAR = st.characters(codec=None, exclude_categories=())
_TEXT = st.text(_ANY_CHAR, max_size=12) | st.sampled_from(
    ["\ud800", "\udfff", "a\udc80b", "\x00", "\x1b[2J", "\ufffe", "\U0010ffff", "x" * 100_000, ""])
_NUMBERS = st.integers() | st.floats() | st.sampled_from(
    [2**31, 2**63 + 5, -(2**63), 10**40, 1000000000, 9223372036854775813, -1, 0, 1])
_SCALARS = st.none() | st.booleans() | _NUMBERS | _TEXT
_VALUES = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(_TEXT, c, max_size=4),
                       max_leaves=10)

_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
_TEMPLATES = [
    {"custom_id": "a", "prompt": "def f(x):", "max_tokens": 3},
    {"custom_id": "b", "prompt_token_ids": [5, 6, 7], "temperature": 0, "max_tokens": 2},
    {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x = 1", "max_tokens": 2}},
    {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": _MESSAGES, "max_tokens": 2}},
]
# Where a hostile value goes: every field of every form, and new keys.
_PATHS = [
    ("custom_id",), ("prompt",), ("prompt_token_ids",), ("max_tokens",), ("temperature",), ("seed",), ("top_k",),
    ("stop_token_ids",), ("ignore_eos",), ("n",), ("stop",), ("logit_bias",), ("url",), ("method",), ("body",),
    ("body", "prompt"), ("body", "messages"), ("body", "max_tokens"), ("body", "max_completion_tokens"),
    ("body", "messages", 0), ("body", "messages", 1, "content"), ("body", "messages", 1, "role"),
    ("body", "messages", 1, "name"), ("body", "messages", 1, "content", 0), ("prompt_token_ids", 1),
    ("body", "prompt", 0), ("\ud800",), ("body", "\x00"),
]


def _set(obj, path, value):
    """A copy of ``obj`` with ``value`` at ``path`` (creating containers where the path leaves the template)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        items = list(obj) if isinstance(obj, list) else []
        while len(items) <= key:
            items.append({})
        items[key] = _set(items[key], rest, value)
        return items
    out = dict(obj) if isinstance(obj, dict) else {}
    out[key] = _set(out.get(key), rest, value)
    return out


@st.composite
def _json_lines(draw) -> bytes:
    """A request template with a hostile value somewhere, written as JSON (maybe with raw surrogates)."""
    obj = _set(draw(st.sampled_from(_TEMPLATES)), draw(st.sampled_from(_PATHS)), draw(_VALUES))
    if draw(st.booleans()):
        return json.dumps(obj).encode()  # lone surrogates as \ud800 escapes: valid UTF-8, the classic case
    # Raw: lone surrogates become CESU-8 bytes, which are not UTF-8.
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


_DEEP = st.builds(lambda n, ch: (ch[0] * n + "1" + ch[1] * n).encode(), st.integers(1, 30_000),
                  st.sampled_from([('{"a":', "}"), ("[", "]"), ('{"prompt":[', "]}"), ('{"body":{"x":', "}}")]))
_RAW = st.sampled_from([
    b'{"custom_id": "\\ud800", "prompt": "x"}',
    b'{"prompt": "a\\udc80"}',
    b'{"prompt_token_ids": [1, 1000000000, 9223372036854775813]}',
    b'{"prompt": "abc',
    b'{"max_tokens": ' + b"9" * 5000 + b', "prompt": "x"}',
    b'{"prompt_token_ids": [' + b"9" * 5000 + b"]}",
    b'{"prompt": NaN, "temperature": Infinity}',
    b'{"prompt": "x", "prompt": "y", "custom_id": "dup"}',
    b"\xef\xbb\xbf{\"prompt\": \"bom\"}",
    b"\xff\xfe\x00",
    b"null", b"[]", b'"str"', b"1e999",
])


@st.composite
def _hostile_line(draw) -> bytes:
    line = draw(_json_lines() | _DEEP | _RAW | st.binary(max_size=64))
    mutation = draw(st.sampled_from(["none", "none", "truncate", "control"]))
    if mutation == "truncate" and line:
        line = line[: draw(st.integers(0, len(line) - 1))]
    elif mutation == "control":
        at = draw(st.integers(0, len(line)))
        line = line[:at] + draw(st.sampled_from([b"\x00", b"\r", b"\x1f", b"\x7f", b"\xc0\x80", b"\t"])) + line[at:]
    return line.replace(b"\n", b" ")  # one line each; blank ones are allowed (they must produce no record)


def _write_lines(path: str, lines: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")


def _strict_records(path: str) -> list[dict]:
    """The records of a file, parsed strictly: UTF-8, no NaN/Infinity, no lone surrogates in any string."""
    def no_constant(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    def walk(value):
        if isinstance(value, str):
            check_unicode(value, "record")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    with open(path, "rb") as f:
        raw = f.read()
    records = [json.loads(line, parse_constant=no_constant) for line in raw.decode("utf-8").splitlines()]
    for r in records:
        walk(r)
    return records


def _fake_output(request) -> RequestOutput:
    """What generate would return, echoing the prompt's text so input text goes through the record encoder."""
    ids = list(request.prompt_token_ids or [1])
    return RequestOutput(request_id="0", prompt=request.prompt, prompt_token_ids=ids,
                         outputs=[CompletionOutput(0, request.prompt or "", ids[:3], "length")],
                         metrics={"acceptance_rate": float("nan"), "latency_s": 0.5})


def _check_one_record_per_line(path: str, out: str, records: list[dict]) -> None:
    lines = list(iter_input(path))
    assert [r["line"] for r in records] == [n for n, _ in lines]
    for (n, text), rec in zip(lines, records):
        assert rec["custom_id"] == custom_id_of(text, n)
        assert ("error" in rec) != ("text" in rec)
    assert _strict_records(out) == records


_FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))


@_FUZZ
@given(st.lists(_hostile_line(), min_size=1, max_size=6))
def test_fuzz_parser_and_record_writer(lines):
    """Every non-blank line -> exactly one strict UTF-8 JSON record with its line and custom_id; nothing raises."""
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
        _write_lines(inp, lines)
        with RecordFile(out) as f:
            for n, text in iter_input(inp):
                try:
                    request = parse_line(text, n)
                except LineError as exc:
                    assert str(exc) and exc.custom_id == custom_id_of(text, n)
                    f.append(error_record(n, exc.custom_id, str(exc)))
                else:
                    f.append(result_record(request, _fake_output(request)))
        with RecordFile(out) as f:  # and the file reads back as ours (resume)
            assert sorted(f.done) == [n for n, _ in iter_input(inp)]
        _check_one_record_per_line(inp, out, _strict_records(out))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_hostile_line(), min_size=1, max_size=4))
def test_fuzz_through_the_jobs_line_preparation(llm, lines):  # noqa: F811 - the imported fixture
    """The job's per-line step (parse, chat render, tokenize, LLM prompt checks) never raises on any line."""
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.jsonl"), os.path.join(d, "out.jsonl")
        _write_lines(inp, lines)
        job = BatchJob(BatchOptions(input=inp, output=out, progress=False), llm=llm)
        with RecordFile(out) as f:
            for n, text in iter_input(inp):
                prepared = job.prepare(n, text)
                if isinstance(prepared, dict):
                    f.append(prepared)
                else:
                    request, prompt = prepared
                    assert all(0 <= t < VOCAB for t in prompt["prompt_token_ids"])
                    f.append(result_record(request, _fake_output(request)))
        _check_one_record_per_line(inp, out, _strict_records(out))


# --------------------------------------------------------------------------- the issue's lines in a real job


def test_the_issues_three_lines_no_longer_stop_a_job(tmp_path, llm):  # noqa: F811
    good = {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    lines = [
        json.dumps({**good, "custom_id": "first"}).encode(),
        b'{"a":' * 10_000 + b"1" + b"}" * 10_000,                                  # RecursionError in json.loads
        json.dumps({**good, "custom_id": "\ud800"}).encode(),                       # unencodable custom_id
        json.dumps({"custom_id": "sur", "prompt": "x\udc80y", "max_tokens": 2}).encode(),  # the tokenizer's TypeError
        json.dumps({**good, "custom_id": "mid"}).encode(),
        b'{"custom_id": "big", "prompt_token_ids": [1, 1000000000, 9223372036854775813]}',
        b'{"custom_id": "cut", "prompt": "def f(',                                  # truncated
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi \udc80"}]}}).encode(),
        json.dumps({**good, "custom_id": "last"}).encode(),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_lines(str(inp), lines)
    summary = run_batch(BatchOptions(input=str(inp), output=str(out), chunk_size=4, progress=False), llm=llm)
    recs = _strict_records(str(out))
    assert [r["line"] for r in recs] == list(range(1, 10)) and summary["num_records"] == 9
    assert [r["custom_id"] for r in recs] == ["first", None, None, "sur", "mid", "big", None, "chat", "last"]
    msg = {r["line"]: r["error"]["message"] for r in recs if "error" in r}
    assert set(msg) == {2, 3, 4, 6, 7, 8}
    assert "nested deeper than the JSON parser allows (RecursionError)" in msg[2]
    assert msg[3].startswith("custom_id is not valid Unicode: lone surrogate U+D800 at index 0")
    assert msg[4].startswith("prompt is not valid Unicode: lone surrogate U+DC80 at index 1")
    assert msg[6] == ("prompt_token_ids has ids outside [0, 4096), the model's vocabulary: "
                      "[1000000000, 9223372036854775813]")
    assert "truncated?" in msg[7] and "Unterminated string" in msg[7]
    assert msg[8].startswith("body.messages[0].content is not valid Unicode: lone surrogate U+DC80 at index 3")
    assert [len(r["token_ids"]) for r in recs if "error" not in r] == [3, 3, 3]
    # The rerun finds every line done (null custom_ids match their unreadable lines): no LLM is even built.
    again = run_batch(BatchOptions(input=str(inp), output=str(out), progress=False), {"model": "/nonexistent"})
    assert again["runs"][0]["records_resumed"] == 9 and _strict_records(str(out)) == recs


@pytest.mark.parametrize("bad", ["a\udc80", {"prompt": "\ud800x"}, {"prompt_token_ids": [1, 2**63 + 5]},
                                 {"prompt_token_ids": [1, 2**4000]}])
def test_record_writer_is_strict_utf8_even_for_a_message_holding_a_surrogate(tmp_path, bad):
    out = tmp_path / "out.jsonl"
    with RecordFile(out) as f:
        f.append(error_record(1, "x", f"the tokenizer failed on {bad}"))  # an exception text quoting the input
        f.append({"custom_id": "y", "line": 2, "text": "ok", "metrics": {"acceptance_rate": float("inf")}})
    recs = _strict_records(str(out))
    assert recs[1]["metrics"]["acceptance_rate"] is None
    if isinstance(bad, str):
        assert recs[0]["error"]["message"] == "the tokenizer failed on a\\udc80"  # backslashreplace: documented
