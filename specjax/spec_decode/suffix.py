"""SuffixDecoding (Oliaro et al., 2024): draft from suffix trees of this request and of past outputs.

Model
-----
A *suffix tree* here is the trie of every suffix of one or more documents, cut at depth
``D = max_tree_depth``; the node spelling string ``w`` (``|w| <= D``) carries
``count(w)`` = the number of occurrences of ``w`` in the documents. Two kinds:

* per request: one document, the request's prompt + committed output, grown as tokens
  are committed;
* global: the *outputs* of finished requests (prompts are not added), one document per
  request, oldest evicted beyond ``max_cached_requests``.

Proposal for one row with draft budget ``c = min(max_drafts[i], K)``, in each tree:

1. Pattern: the longest suffix ``u`` of the sequence with ``|u| <= max(1, D - c)`` whose
   node has at least one child (it occurred before with a continuation). The length cap
   leaves depth for ``c`` drafts; shortening loses nothing else, because every suffix of
   a match is itself a match.
2. Walk: from ``u`` repeatedly take the most frequent child (ties: smallest token id),
   multiply the running path probability ``P`` by ``count(child) / count(node)`` and stop
   once ``P < min_token_prob``, at depth ``D``, or after
   ``min(c, max(1, floor(max_spec_factor * |u|)), D - |u|)`` tokens.
3. Score = sum of ``P`` over the drafted tokens (the expected number accepted if the tree
   statistics were the truth). The higher-scoring tree wins; ties go to the request's own.

In the per-request tree the current suffix counts as an occurrence too, so a pattern
seen once before is followed with probability 1/2 -- a built-in hedge that the
``min_token_prob`` threshold then acts on.

Data structure
--------------
Nodes are materialized lazily: a node that occurs once is a *leaf* holding a reference
``(doc, end)`` to its only occurrence instead of children; everything below it is
implicit (the document's next tokens, each with count 1). A leaf gets explicit children
(one level) only when a second occurrence arrives. This keeps the node count near the
number of repeated substrings instead of ``N * D`` for a length-``N`` document, which is
what makes per-request trees over thousands of tokens and a global tree over thousands
of outputs affordable in Python. Nodes are integer ids into flat lists with int -> int
child dicts, which Python's cyclic GC does not track (node objects made GC passes most
of the build time).

Appending token ``doc[p]`` extends every suffix still on an explicit path: the request
keeps its *active* list, the explicit nodes of the sequence's suffixes of length
``1..D-1`` (contiguous from length 1, since a suffix of a repeated string repeats). A
suffix that lands on a fresh leaf is unique from then on and drops out. So appending
costs O(length of the longest repeated suffix), the active list doubles as the
per-request match (entry ``m - 1`` is the node of the length-``m`` suffix), and each
``propose`` only appends the tail committed since the previous call. A sequence that is
not an extension of the one seen last (preemption with recompute, rollback) is rebuilt.

The global tree is matched from scratch each step (longest pattern first; a miss usually
fails within a token or two). Eviction walks the evicted output's suffixes decrementing
counts and unlinks nodes that reach zero; a leaf always has count 1, so a leaf's
referenced document is alive as long as the leaf is.

State is per proposer instance and not thread-safe; ``finish`` must be called for every
request that ``propose`` saw, or its per-request tree stays in memory.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Sequence

import numpy as np

from specjax.spec_decode.proposer import EMPTY_DRAFTS as _EMPTY
from specjax.spec_decode.proposer import BuildContext, HostProposer, check_batch, register
from specjax.spec_decode.proposer import check_int as _check_int

logger = logging.getLogger(__name__)

def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise ValueError(f"{name} must be a float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuffixConfig:
    """Validated SuffixDecoding settings (names follow vLLM / arctic-inference)."""

    num_speculative_tokens: int
    max_tree_depth: int = 24
    max_cached_requests: int = 1000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        # Depth 1 would leave no room for a pattern plus a draft.
        _check_int("max_tree_depth", self.max_tree_depth, 2)
        _check_int("max_cached_requests", self.max_cached_requests, 0)
        if _check_float("max_spec_factor", self.max_spec_factor) <= 0:
            raise ValueError(f"max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0.0 <= _check_float("min_token_prob", self.min_token_prob) <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


class _SuffixTree:
    """Depth-capped counted suffix trie over documents (Python int lists) with lazy leaves.

    Nodes are integer ids into parallel lists; ``children[i]`` maps token -> child id, or is
    None for a leaf (count 1, only occurrence ``docs[leaf_doc[i]][.. end[i])``). Int-to-int
    dicts are not tracked by Python's cyclic GC; node objects were, and the collections
    they triggered cost about two thirds of build time."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: list[dict[int, int] | None] = [{}]  # node 0 is the root
        self.count: list[int] = [0]
        self.leaf_doc: list[int] = [-1]
        self.end: list[int] = [0]
        self.docs: dict[int, list[int]] = {}
        self._free: list[int] = []  # ids of unlinked nodes, reused first

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def _new_leaf(self, doc_id: int, end: int) -> int:
        if self._free:
            i = self._free.pop()
            self.children[i], self.count[i], self.leaf_doc[i], self.end[i] = None, 1, doc_id, end
            return i
        self.children.append(None)
        self.count.append(1)
        self.leaf_doc.append(doc_id)
        self.end.append(end)
        return len(self.count) - 1

    def append(self, doc_id: int, p: int, active: list[int]) -> list[int]:
        """Count the suffixes ending at ``docs[doc_id][p]`` (already there); returns the new active list.

        ``active[i]`` is the explicit node of ``doc[p-1-i .. p-1]``; the result is the same
        for ``doc[p-i .. p]``. This is the hot loop of every build, hence the inlining."""
        tok = self.docs[doc_id][p]
        children, count = self.children, self.count
        new_active: list[int] = []
        push = new_active.append
        depth = 0  # of the child
        for parent in (0, *active):
            depth += 1
            kids = children[parent]
            child = kids.get(tok)
            if child is None:
                # First occurrence of this path: a leaf; the suffix is unique from here on.
                kids[tok] = self._new_leaf(doc_id, p + 1)
                continue
            count[child] += 1
            if children[child] is None:
                self._materialize(child, depth)
            push(child)
        # new_active[i] has depth i + 1; nodes at the depth cap cannot be extended.
        del new_active[self.max_depth - 1 :]
        return new_active

    def _materialize(self, leaf: int, depth: int) -> None:
        """Give a leaf that just got its second occurrence one explicit level from its first."""
        kids: dict[int, int] = {}
        doc_id, end = self.leaf_doc[leaf], self.end[leaf]
        doc = self.docs[doc_id]
        if depth < self.max_depth and end < len(doc):
            kids[doc[end]] = self._new_leaf(doc_id, end + 1)
        self.children[leaf] = kids
        self.leaf_doc[leaf] = -1

    def insert(self, doc_id: int, doc: list[int]) -> None:
        self.docs[doc_id] = doc
        active: list[int] = []
        for p in range(len(doc)):
            active = self.append(doc_id, p, active)

    def remove(self, doc_id: int) -> None:
        """Undo ``insert(doc_id, ...)``: decrement its suffixes' counts, unlink what reaches zero."""
        doc = self.docs.pop(doc_id)
        n, depth_cap = len(doc), self.max_depth
        children, count = self.children, self.count
        for s in range(n):
            node = 0
            for q in range(s, min(s + depth_cap, n)):
                tok = doc[q]
                child = children[node][tok]
                count[child] -= 1
                if count[child] == 0:  # leaves have count 1, so this is where every walk into one ends
                    del children[node][tok]
                    self._free_subtree(child)
                    break
                node = child

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            i = stack.pop()
            if self.children[i]:
                stack.extend(self.children[i].values())
            self.children[i] = None
            self.leaf_doc[i] = -1
            self._free.append(i)

    def locate(self, pattern: list[int]) -> tuple[int, int] | None:
        """Cursor ``(node, offset)`` for ``pattern`` (offset = implicit steps below a leaf), or None."""
        node, off = 0, 0
        for tok in pattern:
            kids = self.children[node]
            if kids is None:
                doc = self.docs[self.leaf_doc[node]]
                pos = self.end[node] + off
                if pos >= len(doc) or doc[pos] != tok:
                    return None
                off += 1
            else:
                child = kids.get(tok)
                if child is None:
                    return None
                node, off = child, 0
        return node, off

    def has_child(self, node: int, off: int) -> bool:
        kids = self.children[node]
        if kids is None:
            return self.end[node] + off < len(self.docs[self.leaf_doc[node]])
        return bool(kids)

    def draft(self, node: int, off: int, depth: int, cap: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy most-frequent-child walk from a cursor at ``depth``; returns (tokens, score)."""
        children, count = self.children, self.count
        out: list[int] = []
        prob, score = 1.0, 0.0
        limit = min(cap, self.max_depth - depth)
        while len(out) < limit:
            kids = children[node]
            if kids is None:
                # Implicit region: one occurrence, so the next token has probability 1.
                doc = self.docs[self.leaf_doc[node]]
                pos = self.end[node] + off
                if pos >= len(doc):
                    break
                tok = doc[pos]
                off += 1
            else:
                if not kids:
                    break
                best_tok, best_count = -1, -1
                for t, ch in kids.items():
                    c = count[ch]
                    if c > best_count or (c == best_count and t < best_tok):
                        best_tok, best_count = t, c
                prob *= best_count / count[node]
                if prob < min_prob:
                    break
                tok, node, off = best_tok, kids[best_tok], 0
            out.append(tok)
            score += prob
        return out, score


_GUARD = 8
"""Recently seen tokens :meth:`SuffixProposer._sync` compares with the new sequence."""


class _RequestState:
    """One running request: its tree (document 0 = its tokens), how many tokens it has seen, the active list."""

    __slots__ = ("tree", "doc", "num_seen", "active")

    def __init__(self, max_depth: int) -> None:
        self.tree = _SuffixTree(max_depth)
        self.doc: list[int] = []
        self.tree.docs[0] = self.doc
        self.num_seen = 0
        self.active: list[int] = []

    def extend(self, tail: list[int]) -> None:
        doc, tree = self.doc, self.tree
        active = self.active
        for tok in tail:
            doc.append(tok)
            active = tree.append(0, len(doc) - 1, active)
        self.active = active


class SuffixProposer:
    """SuffixDecoding host drafter (see the module docstring). Implements ``HostDrafter``."""

    def __init__(
        self,
        *,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.config = SuffixConfig(
            num_speculative_tokens=num_speculative_tokens,
            max_tree_depth=max_tree_depth,
            max_cached_requests=max_cached_requests,
            max_spec_factor=max_spec_factor,
            min_token_prob=min_token_prob,
        )
        self._requests: dict[str, _RequestState] = {}
        self._global = _SuffixTree(max_tree_depth)
        # Insertion order = eviction order; keys are a counter so a re-used request id is fine.
        self._cached: collections.OrderedDict[int, int] = collections.OrderedDict()  # doc id -> length
        self._next_doc = 0

    @property
    def num_active_requests(self) -> int:
        """Requests with per-request state (seen by ``propose``, not yet finished)."""
        return len(self._requests)

    @property
    def num_cached_requests(self) -> int:
        """Finished outputs currently in the global tree."""
        return len(self._cached)

    def _sync(self, request_id: str, seq: np.ndarray) -> _RequestState:
        """Bring the request's tree up to ``seq`` by appending its new tail (O(new tokens)).

        Contract: while a request runs its sequence only grows (committed tokens never change); a
        request id is re-used only after :meth:`finish`. As a cheap guard against a caller breaking it,
        the tree is rebuilt when the sequence got shorter or its last ``_GUARD`` seen tokens differ
        (O(1); a rewrite further back goes unnoticed).
        """
        state = self._requests.get(request_id)
        if state is not None:
            seen = state.num_seen
            lo = max(0, seen - _GUARD)
            if seq.shape[0] < seen or seq[lo:seen].tolist() != state.doc[lo:seen]:
                logger.debug("request %s: not an extension of the last sequence; rebuilding", request_id)
                state = None
        if state is None:
            state = _RequestState(self.config.max_tree_depth)
            self._requests[request_id] = state
        if seq.shape[0] > state.num_seen:
            state.extend(seq[state.num_seen:].tolist())
            state.num_seen = seq.shape[0]
        return state

    def propose(
        self, request_ids: Sequence[str], token_ids: Sequence[np.ndarray], max_drafts: Sequence[int]
    ) -> list[np.ndarray]:
        """Per row, up to ``min(K, max_drafts[i])`` int32 drafts continuing ``token_ids[i]``."""
        check_batch(request_ids, token_ids, max_drafts)
        cfg = self.config
        depth_cap = cfg.max_tree_depth
        out = []
        for rid, seq, budget in zip(request_ids, token_ids, max_drafts):
            seq = np.asarray(seq)
            # Always sync, even with no budget, so the next step only appends its tail.
            state = self._sync(rid, seq)
            c = min(int(budget), cfg.num_speculative_tokens)
            if c <= 0:
                out.append(_EMPTY)
                continue
            m_limit = max(1, depth_cap - c)

            best: list[int] = []
            best_score = 0.0
            # Per-request tree: active[m - 1] is the node of the length-m suffix.
            m = min(len(state.active), m_limit)
            if m >= 1:
                best, best_score = state.tree.draft(
                    state.active[m - 1], 0, m, self._cap(c, m), cfg.min_token_prob
                )
            if self._cached:
                doc = state.doc
                n = len(doc)
                for m in range(min(n, m_limit), 0, -1):
                    cur = self._global.locate(doc[n - m :])
                    if cur is not None and self._global.has_child(*cur):
                        toks, score = self._global.draft(*cur, m, self._cap(c, m), cfg.min_token_prob)
                        if score > best_score:
                            best, best_score = toks, score
                        break
            out.append(np.array(best, dtype=np.int32) if best else _EMPTY)
        return out

    def _cap(self, c: int, match_len: int) -> int:
        return min(c, max(1, math.floor(self.config.max_spec_factor * match_len)))

    def finish(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Drop the request's tree; add its output to the global tree, evicting the oldest beyond the cap."""
        del prompt_token_ids  # SuffixDecoding's global tree holds outputs only
        self._requests.pop(request_id, None)
        if self.config.max_cached_requests == 0:
            return
        doc = np.asarray(output_token_ids, dtype=np.int64).ravel().tolist()
        if not doc:
            return
        self._global.insert(self._next_doc, doc)
        self._cached[self._next_doc] = len(doc)
        self._next_doc += 1
        while len(self._cached) > self.config.max_cached_requests:
            old_id, _ = self._cached.popitem(last=False)
            self._global.remove(old_id)


@register("suffix")
def build(ctx: BuildContext) -> HostProposer:
    spec = ctx.spec
    return HostProposer(SuffixProposer(
        num_speculative_tokens=spec.num_speculative_tokens, max_tree_depth=spec.suffix_decoding_max_tree_depth,
        max_cached_requests=spec.suffix_decoding_max_cached_requests,
        max_spec_factor=spec.suffix_decoding_max_spec_factor, min_token_prob=spec.suffix_decoding_min_token_prob,
    ))
