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

Where a model's weights exceed the machine's last-level cache (:func:`exceeds_last_level_cache`), each step streams
them from memory, and its products of several rows prefetch into the L2 rather than the L1 (``panels.h``; a K = 4
verify of a 592 MiB model 0.92x the time on a 2-core Xeon with a 300 MiB L3). The model's forward sets this while it
is traced (:func:`weights_streamed`); the products are the same either way.

A model read from a GGUF file keeps its Q4_0 / Q4_1 / Q8_0 matrices as the file stores them (``quantized`` of
:func:`to_cpu_layout`, from ``models.loading.load_blocks``): panels of GGUF blocks, which the kernel dequantizes
to the float32 values the params hold (checked at packing), so logits are again bit-identical while a step streams
5 or 8.5 bits per weight instead of 32 (SmolLM2-135M: 513 MiB of float32 weights, 92 MiB of blocks).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import jax
import numpy as np

from models.cpu_kernels import panel_matmul as _pm

if TYPE_CHECKING:
    from models.llama import LlamaConfig

logger = logging.getLogger(__name__)


def matmul_p(x: jax.Array, w_p: jax.Array, n: int, *, out_dtype: Any = None) -> jax.Array:
    """``x [..., K]`` times the ``[n, K]`` weight packed as ``w_p`` -> ``[..., n]`` (float32 accumulation)."""
    return _pm.panel_matmul(x, w_p, n, out_dtype=out_dtype, stream=streaming())


@functools.cache
def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> Optional[int]:
    """The size of this machine's largest CPU cache (Linux sysfs under ``root``), or None where it cannot be read."""
    sizes, units = [], {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in Path(root).glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def exceeds_last_level_cache(params: Mapping[str, Any]) -> bool:
    """Whether ``params``' arrays (concrete or abstract) take more bytes than :func:`last_level_cache_bytes`: then
    every step streams the weights from memory, and the panel kernel prefetches for that (``panels.h``)."""
    llc = last_level_cache_bytes()
    if llc is None:
        return False
    return sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(params)) > llc


_STREAM = contextvars.ContextVar("specjax_cpu_layout_stream", default=False)


def streaming() -> bool:
    """What the panel products being traced pass as their kernel's ``stream`` (:func:`weights_streamed`)."""
    return _STREAM.get()


@contextlib.contextmanager
def weights_streamed(params: Mapping[str, Any]):
    """Trace the products inside as those of the model ``params``: with ``stream`` where its weights exceed the
    last-level cache. A trace-time setting (as ``jax.default_matmul_precision`` is) so that the model's modules
    need not carry it; it is a function of the params' shapes and the machine, so a traced step never depends on
    anything its inputs' shapes do not fix."""
    token = _STREAM.set(exceeds_last_level_cache(params))
    try:
        yield
    finally:
        _STREAM.reset(token)


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


