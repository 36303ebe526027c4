"""Paged KV cache: device arrays, masked-scatter writes, host block manager (attention: specjax.attention).

Layout: each layer owns two flat slot arrays ``k, v: [num_slots, G, E]`` with
``num_slots = num_blocks * block_size``. Token at position p of a request lives
in slot ``block_table[p // block_size] * block_size + p % block_size``.

Shape letters (one code across the code base): b rows, t query tokens of a row,
s key positions, h query heads, g kv heads, r query heads per kv head (h = g*r),
e head dim, m blocks per row, v vocabulary, d model dim, f ffn dim.
"""

from __future__ import annotations

import dataclasses
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class AttentionMetadata:
    """Where a padded ``[B, T]`` batch of query tokens reads and writes KV.

    Padding query tokens have ``slot_mapping == -1`` (nothing written) and their
    outputs are ignored by the caller. Padding rows have all-(-1) block tables.
    """

    slot_mapping: jax.Array
    """int32 [B, T]: flat cache slot each query token's K/V is written to; -1 = do not write."""
    block_tables: jax.Array
    """int32 [B, M]: physical block ids of each row's sequence, in order; -1 = unused entry."""


@flax.struct.dataclass
class KVCache:
    """Per-layer paged K/V arrays. Donate this to every step so writes happen in place."""

    k: tuple[jax.Array, ...]
    """Per layer, [num_slots, G, E] keys (RoPE already applied)."""
    v: tuple[jax.Array, ...]
    """Per layer, [num_slots, G, E] values."""
    block_size: int = flax.struct.field(pytree_node=False)
    """Tokens per block (static)."""

    @classmethod
    def allocate(
        cls, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype,
        sharding=None,
    ) -> "KVCache":
        """Zeroed cache; ``sharding`` (one ``jax.sharding.Sharding`` for every array) places it on a mesh."""
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            block_size=block_size,
        )


def slots_for_positions(block_tables: jax.Array, positions: jax.Array, valid: jax.Array, block_size: int) -> jax.Array:
    """Flat KV slots of ``positions [B, L]`` through ``block_tables [B, M]``; -1 where not ``valid``."""
    block_idx = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    blocks = jnp.take_along_axis(block_tables, block_idx, axis=1)  # [B, L]
    slots = blocks * block_size + positions % block_size
    return jnp.where(valid & (blocks >= 0), slots, -1).astype(jnp.int32)


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Masked scatter of ``k, v: [B, T, G, E]`` into ``[num_slots, G, E]`` caches.

    ``-1`` slots are remapped past the end: with ``mode="drop"`` they write
    nothing. (JAX would otherwise wrap a negative index to the last slot.)
    """
    num_slots = k_cache.shape[0]
    slots = slot_mapping.reshape(-1)  # [B*T]
    slots = jnp.where(slots < 0, num_slots, slots)
    g, e = k.shape[-2:]
    k_cache = k_cache.at[slots].set(k.reshape(-1, g, e).astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[slots].set(v.reshape(-1, g, e).astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


# --------------------------------------------------------------------------- host side


class OutOfBlocks(Exception):
    """Raised by :class:`BlockManager` when the free pool cannot satisfy an allocation."""


@dataclasses.dataclass
class BlockManager:
    """Host-side allocator of KV blocks to requests (one block table per request).

    Blocks are handed out from a LIFO free list; freeing returns them. Block 0..N-1
    are all usable: padding never writes (slot -1) so no block needs reserving.
    """

    num_blocks: int
    block_size: int
    _free: list[int] = dataclasses.field(init=False)
    _tables: dict[str, list[int]] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``num_tokens`` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s table to cover ``num_tokens`` tokens; all-or-nothing."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"request {request_id!r} needs {need} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        return table

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        for block in reversed(self._tables.pop(request_id, [])):
            self._free.append(block)

    def slots(self, request_id: str, positions: np.ndarray) -> np.ndarray:
        """Flat slots of ``positions`` (which must be covered by the request's table)."""
        table = np.asarray(self._tables[request_id], dtype=np.int64)
        return (table[positions // self.block_size] * self.block_size + positions % self.block_size).astype(np.int32)
