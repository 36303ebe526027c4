"""SuffixDecoding proposer.

``brute_force_suffix_reference`` re-derives every proposal from the definition in
``specjax/spec_decode/suffix.py``'s docstring by counting substring occurrences
directly (no trie, no lazy leaves, no incremental state); it shares no code with the
implementation. Hand-built cases check the behaviours the paper is about.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.spec_decode.suffix import SuffixConfig, SuffixProposer


# --------------------------------------------------------------------------- reference
def _occurrences(docs: list[list[int]], w: list[int]) -> list[tuple[int, int]]:
    """(doc index, end position) of every occurrence of w."""
    n = len(w)
    return [(d, s + n) for d, doc in enumerate(docs) for s in range(len(doc) - n + 1) if doc[s : s + n] == w]


def _children(docs, w, depth_cap) -> dict[int, int]:
    """Child token -> count(w + [token]) in the depth-capped trie of all suffixes of docs."""
    if len(w) >= depth_cap:
        return {}
    out: dict[int, int] = {}
    for d, end in _occurrences(docs, w):
        if end < len(docs[d]):
            out[docs[d][end]] = out.get(docs[d][end], 0) + 1
    return out


def _reference_one_tree(seq, docs, c, k_depth, factor, min_prob):
    n = len(seq)
    m_limit = max(1, k_depth - c)
    for m in range(min(n, m_limit), 0, -1):
        if _children(docs, seq[n - m :], k_depth):
            break
    else:
        return [], 0.0
    cap = min(c, max(1, math.floor(factor * m)), k_depth - m)
    path, prob, score, out = list(seq[n - m :]), 1.0, 0.0, []
    while len(out) < cap:
        ch = _children(docs, path, k_depth)
        if not ch:
            break
        tok = min(ch, key=lambda t: (-ch[t], t))
        prob *= ch[tok] / len(_occurrences(docs, path))
        if prob < min_prob:
            break
        out.append(tok)
        score += prob
        path.append(tok)
    return out, score


def brute_force_suffix_reference(seq, finished_outputs, *, k, depth, max_cached, factor, min_prob, budget):
    """Proposal by definition: per-request tree = [seq]; global tree = last max_cached non-empty outputs."""
    c = min(budget, k)
    if c <= 0:
        return []
    kept = [o for o in finished_outputs if o]
    kept = kept[max(0, len(kept) - max_cached) :] if max_cached else []
    local, local_score = _reference_one_tree(seq, [seq], c, depth, factor, min_prob)
    if kept:
        glob, glob_score = _reference_one_tree(seq, kept, c, depth, factor, min_prob)
        if glob_score > local_score:
            return glob
    return local


# --------------------------------------------------------------------------- helpers
def _arr(x):
    return np.asarray(x, dtype=np.int32)


def _propose_one(prop, rid, seq, budget):
    (out,) = prop.propose([rid], [_arr(seq)], [budget])
    assert out.dtype == np.int32 and out.ndim == 1
    return out.tolist()


# --------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("k", [1, 5, 8])
def test_repeated_pattern_is_drafted_exactly(k):
    rng = np.random.default_rng(0)
    pattern = list(range(100, 120))  # 20 distinct tokens
    prefix = rng.integers(0, 50, size=30).tolist()
    stream = prefix + pattern * 4
    prop = SuffixProposer(num_speculative_tokens=k)
    first_rep_done = len(prefix) + len(pattern)
    for n in range(1, len(stream)):
        drafts = _propose_one(prop, "r", stream[:n], k)
        if n < first_rep_done:
            continue
        j = n - first_rep_done  # tokens into the second repetition
        expected = [pattern[(n - len(prefix) + i) % 20] for i in range(k)]
        if j >= k:
            assert drafts == expected, (n, drafts, expected)
        elif j >= 1:
            assert drafts == expected[: len(drafts)] and len(drafts) == min(k, j)


def test_global_tree_helps_new_request():
    output_a = list(range(200, 240))
    prompt_b = list(range(1, 11)) + output_a[:8]  # B's own history holds no repeat
    k = 6
    fresh = SuffixProposer(num_speculative_tokens=k)
    assert _propose_one(fresh, "b", prompt_b, k) == []

    prop = SuffixProposer(num_speculative_tokens=k)
    prop.propose(["a"], [_arr(list(range(50, 60)) + output_a[:3])], [k])
    prop.finish("a", list(range(50, 60)), output_a)
    assert _propose_one(prop, "b", prompt_b, k) == output_a[8 : 8 + k]


def test_higher_scoring_tree_wins():
    # Local (D=6, K=3): pattern [2, 3, 9] seen once before -> drafts [2, 3, 9], each with path
    # probability 1/2 (the current occurrence counts too): score 1.5.
    seq = [9, 2, 3, 9, 2, 3, 9]
    kw = dict(num_speculative_tokens=3, max_tree_depth=6)
    prop = SuffixProposer(**kw)
    # Global match [9] (length 1 -> at most 1 draft at max_spec_factor 1): [1], score 1.0.
    prop.finish("old", [], [9, 1, 4, 4])
    assert _propose_one(prop, "r", seq, 3) == [2, 3, 9]
    # Global match [3, 9] (length 2): [7, 7] with probability 1 each, score 2.0 > 1.5.
    prop = SuffixProposer(**kw)
    prop.finish("old", [], [3, 9, 7, 7, 7])
    assert _propose_one(prop, "r", seq, 3) == [7, 7]


def test_finish_drops_request_state():
    prop = SuffixProposer(num_speculative_tokens=4)
    prop.propose(["a", "b"], [_arr([1, 2, 3, 1, 2]), _arr([4, 5])], [4, 4])
    assert prop.num_active_requests == 2
    prop.finish("a", [1, 2, 3], [1, 2])
    assert prop.num_active_requests == 1
    prop.finish("b", [4], [5])
    prop.finish("never-seen", [1], [])  # unknown id / empty output: fine
    assert prop.num_active_requests == 0
    assert prop.num_cached_requests == 2  # the empty output is not cached


def test_eviction_bound_and_forgetting():
    k = 4
    prop = SuffixProposer(num_speculative_tokens=k, max_cached_requests=3)
    outputs = [[1000 * (i + 1) + t for t in range(30)] for i in range(10)]
    for i, out in enumerate(outputs):
        prop.finish(f"r{i}", [0], out)
        assert prop.num_cached_requests == min(i + 1, 3)
    # Oldest forgotten, newest remembered.
    assert _propose_one(prop, "q0", [7, 7, 8] + outputs[0][:5], k) == []
    assert _propose_one(prop, "q9", [7, 7, 8] + outputs[9][:5], k) == outputs[9][5 : 5 + k]
    # Node count bounded by what 3 outputs need, not by everything ever finished.
    rng = np.random.default_rng(1)
    small = SuffixProposer(num_speculative_tokens=k, max_cached_requests=2)
    for i in range(200):
        small.finish(f"x{i}", [], rng.integers(0, 6, size=40).tolist())
    assert small.num_cached_requests == 2
    assert small._global.num_nodes <= 1 + 2 * 40 * 24


def test_max_drafts_respected():
    rng = np.random.default_rng(2)
    k = 5
    prop = SuffixProposer(num_speculative_tokens=k, min_token_prob=0.0)
    seqs = [rng.integers(0, 3, size=n) for n in (0, 1, 5, 40, 200)]
    for budget in (0, 1, 2, 5, 9):
        outs = prop.propose([f"r{i}" for i in range(len(seqs))], [_arr(s) for s in seqs], [budget] * len(seqs))
        for out in outs:
            assert len(out) <= min(budget, k)
        if budget == 0:
            assert all(len(o) == 0 for o in outs)
        else:
            assert len(outs[3]) >= 1  # a 40-token 3-letter sequence always repeats


def test_rebuild_when_sequence_is_not_an_extension():
    prop = SuffixProposer(num_speculative_tokens=3, max_spec_factor=3.0)  # 1-token matches may draft 3
    assert _propose_one(prop, "r", [1, 2, 3, 1, 2], 3) == [3, 1, 2]
    # Same id, different history (e.g. preempted and recomputed differently): no stale state.
    assert _propose_one(prop, "r", [5, 6, 7, 5], 3) == [6, 7, 5]
    assert _propose_one(prop, "r", [5, 6], 3) == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=2, max_tree_depth=1), "max_tree_depth"),
        (dict(num_speculative_tokens=2, max_cached_requests=-1), "max_cached_requests"),
        (dict(num_speculative_tokens=2, max_spec_factor=0.0), "max_spec_factor"),
        (dict(num_speculative_tokens=2, max_spec_factor=float("nan")), "max_spec_factor"),
        (dict(num_speculative_tokens=2, min_token_prob=1.5), "min_token_prob"),
        (dict(num_speculative_tokens=2.0), "num_speculative_tokens"),
    ],
)
def test_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixProposer(**kwargs)
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**kwargs)


def test_config_is_frozen():
    prop = SuffixProposer(num_speculative_tokens=2)
    with pytest.raises(AttributeError):
        prop.config.max_tree_depth = 3


# --------------------------------------------------------------------------- properties
_params = dict(
    k=st.integers(1, 6),
    depth=st.integers(2, 8),
    max_cached=st.integers(0, 3),
    factor=st.sampled_from([0.3, 1.0, 2.5]),
    min_prob=st.sampled_from([0.0, 0.1, 0.4, 0.7]),
)


@settings(max_examples=250, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), max_size=30),
    finished=st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=5),
    budget=st.integers(0, 7),
    **_params,
)
def test_matches_brute_force_reference(seq, finished, budget, k, depth, max_cached, factor, min_prob):
    prop = SuffixProposer(
        num_speculative_tokens=k, max_tree_depth=depth, max_cached_requests=max_cached,
        max_spec_factor=factor, min_token_prob=min_prob,
    )
    for i, out in enumerate(finished):
        prop.finish(f"done{i}", [], out)
    expected = brute_force_suffix_reference(
        seq, finished, k=k, depth=depth, max_cached=max_cached, factor=factor, min_prob=min_prob, budget=budget
    )
    assert _propose_one(prop, "q", seq, budget) == expected


def test_a_rewritten_tail_without_finish_rebuilds_the_request_tree():
    """Breaking the grow-only contract in the recent tokens is caught: [0, 0] then [0, 1] under the same id
    drafts what a fresh proposer drafts for [0, 1] (nothing), not the stale tree's 0."""
    kw = dict(num_speculative_tokens=1, max_tree_depth=2, max_cached_requests=0, min_token_prob=0.0)
    live = SuffixProposer(**kw)
    assert _propose_one(live, "r", [0, 0], 1) == [0]
    assert _propose_one(live, "r", [0, 1], 1) == _propose_one(SuffixProposer(**kw), "r", [0, 1], 1) == []


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=5), st.integers(0, 6)),
        min_size=1, max_size=12,
    ),
    finished=st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=3),
    **_params,
)
def test_incremental_equals_rebuild(steps, finished, k, depth, max_cached, factor, min_prob):
    """One long-lived proposer fed a growing sequence step by step gives the same drafts as a fresh
    proposer per step, and both match the reference. A rewrite (not an extension) follows the contract:
    the old request finishes first (its tokens join the global tree), then the id is re-used."""
    kw = dict(num_speculative_tokens=k, max_tree_depth=depth, max_cached_requests=max_cached,
              max_spec_factor=factor, min_token_prob=min_prob)
    live = SuffixProposer(**kw)
    seq: list[int] = []
    done: list[list[int]] = []
    for step, (rewrite, tail, budget) in enumerate(steps):
        if rewrite and seq:
            live.finish("r", [], seq)
            done.append(seq)
            seq = seq[: len(seq) // 2] + [(seq[-1] + 1) % 4]  # not an extension
        seq = seq + tail
        if step < len(finished):  # global tree changes between steps too
            live.finish(f"done{step}", [], finished[step])
            done.append(finished[step])
        fresh = SuffixProposer(**kw)
        for i, out in enumerate(done):
            fresh.finish(f"done{i}", [], out)
        got_live = _propose_one(live, "r", seq, budget)
        got_fresh = _propose_one(fresh, "r", seq, budget)
        assert got_live == got_fresh
        assert got_live == brute_force_suffix_reference(
            seq, done, k=k, depth=depth, max_cached=max_cached, factor=factor, min_prob=min_prob, budget=budget
        )
