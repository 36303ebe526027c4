"""The command line: vLLM's speculative flag spellings (issue 16 item 3) and the statistics lines (item 4)."""

from __future__ import annotations

import re

import pytest
import yaml

import specjax.cli
from specjax.builtin import DEFAULT_SPEC
from specjax.cli import batch_llm_kwargs, batch_report, build_parser, speculation_report, speculative_config_from_args
from test_batch import tiny  # noqa: F401 - module fixture: a tiny model with the shipped tokenizer


def _spec(*flags: str, command: str = "generate", base=None):
    extra = ["-i", "in", "-o", "out"] if command == "batch" else []
    return speculative_config_from_args(build_parser().parse_args([command, *extra, *flags]), base)


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_vllm_spellings_map_onto_speculative_config(command):
    assert _spec("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max", "4",
                 "--ngram-prompt-lookup-min", "2", command=command) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    for flag in ("--draft-model", "--speculative-model"):
        assert _spec(flag, "/d", "--num-speculative-tokens", "2", command=command) == {
            "model": "/d", "num_speculative_tokens": 2}
    # Older vLLM's way to ask for the ngram proposer.
    assert _spec("--speculative-model", "[ngram]", "--num-speculative-tokens", "2", command=command) == {
        "method": "ngram", "num_speculative_tokens": 2}
    # The whole config as JSON, and one-field flags that agree with it.
    whole = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert _spec("--speculative-config", whole, command=command) == {"method": "ngram", "num_speculative_tokens": 2}
    assert _spec("--speculative-config", whole, "--num-speculative-tokens", "2", "--ngram-prompt-lookup-max", "3",
                 command=command) == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert _spec(command=command) is None and _spec(command=command, base={"x": 1}) == {"x": 1}


@pytest.mark.parametrize("flags,message", [
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--num-speculative-tokens", "4"],
     "--num-speculative-tokens 4 conflicts with --speculative-config's num_speculative_tokens=2"),
    (["--speculative-config", '{"model": "/a", "num_speculative_tokens": 2}', "--draft-model", "/b"],
     "--draft-model /b conflicts with --speculative-config's model='/a'"),
    (["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 2}', "--speculative-model", "[ngram]"],
     "--draft-model [ngram] conflicts with --speculative-config's method='suffix'"),
    (["--speculative-model", "[ngram]", "--speculative-method", "eagle"],
     "--draft-model [ngram] conflicts with --speculative-method eagle"),
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens needs a speculative method"),
])
def test_conflicting_or_incomplete_flags_are_named(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _spec(*flags)


def test_one_field_flags_adjust_the_config_in_use(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "m", "speculative_config": {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}}))

    def kwargs(*flags):
        return batch_llm_kwargs(build_parser().parse_args(["batch", "-i", "in", "-o", "out", *flags]))

    assert kwargs("--config", str(cfg), "--num-speculative-tokens", "2")["speculative_config"] == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    # Naming the method or the draft starts a new config rather than mixing two proposers' fields.
    assert kwargs("--config", str(cfg), "--speculative-method", "ngram", "--num-speculative-tokens", "3")[
        "speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    # No model anywhere: the default pair, whose speculative config the flag adjusts.
    assert kwargs("--num-speculative-tokens", "2")["speculative_config"] == {
        **DEFAULT_SPEC, "num_speculative_tokens": 2}
    assert kwargs("--config", str(cfg))["speculative_config"]["num_speculative_tokens"] == 4  # no flag: as written
    with pytest.raises(ValueError, match="needs a speculative method"):
        kwargs("--model", "m", "--num-speculative-tokens", "2")
    # --int8-activations reaches LLM's int8_activations; unset, the config's value (or LLM's default) stands.
    assert kwargs("--config", str(cfg), "--int8-activations")["int8_activations"] is True
    assert "int8_activations" not in kwargs("--config", str(cfg))
    assert build_parser().parse_args(["generate", "--prompt", "x", "--int8-activations"]).int8_activations is True


def test_cli_reports_flag_errors_without_a_traceback(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    code = specjax.cli.main(["batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--speculative-config",
                             '{"method": "ngram", "num_speculative_tokens": 2}', "--speculative-method", "suffix"])
    err = capsys.readouterr().err
    assert code == 2 and "specjax: error: --speculative-method suffix conflicts with --speculative-config's" in err
    assert specjax.cli.main(["generate", "--prompt-token-ids", "1,x"]) == 2
    assert "--prompt-token-ids must be comma-separated ints, got '1,x'" in capsys.readouterr().err


def test_speculation_report_says_what_was_drafted():
    nothing = {"num_steps": 12, "num_spec_steps": 0, "num_drafts": 0, "num_draft_tokens": 0, "acceptance_rate": 0.0,
               "mean_acceptance_length": 0.0}
    line = speculation_report("ngram", nothing)
    assert line == ("speculative ngram: 0 of 12 steps verified drafts, 12 had none, nothing was drafted, every "
                    "token came from the target alone")
    some = {"num_steps": 10, "num_spec_steps": 7, "num_draft_tokens": 28, "acceptance_rate": 0.5,
            "mean_acceptance_length": 3.0}
    assert speculation_report("draft_model", some) == (
        "speculative draft_model: 7 of 10 steps verified drafts, 3 had none, acceptance rate 0.500, "
        "mean acceptance length 3.00")
    # Metrics being rebuilt: whatever is missing is left out, never a KeyError.
    assert speculation_report("eagle", {"num_drafts": 0}) == (
        "speculative eagle: nothing was drafted, every token came from the target alone")
    assert speculation_report("eagle", {}) == "speculative eagle: no statistics"


def test_batch_report():
    summary = {"num_requests": 3, "num_errors": 1, "num_generated_tokens": 30, "throughput_tokens_per_s": 15.0,
               "num_draft_tokens": 0, "acceptance_rate": None, "mean_acceptance_length": None,
               "runs": [{"records_written": 4, "speculative_method": "ngram",
                         "llm_metrics": {"num_steps": 9, "num_spec_steps": 0}}]}
    assert batch_report("out.jsonl", summary) == (
        "[specjax] out.jsonl: 3 requests, 1 errors, 30 tokens; this run wrote 4 records at 15.0 tokens/s; "
        "speculative ngram: 0 of 9 steps verified drafts, 9 had none, nothing was drafted, every token came from "
        "the target alone")
    plain = {**summary, "runs": [{"records_written": 4, "speculative_method": None}]}
    assert batch_report("o", plain).endswith("this run wrote 4 records at 15.0 tokens/s")


def test_generate_end_to_end_with_vllm_flags(tiny, capsys):  # noqa: F811 - the imported fixture
    code = specjax.cli.main([
        "generate", "--model", tiny, "--prompt-token-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "6",
        "--max-model-len", "64", "--speculative-method", "ngram", "--num-speculative-tokens", "2",
        "--ngram-prompt-lookup-max", "2", "--ngram-prompt-lookup-min", "1", "--no-warmup"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert re.search(r"\[specjax\] speculative ngram: \d+ of \d+ steps verified drafts, \d+ had none", err), err
    assert ("nothing was drafted" in err) != ("acceptance rate" in err)  # acceptance only over real drafts
