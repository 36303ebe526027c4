"""The derived XLA:CPU weight layout of a Llama-family model: every projection packed into panels (issue 14).

Checkpoint layout: see :mod:`models.llama`. Derived layout (:func:`to_cpu_layout`; the checkpoint
tree is unchanged and ``models.llama.forward`` accepts either). ``panels(W)`` is
:func:`models.cpu_kernels.panel_matmul.pack` of the ``[N, K]`` (output-major) matrix: ``[ceil(N/C), K, C]`` (C = ``panel_width()``)::

    layers_{i}/self_attn/qkv_proj/kernel_p  panels([(H+2G)*E, D])  q, k, v rows stacked
    layers_{i}/self_attn/qkv_proj/bias      [(H+2G)*E]             (only if attention_bias)
    layers_{i}/self_attn/o_proj/kernel_p    panels([D, H*E])       (o_proj/bias unchanged)
    layers_{i}/mlp/gate_up_proj/kernel_p    panels([2F, D])        gate rows then up rows
    layers_{i}/mlp/down_proj/kernel_p       panels([D, F])
    lm_head/kernel_p                        panels([V, D])         (untied head)
    embed_tokens/embedding_p                panels([V, D])         (tied: lookups and the head read the panels)

Every projection then runs :func:`matmul_p`, the C++ panel kernel (``models/cpu_kernels/panel_matmul.cc``), which
reads each weight once per step whatever the number of rows, so a (K+1)-token verify costs about what a
one-token step does (benchmarks/README.md, "Verify cost on CPU"). The engine converts an unsharded model on
CPU devices at load when the kernel is available (``specjax.backends.use_cpu_weight_layout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from models.cpu_kernels import panel_matmul as _pm

if TYPE_CHECKING:
    from models.llama import LlamaConfig


def matmul_p(x: jax.Array, w_p: jax.Array, n: int, *, out_dtype: Any = None) -> jax.Array:
    """``x [..., K]`` times the ``[n, K]`` weight packed as ``w_p`` -> ``[..., n]`` (float32 accumulation)."""
    return _pm.panel_matmul(x, w_p, n, out_dtype=out_dtype)


def embedding_rows(embed: Mapping[str, Any], tokens: jax.Array) -> jax.Array:
    """int tokens ``[B, T]`` -> rows ``[B, T, D]`` of an ``embed_tokens`` entry in either layout (ids clipped)."""
    if "embedding_p" in embed:
        return _pm.rows(embed["embedding_p"], tokens)
    return jax.numpy.take(embed["embedding"], tokens, axis=0, mode="clip")


def to_cpu_layout(params: Mapping[str, Any], config: LlamaConfig) -> dict:
    """The derived CPU layout (module docstring) of a checkpoint-layout param tree; same dtypes.

    Norms, biases and an untied embedding are kept. :func:`models.llama.forward`, ``lm_head_logits`` and
    ``DecoderLayer`` run either layout and give the same logits up to float rounding. Built on the host
    (numpy) once at load; it copies the weights, so drop the checkpoint tree afterwards. For a single device
    (the CPU engine): panels are not laid out for tensor-parallel sharding.
    """
    h, e = config.num_attention_heads, config.head_dim
    d, f = config.hidden_size, config.intermediate_size
    if is_cpu_layout(params):
        raise ValueError("params are already in the CPU layout")

    def t(a, rows: int) -> np.ndarray:  # [in..., out...] with `rows` input elements -> [out, in]
        return np.asarray(a).reshape(rows, -1).T

    def panels(*mats: np.ndarray) -> jax.Array:  # output-major matrices stacked -> [P, K, C]
        return jax.numpy.asarray(_pm.pack(np.concatenate(mats, axis=0)))

    out: dict[str, Any] = {}
    for name, sub in params.items():
        if not name.startswith("layers_"):
            out[name] = sub
            continue
        attn, mlp = sub["self_attn"], sub["mlp"]
        qkv = {"kernel_p": panels(*(t(attn[p]["kernel"], d) for p in ("q_proj", "k_proj", "v_proj")))}
        if config.attention_bias:
            qkv["bias"] = jax.numpy.asarray(np.concatenate(
                [np.asarray(attn[p]["bias"]).reshape(-1) for p in ("q_proj", "k_proj", "v_proj")]))
        new_attn = {"qkv_proj": qkv, "o_proj": {"kernel_p": panels(t(attn["o_proj"]["kernel"], h * e))}}
        if "bias" in attn["o_proj"]:
            new_attn["o_proj"]["bias"] = attn["o_proj"]["bias"]
        for norm in ("q_norm", "k_norm"):
            if norm in attn:
                new_attn[norm] = attn[norm]
        new_mlp = {
            "gate_up_proj": {"kernel_p": panels(t(mlp["gate_proj"]["kernel"], d), t(mlp["up_proj"]["kernel"], d))},
            "down_proj": {"kernel_p": panels(t(mlp["down_proj"]["kernel"], f))},
        }
        out[name] = {**{k: v for k, v in sub.items() if k not in ("self_attn", "mlp")},
                     "self_attn": new_attn, "mlp": new_mlp}
    if "lm_head" in params:
        out["lm_head"] = {"kernel_p": panels(t(params["lm_head"]["kernel"], d))}
    elif config.tie_word_embeddings:  # one copy: the panels serve the lookups and the head
        out["embed_tokens"] = {"embedding_p": panels(np.asarray(params["embed_tokens"]["embedding"]))}
    return out


def is_cpu_layout(params: Mapping[str, Any]) -> bool:
    """Whether ``params`` is in the derived CPU layout of :func:`to_cpu_layout`."""
    return "qkv_proj" in params.get("layers_0", {}).get("self_attn", {})
