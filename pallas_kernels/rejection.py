"""Fused rejection sampling for speculative decoding as vocabulary-tiled Pallas kernels.

No block spans the vocabulary: every pass streams ``[K+1, tile_v]`` tiles of the
row's target logits (and draft probabilities) and keeps per-position columns:

1. **stats** (every method): greedy argmax, online max / sum-exp of the
   temperature-scaled logits, and the scaled logit and draft probability at each
   draft token. In jnp, between kernels: p and q at the draft tokens, the
   acceptance test, the first rejection (token-wise) or block verification's
   P_i chain; all on ``[B, K+1]`` columns.
2. **residual mass** (``method="block"`` only): Z_i = sum_x max(P_i p_i - q_i, 0)
   for every position, needed before block verification can pick tau.
3. **race** (rows that sample): one more pass over the ONE row that is drawn
   from (the first rejected position, or the bonus position): exponential races
   argmax r / E for the residual r and for p (its fallback when r has no mass).

Each pass may split a row's vocabulary over several programs (``splits``);
their partial states are merged in jnp (max / rescaled sums / first index).
Kernel bodies per platform (both in interpret mode on CPU for tests):

* ``"tpu"`` (Mosaic): grid ``(B, splits, tiles)``, the tile axis sequential;
  the state accumulates in the output block, resident across the tile axis.
* ``"gpu"`` (Triton): grid ``(B, splits)``; each program loops over its tiles
  with masked loads (positions padded to a power of two, as Triton needs).

Randomness is drawn by the caller (acceptance uniforms ``[B, K]``, Exp(1) noise
``[B, V]``) exactly as for the jnp paths in :mod:`pallas_kernels.rejection_reference`,
which this module re-exports. Sums are tiled, so float rounding differs from
the whole-row reference in the last bits: decisions agree except where a
comparison is within rounding of its threshold (tests measure that).

Letters: b rows, k draft positions (K+1 target positions), v vocabulary, s splits.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import rejection_tiles as tiles
from pallas_kernels.rejection_reference import (  # noqa: F401  (re-exported: one import site for callers)
    METHODS,
    MIN_EXPONENTIAL,
    _check_shapes,
    greedy_verify_reference,
    rejection_sample_reference,
    standard_verify_xla,
)
from pallas_kernels.sampling_ops import transform_logits

PLATFORMS = ("tpu", "gpu")
_BIG_POS = 1 << 30
_NUM_SCALARS = 6  # per-row race inputs: m, z, scale, use_residual, temperature, draft token at the drawn position


# ----------------------------------------------------------------------------
# Block sizes per platform.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Static tiling of the kernels (part of the jit key)."""

    platform: str
    """"tpu" (Mosaic body: grid over tiles) or "gpu" (Triton body: loop over tiles)."""
    tile_v: int
    """Vocabulary tile of the full-row passes: ``[K+1, tile_v]`` per step."""
    race_tile_v: int
    """Vocabulary tile of the one-row race: ``[1, race_tile_v]`` per step."""
    splits: int
    """Programs per row, each over a contiguous share of the vocabulary (merged in jnp)."""
    num_warps: int = 4
    """Triton warps per program (GPU only)."""

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        for name in ("tile_v", "race_tile_v", "splits", "num_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.platform == "tpu" and (self.tile_v % 128 or self.race_tile_v % 128):
            raise ValueError("tile_v and race_tile_v must be multiples of 128 (TPU lanes)")
        if self.platform == "gpu" and any(v & (v - 1) for v in (self.tile_v, self.race_tile_v)):
            raise ValueError("tile_v and race_tile_v must be powers of two (Triton blocks)")


def default_blocks(platform: str, batch: int, num_positions: int, vocab: int) -> KernelBlocks:
    """Tiles per platform: TPU streams 2048-lane tiles through VMEM on one core; a GPU needs
    enough programs to occupy its SMs (~256 programs over the batch) and register-sized tiles."""
    if platform == "tpu":
        return KernelBlocks(platform="tpu", tile_v=2048, race_tile_v=8192, splits=1)
    if platform != "gpu":
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    rows = _next_pow2(num_positions)
    tile_v = max(128, 4096 // rows)  # [rows, tile_v] float32 tiles of ~16 KiB per array
    splits = max(1, min(-(-256 // batch), -(-vocab // tile_v)))
    return KernelBlocks(platform="gpu", tile_v=tile_v, race_tile_v=2048, splits=splits)


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _tiles_per_split(vocab: int, tile: int, splits: int) -> int:
    return -(-(-(-vocab // tile)) // splits)


# ----------------------------------------------------------------------------
# Kernel bodies: GPU (Triton) -- a loop over tiles inside each program.
# ----------------------------------------------------------------------------


def _gpu_load(ref, rows, start, tile, mask, other):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[pl.ds(0, rows), pl.ds(start, tile)], mask=mask, other=other)


def _gpu_tile_coords(rows, tiles_per_split, tile, num_rows, vocab):
    """For tile j of this program's share: (float32 vocabulary index, valid) of a [rows, tile] tile whose
    first ``num_rows`` positions are real."""
    pos = jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 0)
    vidx = jax.lax.broadcasted_iota(jnp.int32, (rows, tile), 1) + pl.program_id(1) * tiles_per_split * tile

    def at(j):
        v = vidx + j * tile
        return v.astype(jnp.float32), (pos < num_rows) & (v < vocab)

    return at


def _gpu_store_col(ref, value, num_rows):
    from jax.experimental.pallas import triton as plgpu

    rows = value.shape[0]
    mask = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < num_rows
    plgpu.store(ref.at[pl.ds(0, rows), :], value, mask=mask)


def _stats_kernel_gpu(logits_ref, draft_ref, temp_ref, *refs, k1, rows, vocab, tile, tiles_per_split, has_q):
    """logits_ref [K+1, V], draft_ref [K+1, 1] int32, temp_ref [1, 1], (q_ref [K, V]) ->
    gmax, garg, smax, ssum, sdraft [K+1, 1], (qdraft [K, 1]) for this program's vocabulary share."""
    from jax.experimental.pallas import triton as plgpu

    q_ref = refs[0] if has_q else None
    outs = refs[1:] if has_q else refs
    split = pl.program_id(1)  # read outside loops: interpret mode substitutes it at the kernel's top level only
    coords, q_coords = (_gpu_tile_coords(rows, tiles_per_split, tile, n, vocab) for n in (k1, k1 - 1))
    pos_col = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    draft = plgpu.load(draft_ref.at[pl.ds(0, rows), :], mask=pos_col < k1, other=-1).astype(jnp.float32)
    temp = temp_ref[...]

    def body(j, state):
        start = (split * tiles_per_split + j) * tile
        vidx, valid = coords(j)
        x = _gpu_load(logits_ref, rows, start, tile, valid, 0.0)
        new = tiles.stats_tile(state[:5], x, draft, temp, vidx, valid)
        if has_q:
            q_valid = q_coords(j)[1]
            q = _gpu_load(q_ref, rows, start, tile, q_valid, 0.0)
            new = new + (tiles.qdraft_tile(state[5], q, draft, vidx, q_valid),)
        return new

    init = tiles.stats_init(rows) + ((jnp.zeros((rows, 1), jnp.float32),) if has_q else ())
    state = jax.lax.fori_loop(0, tiles_per_split, body, init)
    for ref, value in zip(outs, state[:5]):
        _gpu_store_col(ref, value, k1)
    if has_q:
        _gpu_store_col(outs[5], state[5], k1 - 1)


def _residual_kernel_gpu(logits_ref, draft_ref, temp_ref, m_ref, z_ref, bigp_ref, *refs, k, rows, vocab, tile,
                         tiles_per_split, has_q):
    """Z_i over this program's share for positions i < K; m/z/bigp_ref [K, 1]."""
    from jax.experimental.pallas import triton as plgpu

    q_ref = refs[0] if has_q else None
    out_ref = refs[-1]
    split = pl.program_id(1)
    coords = _gpu_tile_coords(rows, tiles_per_split, tile, k, vocab)
    col_mask = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < k
    load_col = lambda ref, other: plgpu.load(ref.at[pl.ds(0, rows), :], mask=col_mask, other=other)  # noqa: E731
    m, z, big_p = load_col(m_ref, 0.0), load_col(z_ref, 1.0), load_col(bigp_ref, 0.0)
    draft = load_col(draft_ref, -1).astype(jnp.float32)
    temp = temp_ref[...]

    def body(j, zres):
        start = (split * tiles_per_split + j) * tile
        vidx, valid = coords(j)
        x = _gpu_load(logits_ref, rows, start, tile, valid, 0.0)
        if has_q:
            q = _gpu_load(q_ref, rows, start, tile, valid, 0.0)
        else:
            q = (vidx == draft).astype(jnp.float32)
        return tiles.residual_mass_tile(zres, x, q, m, z, big_p, temp, valid)

    zres = jax.lax.fori_loop(0, tiles_per_split, body, jnp.zeros((rows, 1), jnp.float32))
    _gpu_store_col(out_ref, zres, k)


def _race_kernel_gpu(logits_ref, e_ref, pos_ref, *refs, k, vocab, tile, tiles_per_split, has_q):
    """One row's races over this program's share. logits_ref [K+1, V], e_ref [1, V], pos_ref [1, 1] int32
    (the position drawn from), then [1, 1] m, z, scale, use_residual, temperature, draft token, (q_ref [K, V]);
    writes [1, 1] rsum, best_r, idx_r, best_p, idx_p."""
    from jax.experimental.pallas import triton as plgpu

    m, z, scale, use_res, temp, draft = (ref[...] for ref in refs[:_NUM_SCALARS])
    q_ref = refs[_NUM_SCALARS] if has_q else None
    outs = refs[_NUM_SCALARS + 1:] if has_q else refs[_NUM_SCALARS:]
    split = pl.program_id(1)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    a = pos_ref[0, 0]

    def body(j, state):
        start = (split * tiles_per_split + j) * tile
        vidx = lane + start
        valid = vidx < vocab
        x = plgpu.load(logits_ref.at[pl.ds(a, 1), pl.ds(start, tile)], mask=valid, other=0.0)
        e = plgpu.load(e_ref.at[:, pl.ds(start, tile)], mask=valid, other=1.0)
        vidx = vidx.astype(jnp.float32)
        if has_q:
            q_row = jnp.minimum(a, k - 1)
            q = plgpu.load(q_ref.at[pl.ds(q_row, 1), pl.ds(start, tile)], mask=valid & (a < k), other=0.0)
        else:
            q = (vidx == draft).astype(jnp.float32)
        return tiles.race_tile(state, x, q, e, m, z, scale, use_res, temp, vidx, valid)

    # Greedy rows draw nothing: their programs skip the loop.
    trips = jnp.where(refs[4][0, 0] > 0, tiles_per_split, 0)
    state = jax.lax.fori_loop(0, trips, body, tiles.race_init())
    for ref, value in zip(outs, state):
        ref[...] = value


# ----------------------------------------------------------------------------
# Kernel bodies: TPU (Mosaic) -- one tile per grid step, state in the resident output block.
# ----------------------------------------------------------------------------


def _tile_coords(shape, tiles_per_split, tile, vocab):
    start = (pl.program_id(1) * tiles_per_split + pl.program_id(2)) * tile
    vidx = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + start
    return vidx.astype(jnp.float32), vidx < vocab


def _stats_kernel_tpu(logits_ref, draft_ref, temp_ref, *refs, k1, vocab, tile, tiles_per_split, has_q):
    """logits_ref [K+1, tile], draft_ref [K+1, 1] int32, temp_ref [1, 1], (q_ref [K, tile],
    draft_k_ref [K, 1]) -> resident gmax, garg, smax, ssum, sdraft [K+1, 1], (qdraft [K, 1])."""
    q_ref, draft_k_ref = (refs[0], refs[1]) if has_q else (None, None)
    outs = refs[2:] if has_q else refs

    @pl.when(pl.program_id(2) == 0)
    def _init():
        for ref, value in zip(outs, tiles.stats_init(k1)):
            ref[...] = value
        if has_q:
            outs[5][...] = jnp.zeros(outs[5].shape, jnp.float32)

    vidx, valid = _tile_coords((k1, tile), tiles_per_split, tile, vocab)
    state = tuple(ref[...] for ref in outs[:5])
    new = tiles.stats_tile(state, logits_ref[...], draft_ref[...].astype(jnp.float32), temp_ref[...], vidx, valid)
    for ref, value in zip(outs, new):
        ref[...] = value
    if has_q:
        kq = q_ref.shape[0]
        vq, okq = _tile_coords((kq, tile), tiles_per_split, tile, vocab)
        outs[5][...] = tiles.qdraft_tile(outs[5][...], q_ref[...], draft_k_ref[...].astype(jnp.float32), vq, okq)


def _residual_kernel_tpu(logits_ref, draft_k_ref, temp_ref, m_ref, z_ref, bigp_ref, *refs, k, vocab, tile,
                         tiles_per_split, has_q):
    """Z_i for positions i < K; logits_ref [K+1, tile] (first K rows read), m/z/bigp/draft_k_ref [K, 1]."""
    q_ref = refs[0] if has_q else None
    out_ref = refs[-1]

    @pl.when(pl.program_id(2) == 0)
    def _init():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)

    vidx, valid = _tile_coords((k, tile), tiles_per_split, tile, vocab)
    q = q_ref[...] if has_q else (vidx == draft_k_ref[...].astype(jnp.float32)).astype(jnp.float32)
    out_ref[...] = tiles.residual_mass_tile(out_ref[...], logits_ref[:k, :], q, m_ref[...], z_ref[...],
                                            bigp_ref[...], temp_ref[...], valid)


def _race_kernel_tpu(x_ref, e_ref, *refs, vocab, tile, tiles_per_split, has_q):
    """x_ref [1, tile] (the drawn row, gathered), e_ref [1, tile], the [1, 1] scalars as on GPU,
    (q_ref [1, tile]) -> resident [1, 1] rsum, best_r, idx_r, best_p, idx_p."""
    m, z, scale, use_res, temp, draft = (ref[...] for ref in refs[:_NUM_SCALARS])
    q_ref = refs[_NUM_SCALARS] if has_q else None
    outs = refs[_NUM_SCALARS + 1:] if has_q else refs[_NUM_SCALARS:]

    @pl.when(pl.program_id(2) == 0)
    def _init():
        for ref, value in zip(outs, tiles.race_init()):
            ref[...] = value

    vidx, valid = _tile_coords((1, tile), tiles_per_split, tile, vocab)
    q = q_ref[...] if has_q else (vidx == draft).astype(jnp.float32)
    state = tuple(ref[...] for ref in outs)
    new = tiles.race_tile(state, x_ref[...], q, e_ref[...], m, z, scale, use_res, temp, vidx, valid)
    for ref, value in zip(outs, new):
        ref[...] = value


# ----------------------------------------------------------------------------
# pallas_call wrappers: [B, S, rows, 1] partial states per (row, split).
# ----------------------------------------------------------------------------


def _compiler_params(blocks: KernelBlocks):
    if blocks.platform == "gpu":
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2)
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _call(kernel, blocks, grid, in_specs, out_rows, batch, interpret, name):
    out_spec_shape = lambda r: pl.BlockSpec((None, None, r, 1), lambda b, s, *_: (b, s, 0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[out_spec_shape(r) for r in out_rows],
        out_shape=[jax.ShapeDtypeStruct((batch, blocks.splits, r, 1), jnp.float32) for r in out_rows],
        compiler_params=_compiler_params(blocks),
        interpret=interpret,
        name=name,
    )


def _row_spec(shape):
    """The whole per-row array ``[B, *shape]`` (GPU bodies index into it), leading dim squeezed."""
    return pl.BlockSpec((None,) + shape, lambda b, *_: (b,) + (0,) * len(shape))


def _tile_spec(rows, tile, num_tiles, tiles_per_split):
    """TPU: tile t of split s of row b; steps past the last tile re-read it (fully masked in the body)."""
    return pl.BlockSpec(
        (None, rows, tile), lambda b, s, t: (b, 0, jnp.minimum(s * tiles_per_split + t, num_tiles - 1)))


def _stats_call(logits, draft, temp, q, draft_k, blocks, interpret):
    b, k1, vocab = logits.shape
    has_q = q is not None
    if blocks.platform == "gpu":
        tile = blocks.tile_v
        tps = _tiles_per_split(vocab, tile, blocks.splits)
        kernel = functools.partial(_stats_kernel_gpu, k1=k1, rows=_next_pow2(k1), vocab=vocab, tile=tile,
                                   tiles_per_split=tps, has_q=has_q)
        in_specs = [_row_spec((k1, vocab)), _row_spec((k1, 1)), _row_spec((1, 1))]
        operands = [logits, draft, temp]
        if has_q:
            in_specs.append(_row_spec((k1 - 1, vocab)))
            operands.append(q)
        grid = (b, blocks.splits)
    else:
        tile = blocks.tile_v
        num_tiles = -(-vocab // tile)
        tps = _tiles_per_split(vocab, tile, blocks.splits)
        kernel = functools.partial(_stats_kernel_tpu, k1=k1, vocab=vocab, tile=tile, tiles_per_split=tps,
                                   has_q=has_q)
        in_specs = [_tile_spec(k1, tile, num_tiles, tps), _row_spec((k1, 1)), _row_spec((1, 1))]
        operands = [logits, draft, temp]
        if has_q:
            in_specs += [_tile_spec(k1 - 1, tile, num_tiles, tps), _row_spec((k1 - 1, 1))]
            operands += [q, draft_k]
        grid = (b, blocks.splits, tps)
    out_rows = [k1] * 5 + ([k1 - 1] if has_q else [])
    return _call(kernel, blocks, grid, in_specs, out_rows, b, interpret, "rejection_stats")(*operands)


def _residual_call(logits, draft_k, temp, m, z, big_p, q, blocks, interpret):
    b, k1, vocab = logits.shape
    k = k1 - 1
    has_q = q is not None
    tile = blocks.tile_v
    tps = _tiles_per_split(vocab, tile, blocks.splits)
    cols = [_row_spec((k, 1))] * 3
    if blocks.platform == "gpu":
        kernel = functools.partial(_residual_kernel_gpu, k=k, rows=_next_pow2(k), vocab=vocab, tile=tile,
                                   tiles_per_split=tps, has_q=has_q)
        in_specs = [_row_spec((k1, vocab)), _row_spec((k, 1)), _row_spec((1, 1))] + cols
        in_specs += [_row_spec((k, vocab))] if has_q else []
        grid = (b, blocks.splits)
    else:
        num_tiles = -(-vocab // tile)
        kernel = functools.partial(_residual_kernel_tpu, k=k, vocab=vocab, tile=tile, tiles_per_split=tps,
                                   has_q=has_q)
        in_specs = [_tile_spec(k1, tile, num_tiles, tps), _row_spec((k, 1)), _row_spec((1, 1))] + cols
        in_specs += [_tile_spec(k, tile, num_tiles, tps)] if has_q else []
        grid = (b, blocks.splits, tps)
    operands = [logits, draft_k, temp, m, z, big_p] + ([q] if has_q else [])
    (zres,) = _call(kernel, blocks, grid, in_specs, [k], b, interpret, "rejection_residual_mass")(*operands)
    return zres


def _race_call(logits, exps, scalars, pos, q, blocks, interpret):
    """Races of row ``pos[b]`` of each batch row; ``scalars``: _NUM_SCALARS arrays [B] (see _race_kernel_gpu)."""
    b, k1, vocab = logits.shape
    has_q = q is not None
    tile = blocks.race_tile_v
    tps = _tiles_per_split(vocab, tile, blocks.splits)
    scalar_ops = [x.astype(jnp.float32).reshape(b, 1, 1) for x in scalars]
    scalar_specs = [_row_spec((1, 1))] * _NUM_SCALARS
    if blocks.platform == "gpu":
        kernel = functools.partial(_race_kernel_gpu, k=k1 - 1, vocab=vocab, tile=tile, tiles_per_split=tps,
                                   has_q=has_q)
        in_specs = [_row_spec((k1, vocab)), _row_spec((1, vocab)), _row_spec((1, 1))] + scalar_specs
        operands = [logits, exps, pos.reshape(b, 1, 1)] + scalar_ops
        if has_q:
            in_specs.append(_row_spec((k1 - 1, vocab)))
            operands.append(q)
        grid = (b, blocks.splits)
    else:
        # Mosaic blocks cannot start at a data-dependent sublane: gather the drawn row first ([B, 1, V]).
        num_tiles = -(-vocab // tile)
        take = lambda x, p: jnp.take_along_axis(x, p.reshape(b, 1, 1), axis=1)  # noqa: E731
        kernel = functools.partial(_race_kernel_tpu, vocab=vocab, tile=tile, tiles_per_split=tps, has_q=has_q)
        row = _tile_spec(1, tile, num_tiles, tps)
        in_specs = [row, row] + scalar_specs
        operands = [take(logits, pos), exps] + scalar_ops
        if has_q:
            in_specs.append(row)
            operands.append(take(q, jnp.minimum(pos, k1 - 2)))
        grid = (b, blocks.splits, tps)
    return _call(kernel, blocks, grid, in_specs, [1] * 5, b, interpret, "rejection_race")(*operands)


# ----------------------------------------------------------------------------
# Merging splits and the per-row decisions (jnp on [B, K+1] columns).
# ----------------------------------------------------------------------------


def _first_argmax(best, idx):
    """Merge per-split (max, first index) ``[B, S]`` into the row's first argmax ``[B]``."""
    top = jnp.max(best, axis=1, keepdims=True)
    return top[:, 0], jnp.min(jnp.where(best == top, idx, tiles.BIG_INDEX), axis=1)


def _merge_stats(gmax, garg, smax, ssum, sdraft):
    """[B, S, K+1] partials -> greedy ids, m, z, sdraft [B, K+1]."""
    top = jnp.max(gmax, axis=1, keepdims=True)
    greedy = jnp.min(jnp.where(gmax == top, garg, tiles.BIG_INDEX), axis=1)
    m_all = jnp.max(smax, axis=1, keepdims=True)
    safe = jnp.where(m_all > -jnp.inf, m_all, 0.0)
    z = jnp.sum(ssum * jnp.exp(smax - safe), axis=1)
    z = jnp.where(z > 0, z, 1.0)
    return greedy.astype(jnp.int32), safe[:, 0], z, jnp.max(sdraft, axis=1)


def _take(x, index):
    """x[b, index[b]] for x [B, K+1] and index [B]."""
    return jnp.take_along_axis(x, index[:, None], axis=1)[:, 0]


def _block_chain(p_draft, q_draft):
    """Block verification's P_i, i = 0..K: P_0 = 1, P_i = min(1, P_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i))."""
    cols = [jnp.ones_like(p_draft[:, 0])]
    for i in range(1, p_draft.shape[1]):
        pd, qd = p_draft[:, i - 1], q_draft[:, i - 1]
        # q(x) == 0 cannot occur for a draft sampled from q; treat it as "cannot accept".
        cols.append(jnp.where(qd > 0, jnp.minimum(1.0, (cols[-1] * pd) / jnp.where(qd > 0, qd, 1.0)), 0.0))
    return jnp.stack(cols, axis=1)  # [B, K+1]


@functools.partial(jax.jit, static_argnames=("method", "interpret", "platform", "blocks"))
def rejection_sample_kernel(
    draft_token_ids: jax.Array,  # int32 [B, K]
    num_draft_tokens: jax.Array,  # int32 [B]
    target_logits: jax.Array,  # float [B, K+1, V]
    draft_probs: jax.Array | None,  # float [B, K, V] or None (one-hot drafts)
    temperature: jax.Array,  # float [B]; <= 0 = greedy
    top_k: jax.Array | None,  # int32 [B] or None
    top_p: jax.Array | None,  # float [B] or None
    uniforms: jax.Array,  # float32 [B, K] in [0, 1): acceptance u (standard/synthetic) or eta (block)
    exponentials: jax.Array,  # float32 [B, V] Exp(1) noise for the one recovered/bonus draw
    conditional_rates: jax.Array | None = None,  # float32 [K], method="synthetic" only
    *,
    method: str = "standard",
    interpret: bool = False,
    platform: str | None = None,  # "tpu" | "gpu"; None: from jax.default_backend() ("gpu" bodies off-TPU)
    blocks: KernelBlocks | None = None,  # None: default_blocks(platform, ...)
) -> tuple[jax.Array, jax.Array]:
    """V-tiled Pallas rejection sampler. Returns (output ids int32 [B, K+1], accepted drafts int32 [B]).

    Same arguments and outputs as :func:`rejection_sample_reference`. Inputs are not
    value-checked (ids, ranges): that is the front end's job
    (:func:`specjax.sample.rejection.rejection_sample`). Shapes are checked here.
    """
    _check_shapes(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, top_k, top_p,
                  uniforms, exponentials, conditional_rates, method)
    b, k = draft_token_ids.shape
    k1, vocab = k + 1, target_logits.shape[2]
    if blocks is None:
        if platform is None:
            platform = "tpu" if jax.default_backend() == "tpu" else "gpu"
        blocks = default_blocks(platform, b, k1, vocab)
    elif platform is not None and platform != blocks.platform:
        raise ValueError(f"platform={platform!r} disagrees with blocks.platform={blocks.platform!r}")

    temp = temperature.astype(jnp.float32)
    logits = target_logits
    if top_k is not None or top_p is not None:
        # The filters need a sort over V (plain jnp); greedy rows keep their raw logits.
        logits = jnp.where(jnp.isnan(logits), jnp.asarray(-jnp.inf, logits.dtype), logits)
        shaped = transform_logits(logits, temp, top_k, top_p)  # [B, K+1, V] float32, temperature applied
        logits = jnp.where((temp > 0)[:, None, None], shaped, logits.astype(jnp.float32))
        temp = jnp.where(temp > 0, 1.0, 0.0).astype(jnp.float32)
    q = draft_probs if k > 0 else None
    draft = jnp.concatenate([draft_token_ids.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)  # [B, K+1]
    temp_col = temp.reshape(b, 1, 1)
    draft_k = draft[:, :k, None]  # [B, K, 1]

    # Pass 1: statistics of every position.
    parts = _stats_call(logits, draft[:, :, None], temp_col, q, draft_k if q is not None else None, blocks,
                        interpret)
    parts = [x[..., 0] for x in parts]  # [B, S, rows]
    greedy_ids, m, z, sdraft = _merge_stats(*parts[:5])  # [B, K+1]
    pos = jnp.arange(k1, dtype=jnp.int32)[None, :]  # [1, K+1]
    n = num_draft_tokens.astype(jnp.int32)[:, None]  # [B, 1]
    valid = pos < n
    is_greedy = (temp <= 0)[:, None]  # [B, 1]
    has_draft = (draft >= 0) & (draft < vocab)
    p_draft = jnp.where(has_draft, jnp.exp(sdraft - m) / z, 0.0)  # [B, K+1]
    if q is None:
        q_draft = has_draft.astype(jnp.float32)
    else:
        q_draft = jnp.concatenate([jnp.max(parts[5], axis=1), jnp.zeros((b, 1), jnp.float32)], axis=1)
        q_draft = jnp.where(has_draft, q_draft, 0.0)
    accept_greedy = draft == greedy_ids
    any_random = jnp.any(temp > 0)

    if method == "block":
        big_p = _block_chain(p_draft, q_draft)  # [B, K+1]
        if k > 0:
            col = lambda x: x[:, :k, None]  # noqa: E731
            z_res = jax.lax.cond(
                any_random,
                lambda: jnp.sum(_residual_call(logits, draft_k, temp_col, col(m), col(z), col(big_p), q, blocks,
                                               interpret)[..., 0], axis=1),
                lambda: jnp.zeros((b, k), jnp.float32))
            z_res = jnp.concatenate([z_res, jnp.zeros((b, 1), jnp.float32)], axis=1)  # [B, K+1]
        else:
            z_res = jnp.zeros((b, 1), jnp.float32)
        denom = z_res + (1.0 - big_p)
        weight = jnp.where(denom > 0, z_res / jnp.where(denom > 0, denom, 1.0), 1.0)  # h_i, i < g
        h = jnp.where(valid, weight, big_p)  # h_g = P_g
        eta = jnp.concatenate([jnp.ones((b, 1), jnp.float32), uniforms.astype(jnp.float32)], axis=1)
        # tau = the LARGEST i in 1..g with eta_i < h_i; earlier failures do not stop the scan.
        hit = (pos >= 1) & (pos <= n) & (eta < h)
        tau = jnp.max(jnp.where(hit, pos, 0), axis=1)
        first_fail = jnp.min(jnp.where(accept_greedy & valid, _BIG_POS, pos), axis=1)
        num_acc = jnp.where(is_greedy[:, 0], first_fail, tau)  # [B]
        scale = _take(big_p, num_acc)
    else:
        u = jnp.concatenate([uniforms.astype(jnp.float32), jnp.ones((b, 1), jnp.float32)], axis=1)  # [B, K+1]
        if method == "synthetic":
            rates = jnp.concatenate([conditional_rates.astype(jnp.float32), jnp.zeros((1,), jnp.float32)])
            accept = u < rates[None, :]
        else:
            # Accept x iff q(x) > 0 and u q(x) < p(x): p(x) == 0 is never accepted.
            accept = jnp.where(is_greedy, accept_greedy, (q_draft > 0) & (u * q_draft < p_draft))
        num_acc = jnp.min(jnp.where(accept & valid, _BIG_POS, pos), axis=1)  # [B], in [0, n]
        scale = jnp.ones((b,), jnp.float32)

    # Pass 3: the one draw per sampling row, at position num_acc.
    use_residual = (num_acc < n[:, 0]).astype(jnp.float32)
    scalars = (_take(m, num_acc), _take(z, num_acc), scale, use_residual, temp, _take(draft, num_acc))

    def race():
        rsum, best_r, idx_r, best_p, idx_p = (x[:, :, 0, 0] for x in _race_call(
            logits, exponentials.reshape(b, 1, vocab), scalars, num_acc, q, blocks, interpret))
        _, tok_r = _first_argmax(best_r, idx_r)
        _, tok_p = _first_argmax(best_p, idx_p)
        # A residual with no mass (p <= q to rounding) falls back to p itself.
        return jnp.where(jnp.sum(rsum, axis=1) > 0, tok_r, tok_p).astype(jnp.int32)

    sampled = jax.lax.cond(any_random, race, lambda: jnp.zeros((b,), jnp.int32))
    token = jnp.where(is_greedy[:, 0], _take(greedy_ids, num_acc), sampled)
    out = jnp.where(pos < num_acc[:, None], draft, jnp.where(pos == num_acc[:, None], token[:, None], -1))
    return out.astype(jnp.int32), num_acc.astype(jnp.int32)
