"""One Llama decoder layer in one call on the CPU: the call wrapper and the validated entry. The kernel body is
``decoder_layer.cc`` (why it exists: its header comment); it calls the panel kernel and the paged attention, whose
numpy references are beside them, and its test checks it against the layer as separate operations
(``models.llama.DecoderLayer`` with ``FUSE_CPU_LAYERS`` off).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.cpu_kernels import build
from models.cpu_kernels import panel_matmul as pm
from models.cpu_kernels.build import available  # noqa: F401 (re-exported)


def fused_weights(layer: Mapping[str, Any]) -> dict | None:
    """A CPU-layout layer's parameters as the kernel takes them, or None where the layer has anything the kernel
    does not compute (biases, q/k norms, unfused projections, norms in another dtype than float32)."""
    attn, mlp = layer.get("self_attn", {}), layer.get("mlp", {})
    entries = (attn.get("qkv_proj", {}), attn.get("o_proj", {}), mlp.get("gate_up_proj", {}),
               mlp.get("down_proj", {}))
    if any(set(entry) != {"kernel_p"} for entry in entries) or set(attn) != {"qkv_proj", "o_proj"} \
            or set(mlp) != {"gate_up_proj", "down_proj"}:
        return None
    norms = (layer.get("input_layernorm", {}).get("scale"), layer.get("post_attention_layernorm", {}).get("scale"))
    if any(s is None or s.dtype != jnp.float32 for s in norms):
        return None
    qkv, o, gate_up, down = (e["kernel_p"] for e in entries)
    return dict(in_scale=norms[0], post_scale=norms[1], qkv_p=qkv, o_p=o, gate_up_p=gate_up, down_p=down)


def decoder_layer(
    x: jax.Array,  # float32 [B, T, D]
    positions: jax.Array,  # int32 [B, T]
    slot_mapping: jax.Array,  # int32 [B, T]
    block_tables: jax.Array,  # int32 [B, M]
    k_cache: jax.Array,  # [num_slots, G, E]
    v_cache: jax.Array,  # [num_slots, G, E]
    rope: jax.Array,  # float32 [B, T, E]: cos then sin of each token's E / 2 RoPE angles
    *,
    weights: Mapping[str, Any],
    num_heads: int,
    intermediate: int,
    block_size: int,
    eps: float,
    stream: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x after the layer ``[B, T, D]`` float32, k_cache, v_cache with this step's keys and values written).

    ``weights``: :func:`fused_weights` of the layer. ``stream``: as :func:`panel_matmul.panel_matmul`'s. Semantics:
    ``decoder_layer.cc``'s header. CPU only (an XLA custom call with the caches aliased in place); raises
    RuntimeError if the kernels could not be built here.
    """
    b, t, d = x.shape
    if x.dtype != jnp.float32:
        raise ValueError(f"x must be float32 [B, T, D], got {x.dtype}")
    if k_cache.ndim != 3 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be alike [num_slots, G, E], got {k_cache.shape} {k_cache.dtype} "
                         f"and {v_cache.shape} {v_cache.dtype}")
    if k_cache.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"the caches must be float32 or bfloat16, got {k_cache.dtype}")
    slots, g, e = k_cache.shape
    if num_heads % g or e % 2:
        raise ValueError(f"num_heads={num_heads} must be a multiple of G={g} and E={e} even")
    if positions.shape != (b, t) or slot_mapping.shape != (b, t) or block_tables.ndim != 2 \
            or block_tables.shape[0] != b or rope.shape != (b, t, e):
        raise ValueError(f"positions and slot_mapping must be [B, T] = {(b, t)}, block_tables [B, M] and rope "
                         f"[B, T, E] = {(b, t, e)}, got {positions.shape}, {slot_mapping.shape}, "
                         f"{block_tables.shape} and {rope.shape}")
    if block_size <= 0 or slots % block_size:
        raise ValueError(f"block_size={block_size} must divide num_slots={slots}")
    expect = {"qkv_p": ((num_heads + 2 * g) * e, d), "o_p": (d, num_heads * e), "gate_up_p": (2 * intermediate, d),
              "down_p": (d, intermediate)}
    c = pm.panel_width()
    for name, (n, k) in expect.items():
        p, pk, pc = pm.panel_shape(weights[name])
        if pk != k or pc != c or not (p - 1) * c < n <= p * c:
            raise ValueError(f"weights[{name!r}] must be panels of a [{n}, {k}] weight, got {weights[name].shape}")
    if not available():
        raise RuntimeError("the CPU decoder-layer kernel is not available here (see the log for why)")
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
           jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    i32 = jnp.int32
    return jax.ffi.ffi_call(build.LAYER_TARGET, out, input_output_aliases={4: 1, 5: 2})(
        x, positions.astype(i32), slot_mapping.astype(i32), block_tables.astype(i32), k_cache, v_cache,
        rope.astype(jnp.float32), weights["in_scale"], weights["qkv_p"], weights["o_p"],
        weights["post_scale"], weights["gate_up_p"], weights["down_p"],
        num_heads=np.int64(num_heads), intermediate=np.int64(intermediate), block_size=np.int64(block_size),
        eps=np.float32(eps), scale=np.float32(e**-0.5), stream=np.bool_(stream))
