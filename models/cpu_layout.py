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

Panels keep a float32 weight in bfloat16 when every value of it is one (a bfloat16 checkpoint upcast at load,
as every shipped model is): the kernel widens each weight back to the same float32 and runs the same
multiply-adds, so logits are bit-identical while a step streams half the bytes (the shipped 7.5M target's
weights, 29 MiB in float32, then fit the last-level cache). Activations stay in the params' dtype.
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


def embedding_rows(embed: Mapping[str, Any], tokens: jax.Array, dtype: Any = None) -> jax.Array:
    """int tokens ``[B, T]`` -> rows ``[B, T, D]`` of an ``embed_tokens`` entry in either layout (ids clipped), in
    ``dtype`` (default: the entry's; panels may hold a float32 model's weights in bfloat16, module docstring)."""
    if "embedding_p" in embed:
        out = _pm.rows(embed["embedding_p"], tokens)
    else:
        out = jax.numpy.take(embed["embedding"], tokens, axis=0, mode="clip")
    return out if dtype is None else out.astype(dtype)


NARROW_EXACT_BFLOAT16 = True
"""Whether :func:`narrowed` stores exact-bfloat16 float32 weights in bfloat16. Not an option (the logits are the
same either way); ``benchmarks/bench_layout.py`` turns it off to time the float32 panels beside."""


def narrowed(w: np.ndarray) -> np.ndarray:
    """``w`` in bfloat16 if it is float32 and every value is exactly a bfloat16 (low 16 bits zero), else ``w``.

    Exact both ways, so the panel kernel computes the same products from either."""
    if w.dtype != np.float32 or not NARROW_EXACT_BFLOAT16:
        return w
    bits = np.ascontiguousarray(w).view(np.uint32)
    if np.any(bits.reshape(-1)[:4096] & 0xFFFF) or np.any(bits & 0xFFFF):  # a sample first: most fp32 models fail it
        return w
    return (bits >> 16).astype(np.uint16).view(jax.numpy.bfloat16)


def panels(*mats: Any) -> jax.Array:
    """Output-major ``[N_i, K]`` matrices stacked -> panels ``[P, K, C]`` (:func:`narrowed` storage)."""
    return jax.numpy.asarray(_pm.pack(narrowed(np.concatenate([np.asarray(m) for m in mats], axis=0))))


def output_major(a: Any, rows: int) -> np.ndarray:
    """A checkpoint kernel ``[in..., out...]`` with ``rows`` input elements -> ``[out, in]``."""
    return np.asarray(a).reshape(rows, -1).T


def layer_to_cpu_layout(sub: Mapping[str, Any]) -> dict:
    """One decoder layer's params (``models.llama.DecoderLayer`` names, also a draft head's layer) -> the
    derived layout: q/k/v fused (+ their biases), o_proj, gate/up fused, down_proj as panels; the rest kept."""
    attn, mlp = sub["self_attn"], sub["mlp"]

    def mat(entry, in_dims: int = 1) -> np.ndarray:  # a kernel [in..., out...] -> [out, in]
        return output_major(entry["kernel"], int(np.prod(np.shape(entry["kernel"])[:in_dims])))

    qkv = {"kernel_p": panels(*(mat(attn[p]) for p in ("q_proj", "k_proj", "v_proj")))}
    if "bias" in attn["q_proj"]:
        qkv["bias"] = jax.numpy.asarray(np.concatenate(
            [np.asarray(attn[p]["bias"]).reshape(-1) for p in ("q_proj", "k_proj", "v_proj")]))
    new_attn = {"qkv_proj": qkv, "o_proj": {"kernel_p": panels(mat(attn["o_proj"], 2))}}  # o: [H, E, D]
    if "bias" in attn["o_proj"]:
        new_attn["o_proj"]["bias"] = attn["o_proj"]["bias"]
    new_attn.update({k: v for k, v in attn.items() if k not in ("q_proj", "k_proj", "v_proj", "o_proj")})
    new_mlp = {"gate_up_proj": {"kernel_p": panels(mat(mlp["gate_proj"]), mat(mlp["up_proj"]))},
               "down_proj": {"kernel_p": panels(mat(mlp["down_proj"]))}}
    return {**{k: v for k, v in sub.items() if k not in ("self_attn", "mlp")}, "self_attn": new_attn, "mlp": new_mlp}


def to_cpu_layout(params: Mapping[str, Any], config: LlamaConfig) -> dict:
    """The derived CPU layout (module docstring) of a checkpoint-layout param tree.

    Norms, biases and an untied embedding are kept; panels are :func:`narrowed`. :func:`models.llama.forward`,
    ``lm_head_logits`` and ``DecoderLayer`` run either layout and give the same logits up to float rounding.
    Built on the host (numpy) once at load; it copies the weights, so drop the checkpoint tree afterwards. For a
    single device (the CPU engine): panels are not laid out for tensor-parallel sharding.
    """
    d = config.hidden_size
    if is_cpu_layout(params):
        raise ValueError("params are already in the CPU layout")
    out: dict[str, Any] = {name: layer_to_cpu_layout(sub) if name.startswith("layers_") else sub
                           for name, sub in params.items()}
    if "lm_head" in params:
        out["lm_head"] = {"kernel_p": panels(output_major(params["lm_head"]["kernel"], d))}
    elif config.tie_word_embeddings:  # one copy: the panels serve the lookups and the head
        out["embed_tokens"] = {"embedding_p": panels(params["embed_tokens"]["embedding"])}
    return out


def is_cpu_layout(params: Mapping[str, Any]) -> bool:
    """Whether ``params`` is in the derived CPU layout of :func:`to_cpu_layout`."""
    return "qkv_proj" in params.get("layers_0", {}).get("self_attn", {})
