"""User-facing configuration: engine sizing and the speculative config (sampling: ``sampling_params.py``).

All are frozen, keyword-only dataclasses whose invariants are checked at
construction, so a bad value fails where it is written, naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from specjax.sampling_params import SamplingParams, _check_int  # noqa: F401  (SamplingParams re-exported)




def _powers_of_two_upto(limit: int, start: int = 1) -> tuple[int, ...]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine sizing. Every variable dimension of a step is padded to one of the buckets."""

    max_model_len: int = 512
    """Longest prompt + output a request may reach (tokens)."""
    max_num_seqs: int = 8
    """Most requests decoded together in one step."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None = enough for max_num_seqs requests of max_model_len."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step (decode tokens + prefill chunks); None = 4 * max_prefill_chunk."""
    max_prefill_chunk: int = 128
    """Most prompt tokens of one request computed in one step (chunked prefill)."""
    batch_buckets: tuple[int, ...] | None = None
    """Row-count buckets; None = powers of two up to max_num_seqs."""
    query_buckets: tuple[int, ...] | None = None
    """Query-length buckets; None = 1, 4, 16, ... up to max_prefill_chunk."""
    seed: int = 0
    """Seeds the noise of requests that have no seed of their own."""
    data_parallel_size: int = 1
    """dp groups a step's rows are split over: every row bucket is a multiple of it."""
    mixed_step_padding: int | None = 16
    """What a step's own cost (launch, weight reads, fetch) is worth in padded token slots: on CPU, the shipped
    target's step of 8 rows x 1 token took 2.7 ms, each slot of an 8 x 64 step ~0.11 ms. A step mixing decoding
    rows with prompt chunks may pad at most this many slots beyond running them as two steps; past it they take
    turns, a step of chunks, then one of the decoding rows (as they do whenever the decoding rows draft: a
    step with a prompt chunk verifies no drafts). And a step's prompt chunks are cut to the query
    bucket that costs least per prompt token, a step costing its padded slots (at least this many) plus this
    many. None: always mix, never cut. (``LLM``'s default, ``"auto"``, takes the platform's value from
    :data:`specjax.backends.STEP_COST_SLOTS`.)"""

    def __post_init__(self) -> None:
        _check_int("max_model_len", self.max_model_len, minimum=1)
        _check_int("data_parallel_size", self.data_parallel_size, minimum=1)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("max_prefill_chunk", self.max_prefill_chunk, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, minimum=1)
            if self.num_kv_blocks < self.blocks_per_seq:
                raise ValueError(
                    f"num_kv_blocks must hold one max_model_len request ({self.blocks_per_seq} blocks of "
                    f"{self.block_size}), got {self.num_kv_blocks}"
                )
        if self.mixed_step_padding is not None:
            _check_int("mixed_step_padding", self.mixed_step_padding, minimum=0)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=self.max_num_seqs)
        for name in ("batch_buckets", "query_buckets"):
            buckets = getattr(self, name)
            if buckets is None:
                continue
            buckets = tuple(buckets)
            if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
                raise ValueError(f"{name} must be positive ints, got {buckets!r}")
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(f"{name} must be strictly increasing, got {buckets!r}")
            object.__setattr__(self, name, buckets)
        if self.batch_buckets is not None and self.batch_buckets[-1] < self.max_num_seqs:
            raise ValueError(f"batch_buckets must reach max_num_seqs={self.max_num_seqs}, got {self.batch_buckets}")
        dp = self.data_parallel_size
        if self.batch_buckets is not None and any(b % dp for b in self.batch_buckets):
            raise ValueError(f"batch_buckets must be multiples of data_parallel_size={dp}, got {self.batch_buckets}")

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def total_kv_blocks(self) -> int:
        return self.num_kv_blocks if self.num_kv_blocks is not None else self.max_num_seqs * self.blocks_per_seq

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(4 * self.max_prefill_chunk, self.max_num_seqs)

    @property
    def row_buckets(self) -> tuple[int, ...]:
        dp = self.data_parallel_size
        return self.batch_buckets or _powers_of_two_upto(-(-self.max_num_seqs // dp) * dp, start=dp)

    @property
    def length_buckets(self) -> tuple[int, ...]:
        if self.query_buckets is not None:
            return self.query_buckets
        out, t = [], 1
        while t < self.max_prefill_chunk:
            out.append(t)
            t *= 4
        out.append(self.max_prefill_chunk)
        return tuple(out)

    @property
    def prefill_chunk(self) -> int:
        """Longest query a step may give one row: the largest length bucket."""
        return min(self.length_buckets[-1], self.token_budget)


def bucket_for(value: int, buckets: Sequence[int], name: str) -> int:
    """Smallest bucket >= value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{name}={value} exceeds the largest bucket {buckets[-1]}")


SPEC_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa", "mtp")
REJECTION_METHODS = ("standard", "synthetic", "block")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
DRAFT_QUANTIZATIONS = ("q8_0",)
AUTO_QUANTIZED_DRAFTS = ("builtin:draft", "builtin:eagle3", "builtin:smollm2_eagle3")
"""The built-in drafts ``quantization="auto"`` runs in Q8_0 blocks where it can (each measured faster so at batch 1:
benchmarks/README.md, "Draft quantization")."""
QUANTIZABLE_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
"""The methods whose draft weights ``SpeculativeConfig.quantization`` can quantize (Medusa's blocks keep XLA's dots)."""


def _geometric_rates(length: float, k: int) -> tuple[float, ...]:
    """Unconditional rates a_i = alpha**i (i = 1..k) with 1 + sum a_i = length, alpha by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 1 + sum(mid**i for i in range(1, k + 1)) < length:
            lo = mid
        else:
            hi = mid
    alpha = (lo + hi) / 2
    return tuple(alpha**i for i in range(1, k + 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """What proposes drafts, how many, and how they are verified (vLLM's field names).

    ``method=None`` is auto-detected: a ``model`` path means draft_model; with
    ``rejection_sample_method="synthetic"`` and no model, drafts are placeholders
    (acceptance is decided by the synthetic rates, for benchmarking the system).
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    draft_sample_method: str | None = None
    """How model drafts are drawn for requests that sample: "probabilistic" (from the draft's own
    distribution, transformed as the target's is), "greedy" (argmax), or None = probabilistic when the
    method can (greedy requests always draft greedily)."""
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    adaptive: bool | None = None
    """Choose K in 0..num_speculative_tokens every step from measured step costs and acceptance (see
    :mod:`specjax.spec_decode.controller`); None = on unless num_speculative_tokens_per_batch_size is given."""
    max_model_len: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    use_heterogeneous_vocab: bool = False
    """draft_model only: the draft has its own tokenizer; drafts come from the shared tokens (greedy)."""
    quantization: str | None = "auto"
    """"q8_0": the draft model's or head's projection weights are quantized at load to GGUF Q8_0 blocks (8.5 bits
    per weight) and multiplied with int8 activations, as llama.cpp does (``draft_model``, ``eagle``, ``eagle3``,
    ``mtp``; one CPU device, where the CPU kernels' layout runs; a GGUF draft's blocks are quantized again from
    their float values). Its drafts change slightly; output stays exact, as the target verifies every draft. None:
    the weights as stored. "auto" (the default): "q8_0" for the built-in drafts in :data:`AUTO_QUANTIZED_DRAFTS`
    where the CPU kernels' layout runs, else None (``LLM`` resolves it)."""

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(d).__name__}")
        if "tensor_parallel_size" in d:
            raise ValueError(
                "speculative_config.tensor_parallel_size is not a field: use draft_tensor_parallel_size "
                "(the target's tensor_parallel_size is set on LLM)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(names)}")
        return cls(**d)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("num_speculative_tokens is required")
        _check_int("num_speculative_tokens", k, minimum=1)
        method = self.method
        if method is None:
            if self.model is not None:
                method = _detect_method(self.model)
            elif self.rejection_sample_method != "synthetic":
                raise ValueError("method is required (or give model for a draft model)")
            set_("method", method)
        if method is not None and method not in SPEC_METHODS:
            raise ValueError(f"method must be one of {list(SPEC_METHODS)}, got {method!r}")
        if method in ("draft_model", "eagle", "eagle3", "medusa", "mtp") and self.model is None:
            raise ValueError(f"model is required for method={method!r} (the draft's or head's directory)")
        if method in ("ngram", "suffix") and self.model is not None:
            raise ValueError(f"model must not be given for method={method!r}, got {self.model!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check_int("prompt_lookup_min", lo, minimum=1)
        _check_int("prompt_lookup_max", hi, minimum=1)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        set_("prompt_lookup_min", lo)
        set_("prompt_lookup_max", hi)
        if self.draft_tensor_parallel_size is not None:
            _check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, minimum=1)
        if self.rejection_sample_method not in REJECTION_METHODS:
            raise ValueError(
                f"rejection_sample_method must be one of {list(REJECTION_METHODS)}, got {self.rejection_sample_method!r}"
            )
        if self.draft_sample_method is not None and self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"draft_sample_method must be one of {list(DRAFT_SAMPLE_METHODS)} or None, got "
                f"{self.draft_sample_method!r}"
            )
        synthetic = self.rejection_sample_method == "synthetic"
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if not synthetic and (rates is not None or length is not None):
            raise ValueError(
                "synthetic_acceptance_rates / synthetic_acceptance_length need rejection_sample_method='synthetic'"
            )
        if synthetic:
            if rates is not None and length is not None:
                raise ValueError("give synthetic_acceptance_rates or synthetic_acceptance_length, not both")
            if rates is None and length is None:
                raise ValueError("rejection_sample_method='synthetic' needs synthetic_acceptance_rates or _length")
            if length is not None:
                if isinstance(length, bool) or not isinstance(length, (int, float)) or not (1.0 <= length <= k + 1):
                    raise ValueError(f"synthetic_acceptance_length must be in [1, K+1={k + 1}], got {length!r}")
                rates = _geometric_rates(float(length), k)
            rates = tuple(float(r) for r in rates)
            if len(rates) != k:
                raise ValueError(f"synthetic_acceptance_rates must have K={k} entries, got {len(rates)}")
            if any(not (0.0 <= r <= 1.0) for r in rates):
                raise ValueError(f"synthetic_acceptance_rates must lie in [0, 1], got {rates}")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"synthetic_acceptance_rates must be non-increasing, got {rates}")
            set_("synthetic_acceptance_rates", rates)
        sched = self.num_speculative_tokens_per_batch_size
        if sched is not None:
            ranges = []
            for entry in sched:
                if len(entry) != 3 or any(isinstance(x, bool) or not isinstance(x, int) for x in entry):
                    raise ValueError(
                        f"num_speculative_tokens_per_batch_size entries must be (start, end, K) ints, got {entry!r}"
                    )
                start, end, kk = entry
                if start < 1 or end < start or kk < 0 or kk > k:
                    raise ValueError(
                        "num_speculative_tokens_per_batch_size entries need 1 <= start <= end and "
                        f"0 <= K <= num_speculative_tokens={k}, got {entry!r}"
                    )
                ranges.append((start, end, kk))
            ranges.sort()
            for (s0, e0, _), (s1, _, _) in zip(ranges, ranges[1:]):
                if s1 <= e0:
                    raise ValueError(f"num_speculative_tokens_per_batch_size ranges overlap at batch size {s1}")
            set_("num_speculative_tokens_per_batch_size", tuple(ranges))
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=1)
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, minimum=1)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, minimum=0)
        if not isinstance(self.use_heterogeneous_vocab, bool):
            raise ValueError(f"use_heterogeneous_vocab must be a bool, got {self.use_heterogeneous_vocab!r}")
        if self.use_heterogeneous_vocab and method != "draft_model":
            raise ValueError(f"use_heterogeneous_vocab=True needs method='draft_model', got method={method!r}")
        if self.use_heterogeneous_vocab and self.draft_sample_method == "probabilistic":
            raise ValueError(
                "use_heterogeneous_vocab=True drafts greedily only: draft_sample_method must be 'greedy' or None, "
                f"got {self.draft_sample_method!r}"
            )
        if self.quantization not in (None, "auto"):
            if self.quantization not in DRAFT_QUANTIZATIONS:
                raise ValueError(f"quantization must be one of {['auto', *DRAFT_QUANTIZATIONS]} or None, got "
                                 f"{self.quantization!r}")
            if method not in QUANTIZABLE_METHODS:
                raise ValueError(f"quantization={self.quantization!r} quantizes a draft model's or head's weights "
                                 f"(method one of {list(QUANTIZABLE_METHODS)}), got method={method!r}")
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a bool or None, got {self.adaptive!r}")
        if self.adaptive and self.num_speculative_tokens_per_batch_size is not None:
            raise ValueError(
                "adaptive=True and num_speculative_tokens_per_batch_size both choose K: give one of them"
            )
        set_("adaptive", self.num_speculative_tokens_per_batch_size is None if self.adaptive is None
             else self.adaptive)

    def with_quantization(self, quantization: str | None) -> "SpeculativeConfig":
        """A copy with ``quantization`` resolved (``LLM`` resolves "auto" for its devices), the other fields as
        validated: not constructed again, as derived fields (synthetic rates from a length) would then clash."""
        if quantization is not None and (quantization not in DRAFT_QUANTIZATIONS or self.method not in
                                         QUANTIZABLE_METHODS):
            raise ValueError(f"quantization={quantization!r} cannot apply to method={self.method!r}")
        resolved = copy.copy(self)
        object.__setattr__(resolved, "quantization", quantization)
        return resolved

    def k_for_batch_size(self, batch_size: int) -> int:
        """K for a step of ``batch_size`` running rows (the dynamic-K schedule; K outside all ranges)."""
        for start, end, kk in self.num_speculative_tokens_per_batch_size or ():
            if start <= batch_size <= end:
                return kk
        return self.num_speculative_tokens

    def k_table(self, max_batch: int) -> tuple[int, ...]:
        """K for every batch size 0..max_batch: the O(1) lookup the engine indexes each step."""
        return tuple(self.k_for_batch_size(max(b, 1)) for b in range(max_batch + 1))


def _detect_method(model: str) -> str:
    """vLLM-style auto-detection from the draft's name / config."""
    import json
    import os

    name = os.path.basename(os.path.normpath(str(model))).lower()
    arch: list[str] = []
    cfg_path = os.path.join(str(model), "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
        arch = [a.lower() for a in cfg.get("architectures", [])]
        if "specjaxdrafthead" in arch and cfg.get("method") in SPEC_METHODS:
            return cfg["method"]  # a head written by specjax train-head says what it is
    text = " ".join([name, *arch])
    if "eagle3" in text or "eagle-3" in text:
        return "eagle3"
    if "eagle" in text:
        return "eagle"
    if "medusa" in text:
        return "medusa"
    if "mtp" in text:
        return "mtp"
    return "draft_model"
