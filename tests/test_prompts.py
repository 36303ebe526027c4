"""specjax.prompts: every prompt, however hostile, is accepted or refused with a ValueError naming it
(issue 18 item 5), directly and through ``LLM.generate``, which stays usable afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import specjax
from specjax.prompts import as_prompt_list, check_unicode, parse_prompt, short_repr
from test_batch import llm, tiny  # noqa: F401 - module fixtures: a tiny model with the shipped tokenizer

TOKENIZER = Tokenizer.from_file(str(Path(specjax.__file__).parent / "builtin" / "target" / "tokenizer.json"))


def _parse(prompt, field="prompts[0]", **kw):
    return parse_prompt(prompt, field, tokenizer=TOKENIZER, vocab_size=4096, max_model_len=64, **kw)


def test_good_prompts_in_every_form():
    text, ids = _parse("def f(x):")
    assert text == "def f(x):" and ids == TOKENIZER.encode("def f(x):").ids
    assert _parse({"prompt": "é\x00"})[1] == TOKENIZER.encode("é\x00").ids  # NUL and non-ASCII are valid text
    for ids in ([5, 6], (5, 6), np.array([5, 6], np.int32), [np.int64(5), 6]):
        got = _parse({"prompt_token_ids": ids})[1]
        assert got == [5, 6] and all(type(t) is int for t in got)


@pytest.mark.parametrize("prompt,message", [
    ("a\udc80", r"^prompts\[0\]\.prompt is not valid Unicode: lone surrogate U\+DC80 at index 1"),
    ({"prompt": "\ud800"}, r"^prompts\[0\]\.prompt is not valid Unicode: lone surrogate U\+D800 at index 0"),
    ({"prompt": 5}, r"^prompts\[0\]\.prompt must be a str, got int"),
    ({"prompt": b"x"}, r"^prompts\[0\]\.prompt must be a str, got bytes"),
    (5, r"^prompts\[0\] must be a str or a dict, got int"),
    ({"prompt_token_ids": [1, 1000000000, 9223372036854775813]},
     r"^prompts\[0\]\.prompt_token_ids has ids outside \[0, 4096\), the model's vocabulary: "
     r"\[1000000000, 9223372036854775813\]$"),
    ({"prompt_token_ids": [1, 2**4000]}, r"outside \[0, 4096\), the model's vocabulary: \[<int of 4001 bits>\]"),
    ({"prompt_token_ids": [-1]}, r"outside \[0, 4096\).*\[-1\]"),
    ({"prompt_token_ids": [1, 2.0]}, r"^prompts\[0\]\.prompt_token_ids must be a flat list of ints; item 1 is 2\.0"),
    ({"prompt_token_ids": [True]}, r"item 0 is True"),
    ({"prompt_token_ids": [[1, 2]]}, r"item 0 is \[1, 2\]"),
    ({"prompt_token_ids": np.zeros((2, 2), np.int32)}, r"flat list of ints, got an array of shape \(2, 2\)"),
    ({"prompt_token_ids": np.array([1.5])}, r"flat list of ints, got an array of shape \(1,\) float64"),
    ({"prompt_token_ids": "12"}, r"flat list of ints, got '12'"),
    ({"prompt_token_ids": []}, r"^prompts\[0\] is empty"),
    ({"prompt_token_ids": list(range(65))}, r"65 tokens, more than max_model_len=64"),
    ({1: "x", "a": 2}, r"unknown keys \['a', 1\]"),  # keys of mixed types still make a message
    ({}, r"needs 'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompts_are_value_errors_naming_the_prompt(prompt, message):
    with pytest.raises(ValueError, match=message):
        _parse(prompt)


def test_unforeseen_failures_are_still_value_errors_naming_the_prompt():
    class Exploding:
        def encode(self, text):
            raise RuntimeError("boom")

    with pytest.raises(ValueError, match=r"^prompts\[2\]\.prompt: the tokenizer failed: RuntimeError: boom"):
        parse_prompt("x", "prompts[2]", tokenizer=Exploding(), vocab_size=10, max_model_len=8)

    class Weird(dict):
        def get(self, key, default=None):
            raise KeyError(key)

    with pytest.raises(ValueError, match=r"^prompts\[0\]: unexpected KeyError while reading the prompt"):
        _parse(Weird(prompt="x"))


def test_short_repr_and_check_unicode_never_fail():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert short_repr(deep).startswith("[[[")
    assert short_repr("\ud800" * 500).startswith("'\\ud800") and len(short_repr("x" * 10**6)) <= 120
    assert short_repr(10**5000) == "<int of 16610 bits>"

    class Hostile:
        def __repr__(self):
            raise RuntimeError

    assert short_repr(Hostile()).startswith("<Hostile")
    assert check_unicode("ok é", "f") == "ok é"
    with pytest.raises(ValueError, match=r"^f is not valid Unicode: lone surrogate U\+DFFF at index 2"):
        check_unicode("ab\udfffc", "f")
    with pytest.raises(ValueError, match="bare list of ints is ambiguous"):
        as_prompt_list([1, 2])


def test_generate_refuses_hostile_prompts_by_name_and_stays_usable(llm):  # noqa: F811 - the imported fixture
    params = specjax.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    good = {"prompt_token_ids": [5, 6, 7]}
    before = [o.outputs[0].token_ids for o in llm.generate([good, "def f(x):"], params, use_tqdm=False)]
    for bad, message in [
        ("a\udc80", r"^prompts\[1\]\.prompt is not valid Unicode"),
        ({"prompt_token_ids": [1, 1000000000, 9223372036854775813]},
         r"^prompts\[1\]\.prompt_token_ids has ids outside"),
        ({"prompt_token_ids": [1, 2**200]}, r"^prompts\[1\]\.prompt_token_ids has ids outside"),
        ({"prompt": ["x"]}, r"^prompts\[1\]\.prompt must be a str"),
        (None, r"^prompts\[1\] must be a str or a dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, bad, "def f(x):"], params, use_tqdm=False)
        with pytest.raises(ValueError, match=message.replace("1", "0", 1)):
            llm.validate_prompt(bad, field="prompts[0]")
    after = [o.outputs[0].token_ids for o in llm.generate([good, "def f(x):"], params, use_tqdm=False)]
    assert after == before and llm.get_metrics()["num_requests"] == 4  # nothing of the refused calls ran
