"""User-facing configuration: sampling parameters and engine sizing.

Both are frozen, keyword-only dataclasses whose invariants are checked at
construction, so a bad value fails where it is written, naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

_MAX_SEED = 2**32 - 1


def _check_int(name: str, value, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request (vLLM's names and defaults).

    temperature 0 is greedy; ``top_k`` 0 or -1 and ``top_p`` 1.0 switch those filters off.
    A request with a ``seed`` draws the same tokens whatever else shares its batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a float, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, minimum=-1)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a float in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed > _MAX_SEED:
                raise ValueError(f"seed must be <= {_MAX_SEED}, got {self.seed}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
                raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            for tok in self.stop_token_ids:
                _check_int("stop_token_ids", tok, minimum=0)
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_or_off(self) -> int:
        """top_k with -1 folded into 0 (off), the form the device sampler takes."""
        return max(self.top_k, 0)


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

    def __post_init__(self) -> None:
        _check_int("max_model_len", self.max_model_len, minimum=1)
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
        return self.batch_buckets or _powers_of_two_upto(self.max_num_seqs)

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
