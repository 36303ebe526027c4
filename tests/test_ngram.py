"""N-gram proposer: vLLM's test vectors plus a brute-force reference under hypothesis.

The reference below is written from the definition (try every n from longest to shortest,
scan every earlier start left to right) and shares no code with the implementation.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.spec_decode.ngram import NgramProposer


def brute_force_ngram_reference(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Definition: longest suffix n-gram (min_n..max_n) with an earlier occurrence ending
    before the last token; earliest such occurrence; up to k tokens after it."""
    n_tok = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n > n_tok:
            continue
        suffix = seq[n_tok - n :]
        for s in range(0, n_tok - n):  # occurrence seq[s:s+n] ends at s+n-1 <= n_tok-2
            if seq[s : s + n] == suffix:
                return seq[s + n : s + n + k]
    return []


def _one(seq, lo, hi, k, max_drafts=None):
    prop = NgramProposer(prompt_lookup_min=lo, prompt_lookup_max=hi, num_speculative_tokens=k)
    (out,) = prop.propose(["r"], [np.asarray(seq, dtype=np.int32)], [k if max_drafts is None else max_drafts])
    assert out.dtype == np.int32 and out.ndim == 1
    return out.tolist()


@pytest.mark.parametrize(
    "seq, lo, hi, k, expected",
    [
        # vLLM tests/v1/spec_decode/test_ngram.py
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),
        ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
        ([1, 2, 3, 4, 5], 2, 2, 2, []),  # no match
        ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),  # only shorter n-grams repeat
        ([5], 1, 1, 3, []),  # too short to have an earlier occurrence
        ([7, 7], 1, 3, 3, [7]),  # overlapping occurrence; stops at the end of the sequence
        ([1, 2, 3, 1, 2, 3], 1, 5, 10, [1, 2, 3]),  # longest n=3; continuation capped by the end
    ],
)
def test_known_vectors(seq, lo, hi, k, expected):
    assert _one(seq, lo, hi, k) == expected


def test_longest_beats_earliest_shorter():
    # suffix [9, 1, 2]: n=3 match at index 4 (later) must win over n=2 match at index 0.
    seq = [1, 2, 50, 0, 9, 1, 2, 60, 9, 1, 2]
    assert _one(seq, 1, 3, 1) == [60]
    assert _one(seq, 1, 2, 1) == [50]


def test_max_drafts_caps_and_zero():
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert _one(seq, 2, 2, 4) == [3, 4, 5, 6]
    assert _one(seq, 2, 2, 4, max_drafts=2) == [3, 4]
    assert _one(seq, 2, 2, 4, max_drafts=0) == []


def test_batch_rows_independent_and_output_is_a_copy():
    prop = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=3)
    a = np.array([1, 2, 3, 1, 2], dtype=np.int32)
    b = np.array([4, 5, 6], dtype=np.int32)
    outs = prop.propose(["a", "b", "c"], [a, b, a], [3, 3, 1])
    assert [o.tolist() for o in outs] == [[3, 1, 2], [], [3]]
    outs[0][:] = -1
    assert a.tolist() == [1, 2, 3, 1, 2]
    prop.finish("a", [1], [2])  # stateless, must not raise


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_lookup_min=0, prompt_lookup_max=2, num_speculative_tokens=2), "prompt_lookup_min"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2, num_speculative_tokens=2), "prompt_lookup_min"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=2, num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(prompt_lookup_min=1.0, prompt_lookup_max=2, num_speculative_tokens=1), "prompt_lookup_min"),
    ],
)
def test_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


def test_mismatched_batch_rejected():
    prop = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2, num_speculative_tokens=2)
    with pytest.raises(ValueError):
        prop.propose(["a", "b"], [np.array([1], dtype=np.int32)], [1, 1])


@settings(max_examples=400, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    lo=st.integers(1, 5),
    span=st.integers(0, 4),
    k=st.integers(1, 6),
    budget=st.integers(0, 7),
)
def test_matches_brute_force_reference(seq, lo, span, k, budget):
    hi = lo + span
    expected = brute_force_ngram_reference(seq, lo, hi, min(k, budget))
    assert _one(seq, lo, hi, k, max_drafts=budget) == expected