KEEP_GGUF_BLOCKS = True
"""Whether :func:`panels` keeps GGUF blocks (:class:`QuantizedMatrix`) as quantized panels. Not an option (the
logits are the same either way); ``benchmarks/bench_layout.py`` turns it off to time float32 panels beside."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedMatrix:
    """An output-major ``[N, K]`` weight as a GGUF file stores it: blocks of 32 along K, dequantized (in float32,
    each operation rounded, as the gguf package does) to ``d * q + m`` (Q4_1, and Q4_0 with ``m = -8 d``) or
    ``d * q`` (Q8_0)."""

    kind: str
    """``"q4_1"`` or ``"q8_0"``."""
    q: np.ndarray
    """``[N, K]``: uint8 in 0..15 (q4_1) or int8 (q8_0)."""
    d: np.ndarray
    """``[N, K / 32]`` float16 block scales."""
    m: Optional[np.ndarray] = None
    """``[N, K / 32]`` float16 block minimums (q4_1 only)."""

    def __post_init__(self) -> None:
        if self.kind not in ("q4_1", "q8_0"):
            raise ValueError(f"kind must be 'q4_1' or 'q8_0', got {self.kind!r}")
        if (self.m is None) != (self.kind == "q8_0"):
            raise ValueError(f"m must be given for q4_1 and only for it (kind={self.kind!r})")

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> QuantizedMatrix:
        """The same blocks with ``fn`` (a reordering of the N rows) applied to q, d and m."""
        return dataclasses.replace(self, q=fn(self.q), d=fn(self.d), m=None if self.m is None else fn(self.m))


def quantize_q8_0(w: Any) -> QuantizedMatrix:
    """An output-major ``[N, K]`` float weight (K a multiple of 32) as GGUF Q8_0 blocks, as llama.cpp quantizes:
    per block of 32, ``d = max |w| / 127`` (float16) and ``q = round(w / d)`` (int8, clipped to +-127 where the
    float16 rounding of d made it smaller). For a draft model or head (``speculative_config.quantization``): its
    drafts change a little, speculation stays exact. Its float values: ``dequantize_q8_0``."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs an input width that is a multiple of 32, got a [{n}, {k}] weight")
    blocks = w.reshape(n, k // 32, 32)
    d = (np.abs(blocks).max(axis=-1) / 127).astype(np.float16)  # [N, K / 32]
    scale = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(blocks / scale), 0)
    return QuantizedMatrix(kind="q8_0", q=np.clip(q, -127, 127).astype(np.int8).reshape(n, k), d=d)


