"""``specjax batch``: input parsing and error records, crash-safe resume (a real kill -9), multi-host merge, configs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import specjax
from specjax import batch
from specjax.batch import BatchOptions, ChatTemplate, RecordFile, parse_line, run_batch
from specjax.cli import batch_llm_kwargs, build_parser
from specjax.parallel import multihost
from tiny_models import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
BUILTIN_TARGET = REPO / "specjax" / "builtin" / "target"
VOCAB = 4096  # the shipped tokenizer's, so text and chat prompts work on the tiny model
# Two compiled row/query buckets keep every LLM (in process and in the subprocesses) quick to build.
LLM_KW = dict(max_model_len=96, max_num_seqs=2, batch_buckets=[2], query_buckets=[1, 16], seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random Llama with the shipped pair's tokenizer (ids < 4096, EOS 0 never hit by greedy in practice)."""
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), vocab_size=VOCAB, hidden_size=64, num_layers=2,
                             eos_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUILTIN_TARGET / name, d / name)
    return str(d)


@pytest.fixture(scope="module")
def llm(tiny):
    return specjax.LLM(tiny, **LLM_KW)


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _content(records) -> list[tuple]:
    """What must not change across resume / sharding: everything but timings."""
    return [(r["line"], r["custom_id"], r.get("token_ids"), r.get("text"), r.get("finish_reason"), r.get("error"))
            for r in records]


def _openai(cid, url, body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


# --------------------------------------------------------------------------- parsing


def test_parse_every_input_form():
    r = parse_line(json.dumps(_openai("a", "/v1/completions", {
        "prompt": "def f(x):", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
        "stop_token_ids": [2, 4], "ignore_eos": True, "model": "whatever", "n": 1, "stream": False})), 1)
    assert (r.custom_id, r.url, r.prompt, r.prompt_token_ids, r.line) == ("a", "/v1/completions", "def f(x):", None, 1)
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids, p.ignore_eos) == (
        7, 0.5, 0.9, 5, 3, (2, 4), True)
    # prompt as token ids, or a one-element list of either form
    assert parse_line(json.dumps(_openai("b", "/v1/completions", {"prompt": [5, 6]})), 2).prompt_token_ids == (5, 6)
    assert parse_line(json.dumps(_openai("b", "/v1/completions", {"prompt": [[5, 6]]})), 2).prompt_token_ids == (5, 6)
    assert parse_line(json.dumps(_openai("b", "/v1/completions", {"prompt": ["hi"]})), 2).prompt == "hi"
    chat = parse_line(json.dumps(_openai("c", "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}],
        "max_completion_tokens": 9})), 3)
    assert chat.prompt == "system: be brief\nuser: hello\nassistant:" and chat.add_special_tokens
    assert chat.params.max_tokens == 9 and chat.prompt_field == "body.messages"
    # plain forms: custom_id defaults to the line number, sampling fields sit beside the prompt
    plain = parse_line('{"prompt": "x = 1", "max_tokens": 3}', 12)
    assert (plain.custom_id, plain.url, plain.prompt, plain.params.max_tokens) == ("12", None, "x = 1", 3)
    ids = parse_line('{"custom_id": "k", "prompt_token_ids": [1, 2, 3]}', 4, defaults={"max_tokens": 5})
    assert (ids.custom_id, ids.prompt_token_ids, ids.params.max_tokens) == ("k", (1, 2, 3), 5)
    # A line without a seed gets one from its line number: the same in every process and on every resume.
    assert ids.params.seed == parse_line('{"prompt_token_ids": [9]}', 4).params.seed
    assert ids.params.seed != parse_line('{"prompt_token_ids": [9]}', 5).params.seed
    assert ids.params.seed != parse_line('{"prompt_token_ids": [9]}', 4, base_seed=1).params.seed


