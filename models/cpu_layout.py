"""The derived XLA:CPU weight layout of a Llama-family model, and the product that streams it (issue 14).

Checkpoint layout: see :mod:`models.llama`. Derived layout (:func:`to_cpu_layout`; the checkpoint
tree is unchanged and ``models.llama.forward`` accepts either)::

    layers_{i}/self_attn/qkv_proj/kernel_t  [(H+2G)*E, D]  q, k, v rows stacked, transposed
    layers_{i}/self_attn/qkv_proj/bias      [(H+2G)*E]     (only if attention_bias)
    layers_{i}/self_attn/o_proj/kernel_t    [D, H*E]       (o_proj/bias unchanged)
    layers_{i}/mlp/gate_up_proj/kernel_t    [2F, D]        gate rows then up rows
    layers_{i}/mlp/down_proj/kernel_t       [D, F]
    lm_head/kernel_t                        [V, D]         (untied only; a tied head reads embedding [V, D])

Every projection then multiplies by a ``[N, K]`` matrix (:func:`matmul_t`), which on XLA:CPU
reads the weight once for a step of 2-16 rows (B*T; 32 for K >= 1024) instead of taking the GEMM
path; see :func:`matmul_t` and benchmarks/README.md ("Verify cost on CPU"). The engine converts an
unsharded model on CPU devices at load (``specjax.backends.use_cpu_weight_layout``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from models.llama import LlamaConfig


ROWS_PATH_MAX_ROWS = 16
"""Most rows (B*T) a product takes the row-streaming formulation for on CPU; more rows use the dot.

Twice that for weights with a long contraction (``K >= ROWS_PATH_WIDE_K``). Measured
(benchmarks/README.md): with K = 576 the dot against ``[N, K]`` weights is as fast from
16 rows on; with K = 2048 the row-streaming product still costs half the dot at 32 rows."""
ROWS_PATH_WIDE_K = 1024


def _dot_t(x2: jax.Array, w_t: jax.Array) -> jax.Array:
    """``[M, K] x [N, K] -> float32 [M, N]`` as one dot (GEMV at M = 1, GEMM above)."""
    return jax.lax.dot_general(x2, w_t.astype(x2.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _rows_product(x2: jax.Array, w_t: jax.Array) -> jax.Array:
    """``[M, K] x [N, K] -> float32 [M, N]`` as a broadcast multiply summed over the minor axis K.

    XLA:CPU (jaxlib 0.10) lowers this fusion to one YNNPACK kernel that reads each
    weight row once for all M rows, where a dot with a few rows takes a GEMM path
    costing 1.5-3x a one-row GEMV (benchmarks/README.md). That kernel is fastest
    at power-of-two row counts (measured on a 64 MB weight: 5 rows cost 1.3x
    8 rows), so the rows are zero-padded up to one. Producers of ``x2`` (norm
    scale, silu * up) may fuse into the kernel; XLA keeps the weight a direct
    operand, which is what matters.
    """
    m = x2.shape[0]
    padded = 1 << (m - 1).bit_length()
    xp = jnp.pad(x2.astype(jnp.float32), ((0, padded - m), (0, 0)))  # [Mp, K]
    y = jnp.sum(w_t.astype(jnp.float32)[None, :, :] * xp[:, None, :], axis=-1)  # [Mp, N]
    return y[:m]


def matmul_t(x: jax.Array, w_t: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    """``x [..., K]`` times the transpose of ``w_t [N, K]`` -> ``[..., N]`` in ``out_dtype`` (default x's).

    Accumulates in float32. With 2..ROWS_PATH_MAX_ROWS rows (twice that when
    ``K >= ROWS_PATH_WIDE_K``) the CPU lowering is
    :func:`_rows_product` (chosen per platform at lowering time by
    ``lax.platform_dependent``); every other case, and every other platform, is
    one dot.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)  # [M, K]
    max_rows = ROWS_PATH_MAX_ROWS * (2 if k >= ROWS_PATH_WIDE_K else 1)
    if 2 <= m <= max_rows:
        y = jax.lax.platform_dependent(x2, w_t, cpu=_rows_product, default=_dot_t)
    else:
        y = _dot_t(x2, w_t)
    return y.astype(out_dtype).reshape(*lead, w_t.shape[0])  # [..., N]



def to_cpu_layout(params: Mapping[str, Any], config: LlamaConfig) -> dict:
    """The derived XLA:CPU layout (module docstring) of a checkpoint-layout param tree; same dtypes.

    q/k/v become one ``[(H+2G)*E, D]`` matrix and gate/up one ``[2F, D]``; o/down
    projections and an untied LM head are transposed to ``[out, in]``. Norms, the
    embedding and o_proj's bias are kept. :func:`forward`, :func:`lm_head_logits`
    and ``DecoderLayer`` run either layout and give the same logits up to float
    rounding. Built on the host (numpy) once at load; it copies the weights, so
    drop the checkpoint tree afterwards. For a single device (the CPU engine): the
    fused matrices are not laid out for tensor-parallel sharding.
    """
    h, e = config.num_attention_heads, config.head_dim
    d, f = config.hidden_size, config.intermediate_size
    if is_cpu_layout(params):
        raise ValueError("params are already in the CPU layout")

    def t(a, rows: int) -> np.ndarray:  # [in..., out...] with `rows` input elements -> [out, in]
        return np.asarray(a).reshape(rows, -1).T

    def stack(*mats: np.ndarray) -> jax.Array:
        return jnp.asarray(np.ascontiguousarray(np.concatenate(mats, axis=0)))

    out: dict[str, Any] = {}
    for name, sub in params.items():
        if not name.startswith("layers_"):
            out[name] = sub
            continue
        attn, mlp = sub["self_attn"], sub["mlp"]
        qkv = {"kernel_t": stack(*(t(attn[p]["kernel"], d) for p in ("q_proj", "k_proj", "v_proj")))}
        if config.attention_bias:
            qkv["bias"] = stack(*(np.asarray(attn[p]["bias"]).reshape(-1) for p in ("q_proj", "k_proj", "v_proj")))
        new_attn = {"qkv_proj": qkv, "o_proj": {"kernel_t": stack(t(attn["o_proj"]["kernel"], h * e))}}  # [D, H*E]
        if "bias" in attn["o_proj"]:
            new_attn["o_proj"]["bias"] = attn["o_proj"]["bias"]
        for norm in ("q_norm", "k_norm"):
            if norm in attn:
                new_attn[norm] = attn[norm]
        new_mlp = {
            "gate_up_proj": {"kernel_t": stack(t(mlp["gate_proj"]["kernel"], d), t(mlp["up_proj"]["kernel"], d))},
            "down_proj": {"kernel_t": stack(t(mlp["down_proj"]["kernel"], f))},  # [D, F]
        }
        out[name] = {**{k: v for k, v in sub.items() if k not in ("self_attn", "mlp")},
                     "self_attn": new_attn, "mlp": new_mlp}
    if "lm_head" in params:
        out["lm_head"] = {"kernel_t": stack(t(params["lm_head"]["kernel"], d))}  # [V, D]
    return out


def is_cpu_layout(params: Mapping[str, Any]) -> bool:
    """Whether ``params`` is in the derived CPU layout of :func:`to_cpu_layout`."""
    return "qkv_proj" in params.get("layers_0", {}).get("self_attn", {})