def dequantize_q8_0(m: QuantizedMatrix) -> np.ndarray:
    """The float32 ``[N, K]`` values of Q8_0 blocks: ``d * q``, exact in float32 (module docstring)."""
    n, k = m.q.shape
    return (m.q.reshape(n, k // 32, 32).astype(np.float32) * m.d.astype(np.float32)[..., None]).reshape(n, k)


LAYER_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                     ("mlp", ("gate_proj", "up_proj", "down_proj")))
"""A decoder layer's projections by group, under the checkpoint layout's names."""


def _projection_matrix(entry: Mapping[str, Any], name: str) -> np.ndarray:
    """A projection's checkpoint kernel ``[in..., out...]`` -> ``[out, in]`` (o_proj's input is [H, E], the others'
    [D])."""
    kernel = entry["kernel"]
    return output_major(kernel, int(np.prod(np.shape(kernel)[:2 if name == "o_proj" else 1])))


def layer_q8_0(sub: Mapping[str, Any], prefix: str = "") -> tuple[dict, dict[str, QuantizedMatrix]]:
    """One checkpoint-layout decoder layer with each projection replaced by its :func:`quantize_q8_0` values, and
    those blocks under ``prefix + "self_attn/q_proj"`` etc. (:func:`layer_to_cpu_layout`'s ``quantized`` keys)."""
    out, blocks = dict(sub), {}
    for group, names in LAYER_PROJECTIONS:
        out[group] = dict(sub[group])
        for name in names:
            entry = sub[group][name]
            m = blocks[f"{prefix}{group}/{name}"] = quantize_q8_0(_projection_matrix(entry, name))
            out[group][name] = {**entry, "kernel": dequantize_q8_0(m).T.reshape(np.shape(entry["kernel"]))}
    return out, blocks


def model_q8_0(params: Mapping[str, Any], config: LlamaConfig) -> tuple[dict, dict[str, QuantizedMatrix]]:
    """A checkpoint-layout Llama with every projection and its output head (the tied embedding, else ``lm_head``)
    replaced by their :func:`quantize_q8_0` values, and those blocks, for :func:`to_cpu_layout` (with
    ``int8_activations=True``: the draft model of ``speculative_config.quantization``)."""
    out, blocks = dict(params), {}
    for i in range(config.num_hidden_layers):
        out[f"layers_{i}"], got = layer_q8_0(params[f"layers_{i}"], prefix=f"layers_{i}/")
        blocks.update(got)
    if "lm_head" in params:
        kernel = np.asarray(params["lm_head"]["kernel"], np.float32)  # [D, V]
        m = blocks["lm_head"] = quantize_q8_0(kernel.T)
        out["lm_head"] = {**params["lm_head"], "kernel": dequantize_q8_0(m).T}
    elif config.tie_word_embeddings:
        m = blocks["embed_tokens"] = quantize_q8_0(params["embed_tokens"]["embedding"])  # [V, D]
        out["embed_tokens"] = {**params["embed_tokens"], "embedding": dequantize_q8_0(m)}
    return out, blocks


def quantized_panels(parts: list[QuantizedMatrix], mats: list[Any], *, dot: bool = False) -> Optional[np.ndarray]:
    """Quantized panels of ``parts`` stacked, if they are one kind and dequantize exactly to ``mats`` (the float
    params, output-major); else None (the caller packs the floats). ``dot``: in the layout the kernel multiplies
    with int8-quantized activations (``panel_matmul.DOT_DTYPES``)."""
    if len({p.kind for p in parts}) != 1:
        return None
    cat = lambda xs: np.concatenate(xs, axis=0)  # noqa: E731
    want, q, d = cat([np.asarray(m) for m in mats]), cat([p.q for p in parts]), cat([p.d for p in parts])
    packed = None
    if want.dtype == np.float32 and q.shape == want.shape:
        packed = (_pm.pack_q4_1(q, d, cat([p.m for p in parts]), dot=dot) if parts[0].kind == "q4_1"
                  else _pm.pack_q8_0(q, d, dot=dot))
    if packed is None or not np.array_equal(_pm.dequantize(packed, len(want)), want):
        logger.info("GGUF blocks do not give the params' values (%s); packing the float weights", want.dtype)
        return None
    return packed


def panels(*mats: Any, quantized: Optional[list[Optional[QuantizedMatrix]]] = None, dot: bool = False) -> jax.Array:
    """Output-major ``[N_i, K]`` matrices stacked -> panels ``[P, K, C]`` (:func:`narrowed` storage), or quantized
    panels where every matrix has its GGUF blocks in ``quantized`` and they give its exact values (``dot``:
    :func:`quantized_panels`)."""
    if quantized is not None and KEEP_GGUF_BLOCKS and all(b is not None for b in quantized):
        packed = quantized_panels(list(quantized), list(mats), dot=dot)
        if packed is not None:
            return jax.numpy.asarray(packed)
    return jax.numpy.asarray(_pm.pack(narrowed(np.concatenate([np.asarray(m) for m in mats], axis=0))))


def output_major(a: Any, rows: int) -> np.ndarray:
    """A checkpoint kernel ``[in..., out...]`` with ``rows`` input elements -> ``[out, in]``."""
    return np.asarray(a).reshape(rows, -1).T


def _blocks(quantized: Optional[Mapping[str, QuantizedMatrix]], key: str) -> Optional[QuantizedMatrix]:
    return None if quantized is None else quantized.get(key)  # (Mapping.get: None on KeyError)


def layer_to_cpu_layout(sub: Mapping[str, Any], *, quantized: Optional[Mapping[str, QuantizedMatrix]] = None,
                        prefix: str = "", int8_activations: bool = False) -> dict:
    """One decoder layer's params (``models.llama.DecoderLayer`` names, also a draft head's layer) -> the
    derived layout: q/k/v fused (+ their biases), o_proj, gate/up fused, down_proj as panels; the rest kept.
    ``quantized``, ``int8_activations``: GGUF blocks by ``prefix + "self_attn/q_proj"`` etc. (:func:`to_cpu_layout`)."""
    attn = sub["self_attn"]

    def packed(group: str, names: tuple[str, ...]) -> jax.Array:
        mats = [_projection_matrix(sub[group][n], n) for n in names]
        return panels(*mats, quantized=[_blocks(quantized, f"{prefix}{group}/{n}") for n in names],
                      dot=int8_activations)

    qkv = {"kernel_p": packed("self_attn", ("q_proj", "k_proj", "v_proj"))}
    if "bias" in attn["q_proj"]:
        qkv["bias"] = jax.numpy.asarray(np.concatenate(
            [np.asarray(attn[p]["bias"]).reshape(-1) for p in ("q_proj", "k_proj", "v_proj")]))
    new_attn = {"qkv_proj": qkv, "o_proj": {"kernel_p": packed("self_attn", ("o_proj",))}}
    if "bias" in attn["o_proj"]:
        new_attn["o_proj"]["bias"] = attn["o_proj"]["bias"]
    new_attn.update({k: v for k, v in attn.items() if k not in ("q_proj", "k_proj", "v_proj", "o_proj")})
    new_mlp = {"gate_up_proj": {"kernel_p": packed("mlp", ("gate_proj", "up_proj"))},
               "down_proj": {"kernel_p": packed("mlp", ("down_proj",))}}
    return {**{k: v for k, v in sub.items() if k not in ("self_attn", "mlp")}, "self_attn": new_attn, "mlp": new_mlp}


def to_cpu_layout(params: Mapping[str, Any], config: LlamaConfig, *,
                  quantized: Optional[Mapping[str, QuantizedMatrix]] = None, int8_activations: bool = False) -> dict:
    """The derived CPU layout (module docstring) of a checkpoint-layout param tree.

    ``quantized``: the matrices' GGUF blocks by checkpoint path (``"layers_0/self_attn/q_proj"``, ...,
    ``"embed_tokens"``, ``"lm_head"``; ``models.gguf_blocks.gguf_blocks``): a projection whose blocks all dequantize
    exactly to its params is packed as quantized panels (module docstring), others as float panels.
    ``int8_activations``: those quantized panels in the layout the kernel multiplies with int8-quantized
    activations, as llama.cpp does (faster; logits approximate the float product's; ``panel_matmul.DOT_DTYPES``).

    Norms, biases and an untied embedding are kept; panels are :func:`narrowed`. :func:`models.llama.forward`,
    ``lm_head_logits`` and ``DecoderLayer`` run either layout and give the same logits up to float rounding.
    Built on the host (numpy) once at load; it copies the weights, so drop the checkpoint tree afterwards. For a
    single device (the CPU engine): panels are not laid out for tensor-parallel sharding.
    """
    d = config.hidden_size
    if is_cpu_layout(params):
        raise ValueError("params are already in the CPU layout")
    out: dict[str, Any] = {
        name: layer_to_cpu_layout(sub, quantized=quantized, prefix=f"{name}/", int8_activations=int8_activations)
        if name.startswith("layers_") else sub
        for name, sub in params.items()}
    if "lm_head" in params:
        out["lm_head"] = {"kernel_p": panels(output_major(params["lm_head"]["kernel"], d),
                                             quantized=[_blocks(quantized, "lm_head")], dot=int8_activations)}
    elif config.tie_word_embeddings:  # one copy: the panels serve the lookups and the head
        out["embed_tokens"] = {"embedding_p": panels(params["embed_tokens"]["embedding"],
                                                     quantized=[_blocks(quantized, "embed_tokens")],
                                                     dot=int8_activations)}
    return out


def is_cpu_layout(params: Mapping[str, Any]) -> bool:
    """Whether ``params`` is in the derived CPU layout of :func:`to_cpu_layout`."""
    return "qkv_proj" in params.get("layers_0", {}).get("self_attn", {})


def has_int8_activations(params: Mapping[str, Any]) -> bool:
    """Whether any panels in ``params`` run with int8 activations (:func:`to_cpu_layout`'s ``int8_activations``)."""
    return any(_pm.is_dot(leaf) for leaf in jax.tree.leaves(params) if hasattr(leaf, "dtype"))