@pytest.mark.parametrize("line,needle", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps(_openai("a", "/v1/embeddings", {"input": "x"})), "url must be one of"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}), "method"),
    (json.dumps({"custom_id": "a", "url": "/v1/completions"}), "body must be a JSON object"),
    (json.dumps(_openai("a", "/v1/completions", {"max_tokens": 3})), "body.prompt is missing"),
    (json.dumps(_openai("a", "/v1/chat/completions", {"prompt": "x"})), "body.prompt is not a supported field"),
    (json.dumps(_openai("a", "/v1/chat/completions", {"messages": []})), "body.messages must be a non-empty list"),
    (json.dumps(_openai("a", "/v1/chat/completions", {"messages": [{"role": "user"}]})), "body.messages[0].content"),
    (json.dumps(_openai("a", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": "x"}]}]})), "body.messages[0].content[0]"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "temperature": -1})), "body.temperature"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "max_tokens": "ten"})), "body.max_tokens"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "top_p": 0})), "body.top_p"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "stop_token_ids": "3"})), "body.stop_token_ids"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "best_of": 2})), "body.best_of=2 is not supported"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "frequency_penalty": 5.0})), "body.frequency_penalty"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "n": 0})), "body.n"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "logprobs": 99})), "body.logprobs"),
    (json.dumps(_openai("a", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2})), "body.top_logprobs needs"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": "x", "max_tokens": 3, "max_completion_tokens": 3})),
     "body.max_completion_tokens is not a supported field"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": ["a", "b"]})), "put one prompt per line"),
    (json.dumps(_openai("a", "/v1/completions", {"prompt": 5})), "body.prompt must be"),
    (json.dumps({**_openai("a", "/v1/completions", {"prompt": "x"}), "extra": 1}), "unknown keys ['extra']"),
    (json.dumps({"custom_id": 7, "prompt": "x"}), "custom_id must be a string"),
    (json.dumps({"text": "x"}), "text is not a supported field"),
    (json.dumps({"max_tokens": 3}), "missing 'prompt'"),
    (json.dumps({"prompt_token_ids": [1, "2"]}), "prompt_token_ids must be a non-empty list of ints"),
    (json.dumps({"prompt": "x", "prompt_token_ids": [1]}), "not both"),
    (json.dumps({"prompt": "x", "ignore_eos": "yes"}), "ignore_eos must be a bool"),
])
def test_parse_errors_name_the_field(line, needle):
    with pytest.raises(ValueError) as info:
        parse_line(line, 1)
    assert needle in str(info.value)


def test_chat_lines_render_with_the_models_template(tmp_path):
    """(Templates themselves: test_chat.py.) A template failure, or a template that does not load, is the line's."""
    line = json.dumps(_openai("a", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    (tmp_path / "chat_template.jinja").write_text("<{{ messages[0]['content'] }}>")
    r = parse_line(line, 1, chat_template=ChatTemplate.for_model(tmp_path))
    assert (r.prompt, r.add_special_tokens, r.prompt_field) == ("<hi>", False, "body.messages")
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="body.messages: the chat template failed.*no system role"):
        parse_line(line, 1, chat_template=ChatTemplate.for_model(tmp_path))

    def unloadable():
        raise ValueError("body.messages: tokenizer_config.json: the chat template does not compile")

    with pytest.raises(batch.LineError, match="does not compile") as info:
        parse_line(line, 1, chat_template=unloadable)
    assert info.value.custom_id == "a"


# --------------------------------------------------------------------------- the record file


def test_record_file_drops_a_torn_tail_and_refuses_foreign_files(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [json.dumps(batch.error_record(n, str(n), "x")) + "\n" for n in (1, 2)]
    out.write_text("".join(good) + '{"custom_id": "3", "line": 3, "te')  # killed mid-write
    with RecordFile(out) as f:
        assert f.done == {1: "1", 2: "2"}
        assert out.read_text() == "".join(good)  # truncated back to the last complete record
        f.append(batch.error_record(3, "3", "y"))
        with pytest.raises(ValueError, match="another specjax batch"):
            RecordFile(out)  # a second writer is locked out
    assert [r["line"] for r in _records(out)] == [1, 2, 3]
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="foreign.jsonl:1 is not a specjax batch record"):
        RecordFile(foreign)
    assert foreign.read_text() == '{"a": 1}\n'  # untouched


# --------------------------------------------------------------------------- jobs on a real (tiny) LLM


def _mixed_input(path: Path) -> Path:
    _write_jsonl(path, [
        _openai("t", "/v1/completions", {"prompt": "def parse(argv):", "max_tokens": 6, "temperature": 0,
                                         "ignore_eos": True}),
        _openai("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "import os"}],
                                              "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
        "{broken",
        "",
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        {"custom_id": "oov", "prompt_token_ids": [5, VOCAB + 1]},
        {"custom_id": "long", "prompt_token_ids": list(range(1, 120))},
        {"custom_id": "s", "prompt_token_ids": [8, 9], "max_tokens": 5, "temperature": 1.0, "ignore_eos": True},
        _openai("u", "/v1/completions", {"prompt": "x", "temperature": -2}),
    ])
    with open(path, "ab") as f:
        f.write(b'{"prompt": "\xff"}\n')  # not UTF-8
    return path


def test_job_writes_one_record_per_line_in_order_and_resumes(tmp_path, llm):
    inp = _mixed_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    summary = run_batch(BatchOptions(input=str(inp), output=str(out), chunk_size=3, progress=False), llm=llm)
    recs = _records(out)
    assert [r["line"] for r in recs] == [1, 2, 3, 5, 6, 7, 8, 9, 10]  # blank line 4: no record
    # Unreadable lines (3: not JSON, 10: not UTF-8) have no custom_id; a readable one without gets its line number.
    assert [r["custom_id"] for r in recs] == ["t", "c", None, "5", "oov", "long", "s", "u", None]
    errors = {r["line"]: r["error"] for r in recs if "error" in r}
    assert set(errors) == {3, 6, 7, 9, 10}
    assert "not valid UTF-8 (byte 0xff at offset 12)" in errors[10]["message"]
    assert errors[3]["line"] == 3 and "invalid JSON" in errors[3]["message"]
    assert "prompt_token_ids has ids outside [0, 4096)" in errors[6]["message"]
    assert "119 tokens, more than max_model_len=96" in errors[7]["message"]
    assert errors[9]["message"].startswith("body.temperature")
    ok = {r["custom_id"]: r for r in recs if "error" not in r}
    assert [len(ok[c]["token_ids"]) for c in ("t", "c", "5", "s")] == [6, 5, 4, 5]
    assert ok["t"]["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("def parse(argv):").ids)
    assert ok["c"]["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("user: import os\nassistant:").ids)
    assert ok["t"]["text"] == llm.tokenizer.decode(ok["t"]["token_ids"])
    assert set(ok["t"]["metrics"]) >= {"num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "num_spec_steps",
                                       "time_to_first_token_s", "latency_s"}
    assert (summary["num_records"], summary["num_requests"], summary["num_errors"]) == (9, 4, 5)
    assert summary["num_generated_tokens"] == 20 and summary["latency_s"]["p50"] > 0
    assert summary["throughput_tokens_per_s"] > 0 and summary["acceptance_rate"] is None
    assert json.loads((tmp_path / "out.summary.json").read_text())["num_records"] == 9

    # Rerun with nothing left: no LLM is even built (these kwargs would fail), no record is added.
    again = run_batch(BatchOptions(input=str(inp), output=str(out), progress=False), {"model": "/nonexistent"})
    assert _records(out) == recs and again["runs"][0]["records_resumed"] == 9

    # Crash mid-file: the last three records gone and a torn fragment left; resuming restores the same content,
    # sampled line included (its seed comes from its line number, not from the order requests were made).
    raw = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(raw[:5]) + raw[5][:17])
    run_batch(BatchOptions(input=str(inp), output=str(out), chunk_size=2, progress=False), llm=llm)
    assert _content(_records(out)) == _content(recs)


def test_a_different_input_is_not_appended_to_an_old_output(tmp_path, llm):
    out = tmp_path / "out.jsonl"
    first = _write_jsonl(tmp_path / "a.jsonl", [{"custom_id": "x", "prompt_token_ids": [3], "max_tokens": 2}])
    run_batch(BatchOptions(input=str(first), output=str(out), progress=False), llm=llm)
    other = _write_jsonl(tmp_path / "b.jsonl", [{"custom_id": "y", "prompt_token_ids": [3], "max_tokens": 2}])
    with pytest.raises(ValueError, match="custom_id 'x' but .* has 'y'"):
        run_batch(BatchOptions(input=str(other), output=str(out), progress=False), llm=llm)


def test_a_request_the_chunk_rejects_is_isolated(tmp_path, llm, monkeypatch):
    """If a bad prompt slips past pre-validation, generate() rejects its chunk: each request then runs alone."""
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": ids, "max_tokens": 3, "temperature": 0}
                                               for ids in ([4, 5], [6, VOCAB + 7], [8])])
    job = batch.BatchJob(BatchOptions(input=str(inp), output=str(tmp_path / "out.jsonl"), progress=False), llm=llm)
    monkeypatch.setattr(job, "_llm_prompt", lambda request: {"prompt_token_ids": list(request.prompt_token_ids)})
    job.run()
    recs = _records(tmp_path / "out.jsonl")
    assert ["error" in r for r in recs] == [False, True, False]
    assert "outside [0, 4096)" in recs[1]["error"]["message"]


POISON = 77  # a token that makes the patched LLM.generate below fail any batch holding it


def _failing_generate(llm, monkeypatch, fails):
    """Patch ``llm.generate`` to raise RuntimeError when ``fails(prompts)``; returns the list of calls' sizes."""
    real, calls = llm.generate, []

    def generate(prompts, params=None, **kw):
        calls.append(len(prompts))
        if fails(prompts):
            raise RuntimeError("device says no")
        return real(prompts, params, **kw)

    monkeypatch.setattr(llm, "generate", generate)
    return calls


def test_a_request_that_fails_generation_fails_alone(tmp_path, llm, monkeypatch):
    """A non-ValueError failure pinned on one request: its record says so, its chunk-mates run as without it."""
    rows = [{"custom_id": f"r{i}", "prompt_token_ids": [4 + i, POISON if i == 3 else 9, 11], "max_tokens": 4,
             "ignore_eos": True, **({"temperature": 0} if i % 2 else {})} for i in range(6)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    run_batch(BatchOptions(input=str(inp), output=str(tmp_path / "clean.jsonl"), progress=False), llm=llm)
    calls = _failing_generate(llm, monkeypatch,
                              lambda prompts: any(POISON in p["prompt_token_ids"] for p in prompts))
    summary = run_batch(BatchOptions(input=str(inp), output=str(tmp_path / "out.jsonl"), chunk_size=6,
                                     progress=False), llm=llm)
    recs, clean = _records(tmp_path / "out.jsonl"), _records(tmp_path / "clean.jsonl")
    assert [r["line"] for r in recs] == [1, 2, 3, 4, 5, 6] and summary["num_errors"] == 1
    assert recs[3]["custom_id"] == "r3"
    assert recs[3]["error"]["message"] == "line 4, generation: unexpected RuntimeError: device says no"
    assert _content(recs[:3] + recs[4:]) == _content(clean[:3] + clean[4:])  # sampled lines included
    # Bisection: 6 -> 3 + 3 -> (1 + 2) + ... -> the one-token probe after the culprit failed alone.
    assert len(calls) < 12 and 1 in calls


def test_a_failure_no_request_explains_stops_the_job_and_the_rerun_resumes(tmp_path, llm, monkeypatch):
    rows = [{"prompt_token_ids": [4 + i, 9], "max_tokens": 3, "temperature": 0} for i in range(4)]
    inp = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    broken = {"on": False}
    real = llm.generate

    def generate(prompts, params=None, **kw):
        if broken["on"]:
            raise RuntimeError("device lost")
        out_ = real(prompts, params, **kw)
        broken["on"] = True  # the engine dies after the first chunk, probe included
        return out_

    monkeypatch.setattr(llm, "generate", generate)
    with pytest.raises(RuntimeError, match="device lost"):
        run_batch(BatchOptions(input=str(inp), output=str(out), chunk_size=2, progress=False), llm=llm)
    assert [r["line"] for r in _records(out)] == [1, 2]  # no error records for a failure that is not theirs
    monkeypatch.setattr(llm, "generate", real)
    run_batch(BatchOptions(input=str(inp), output=str(out), chunk_size=2, progress=False), llm=llm)
    assert [("error" in r, r["line"]) for r in _records(out)] == [(False, 1), (False, 2), (False, 3), (False, 4)]


def test_speculative_job_reports_acceptance(tmp_path, tiny):
    # The model drafting for itself: under greedy every draft is accepted. Fixed K: a draft as costly as its
    # target does not pay, so the adaptive controller may rightly decode plainly (and then nothing is drafted).
    spec_llm = specjax.LLM(tiny, **LLM_KW, speculative_config={
        "method": "draft_model", "model": tiny, "num_speculative_tokens": 2, "adaptive": False})
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [4 + i, 9], "max_tokens": 7, "temperature": 0}
                                               for i in range(3)])
    summary = run_batch(BatchOptions(input=str(inp), output=str(tmp_path / "out.jsonl"), progress=False),
                        llm=spec_llm)
    for r in _records(tmp_path / "out.jsonl"):
        m = r["metrics"]
        assert m["num_spec_steps"] > 0 and m["num_accepted_tokens"] == m["num_draft_tokens"] > 0
        assert m["acceptance_rate"] == 1.0
    # Every spec step verified at least one draft and all were accepted: at least 2 tokens per step (more with K > 1,
    # which the engine's K controller may or may not pick).
    assert summary["acceptance_rate"] == 1.0 and summary["mean_acceptance_length"] >= 2
    assert summary["runs"][0]["llm_metrics"]["acceptance_rate"] == 1.0


# --------------------------------------------------------------------------- configs and the CLI


def test_shipped_configs_load_and_unknown_keys_are_named(tmp_path):
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert {c.name for c in configs} >= {"builtin.yaml", "llama3.1-8b-eagle3.yaml", "qwen3-8b-draft-qwen3-0.6b.yaml"}
    for c in configs:
        assert set(batch.load_config(c)) <= set(batch.llm_argument_names())
    assert batch.load_config(REPO / "configs" / "builtin.yaml")["speculative_config"]["num_speculative_tokens"] == 4
    # The file validates; its model paths are placeholders for local copies, so building the LLM names them.
    eagle = batch.load_config(REPO / "configs" / "llama3.1-8b-eagle3.yaml")
    assert eagle["speculative_config"]["method"] == "eagle3"
    with pytest.raises(ValueError, match="Meta-Llama-3.1-8B-Instruct"):
        specjax.LLM(**eagle)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: builtin:target\nmax_num_seq: 4\n")
    with pytest.raises(ValueError, match="unknown key 'max_num_seq'"):
        batch.load_config(bad)
    bad.write_text("speculative_config:\n  method: ngram\n  num_speculative_token: 2\n")
    with pytest.raises(ValueError, match="unknown key 'speculative_config.num_speculative_token'"):
        batch.load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping of LLM arguments"):
        batch.load_config(bad)


def test_cli_flags_override_the_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "m", "max_num_seqs": 4, "dtype": "bfloat16", "batch_buckets": [4]}))
    args = build_parser().parse_args(["batch", "-i", "in", "-o", "out", "--config", str(cfg), "--max-num-seqs", "2",
                                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert batch_llm_kwargs(args) == {"model": "m", "max_num_seqs": 2, "dtype": "bfloat16", "batch_buckets": [4],
                                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    plain = build_parser().parse_args(["batch", "-i", "in", "-o", "out"])
    assert batch_llm_kwargs(plain) == {}  # LLM() with no model: the default pair, as `specjax generate`
    with pytest.raises(SystemExit):
        build_parser().parse_args(["batch", "-i", "in", "-o", "out", "--speculative-config", "[1]"])


# --------------------------------------------------------------------------- kill -9 and multi-host (subprocesses)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specjax.cli", "batch", "--no-progress", *args]


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu")


N_JOB = 32  # lines; with one request per chunk a record lands every ~20 ms, so a kill lands mid-run


@pytest.fixture(scope="module")
def job_files(tmp_path_factory, tiny, llm):
    """An input of greedy and sampled lines, its YAML config, and the records of one clean in-process run."""
    d = tmp_path_factory.mktemp("job")
    rows = []
    for i in range(N_JOB):
        row = {"custom_id": f"r{i}", "prompt_token_ids": [4 + i, 7 + 2 * i, 11], "max_tokens": 48, "ignore_eos": True}
        if i % 4:
            row["temperature"] = 0.0  # every fourth line samples (temperature 1, seed from its line number)
        rows.append(row)
    inp = _write_jsonl(d / "in.jsonl", rows)
    cfg = d / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({"model": tiny, **LLM_KW}))
    run_batch(BatchOptions(input=str(inp), output=str(d / "clean.jsonl"), progress=False), llm=llm)
    return inp, cfg, _records(d / "clean.jsonl")


def test_resume_after_kill_9(tmp_path, job_files):
    inp, cfg, clean = job_files
    out = tmp_path / "out.jsonl"
    # One request per chunk, so records appear one by one while the job runs.
    proc = subprocess.Popen(_cli("-i", str(inp), "-o", str(out), "--config", str(cfg), "--chunk-size", "1"),
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.002)
    assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    done = out.read_bytes().count(b"\n")
    assert 2 <= done < len(clean), done
    res = subprocess.run(_cli("-i", str(inp), "-o", str(out), "--config", str(cfg)), env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = _records(out)
    assert sorted(r["custom_id"] for r in recs) == sorted(f"r{i}" for i in range(N_JOB))  # each exactly once
    assert _content(recs) == _content(clean)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["runs"][0]["records_resumed"] >= done and summary["num_records"] == N_JOB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_job_merges_to_the_single_process_output(tmp_path, job_files):
    inp, cfg, clean = job_files
    out = tmp_path / "out.jsonl"
    port = _free_port()
    procs = [subprocess.Popen(_cli("-i", str(inp), "-o", str(out), "--config", str(cfg),
                                   "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                                   "--process-id", str(i)),
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
    parts = [_records(multihost.part_path(out, i, 2)) for i in range(2)]
    assert [r["line"] for r in parts[0]] == list(range(1, N_JOB + 1, 2))  # process i: (line - 1) % 2 == i
    assert [r["line"] for r in parts[1]] == list(range(2, N_JOB + 1, 2))
    assert _content(_records(out)) == _content(clean)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["num_records"] == N_JOB
    assert sorted(r["process_index"] for r in summary["runs"]) == [0, 1]


def test_merge_checks_every_line_is_there(tmp_path):
    inp = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": str(i)} for i in range(5)])
    out = tmp_path / "out.jsonl"
    for i in range(2):
        with RecordFile(multihost.part_path(out, i, 2)) as f:
            for line in range(1 + i, 6, 2):
                if line != 5:  # process 0 has not finished line 5
                    f.append(batch.error_record(line, str(line), "x"))
    with pytest.raises(ValueError, match="input line 5 has no record .* rerun process 0 of 2"):
        batch.merge_parts(inp, out)
    assert not out.exists()
    with RecordFile(multihost.part_path(out, 0, 2)) as f:
        f.append(batch.error_record(5, "5", "x"))
    assert specjax.cli.main(["batch", "--merge", "-i", str(inp), "-o", str(out)]) == 0
    assert [r["line"] for r in _records(out)] == [1, 2, 3, 4, 5]
    os.remove(multihost.part_path(out, 1, 2))
    with pytest.raises(ValueError, match="missing part files"):
        batch.merge_parts(inp, out, 2)


def test_process_layout_and_initialize_arguments():
    info = multihost.ProcessInfo(index=1, count=3)
    assert [n for n in range(7) if info.owns(n)] == [1, 4]
    assert multihost.part_path("o.jsonl", 1, 3) == "o.jsonl.part-00001-of-00003"
    with pytest.raises(ValueError, match="process_id must be in"):
        multihost.ProcessInfo(index=3, count=3)
    with pytest.raises(ValueError, match="num_processes must be >= 1"):
        multihost.initialize("127.0.0.1:1234", 0, 0)
    with pytest.raises(ValueError, match="coordinator_address must be HOST:PORT"):
        multihost.initialize("localhost", 2, 0)
    assert multihost.process_info() == multihost.ProcessInfo()  # nothing was initialised
    args = argparse.Namespace(distributed=None, coordinator_address=None, num_processes=None, process_id=None)
    assert specjax.cli._batch_process(args) == multihost.ProcessInfo()
