"""One functional decoder for Llama / Mistral / Qwen2 / Qwen3 (config-switched).

Covers: GQA/MQA, explicit ``head_dim`` (may differ from hidden/heads), tied or
untied embeddings, q/k/v bias (Qwen2; Llama/Qwen3 ``attention_bias``), o-proj
bias (Llama/Qwen3 ``attention_bias``), per-head q/k RMSNorm (Qwen3), RoPE types
"default", "linear" and "llama3". Sliding-window attention is *not* applied:
``LlamaConfig.sliding_window`` is stored for callers (e.g. to cap context) but
:func:`forward` attends over the full causal context.

Attention goes through the paged KV cache (``specjax.kv_cache``): each layer
writes the step's K/V with ``write_kv`` and then attends with
``specjax.attention.paged_attention``, so prefill, chunked prefill, decode and multi-token
verification are all the same call.

Param layout (``params`` is the inner dict, i.e. ``Model.init(...)["params"]``)::

    embed_tokens/embedding              [V, D]
    layers_{i}/input_layernorm/scale    [D]
    layers_{i}/self_attn/q_proj/kernel  [D, H, E]   (+ bias [H, E] if attention_bias)
    layers_{i}/self_attn/k_proj/kernel  [D, G, E]   (+ bias [G, E] if attention_bias)
    layers_{i}/self_attn/v_proj/kernel  [D, G, E]   (+ bias [G, E] if attention_bias)
    layers_{i}/self_attn/o_proj/kernel  [H, E, D]   (+ bias [D] if attention_out_bias)
    layers_{i}/self_attn/q_norm/scale   [E]         (only if qk_norm)
    layers_{i}/self_attn/k_norm/scale   [E]         (only if qk_norm)
    layers_{i}/post_attention_layernorm/scale [D]
    layers_{i}/mlp/gate_proj/kernel     [D, F]
    layers_{i}/mlp/up_proj/kernel       [D, F]
    layers_{i}/mlp/down_proj/kernel     [F, D]
    norm/scale                          [D]
    lm_head/kernel                      [D, V]      (absent if tie_word_embeddings)

The derived XLA:CPU layout (fused, transposed weights) is in :mod:`models.cpu_layout`;
:func:`forward` accepts either tree.

Shape letters: b rows, t query tokens, s keys, d model, h q heads, g kv heads,
r heads per kv, e head dim, f ffn, v vocab.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.cpu_layout import (  # noqa: F401 (re-exported)
    embedding_rows, is_cpu_layout, matmul_p, streaming, to_cpu_layout, weights_streamed)
from models.llama_config import (  # noqa: F401 (re-exported)
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    LlamaConfig,
    _freeze,
)
from models.cpu_kernels import decoder_layer as cpu_decoder_layer
from specjax import backends
from specjax.attention import paged_attention

if TYPE_CHECKING:
    from specjax.kv_cache import AttentionMetadata, KVCache


def _kv():
    # Imported lazily: `specjax/__init__` imports the engine, which imports this
    # module, so a top-level import would be circular when `models` loads first.
    from specjax import kv_cache

    return kv_cache

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """float32 [E/2] inverse frequencies, following HF ``modeling_rope_utils``."""
    e = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))  # [E/2]
    rope_type = config.rope_type
    if rope_type == "linear":
        inv_freq = inv_freq / dict(config.rope_scaling)["factor"]
    elif rope_type == "llama3":
        s = dict(config.rope_scaling)
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """float32 cos and sin ``[B, T, E/2]`` of the RoPE angles at ``positions: [B, T]``."""
    freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)  # [B, T, E/2]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE (HF layout) of ``x: [B, T, N, E]`` at ``positions: [B, T]``; float32 math."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, E/2]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)  # [B, T, N, E/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [B, T, N, E]
    return out.astype(x.dtype)


# --------------------------------------------------------------------------- modules

_kernel_init = nn.initializers.normal(stddev=0.02)


def _tied_logits(embed: Mapping[str, Any], x: jax.Array, vocab_size: int) -> jax.Array:
    """float32 logits ``[..., V]`` of ``x [..., D]`` through a tied ``embed_tokens`` entry in either layout."""
    if "embedding_p" in embed:  # derived CPU layout: panels of [V, D]
        return matmul_p(x, embed["embedding_p"], vocab_size, out_dtype=jnp.float32)
    w = embed["embedding"]  # already [V, D]
    return jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in float32, cast back, then scale in the input dtype."""

    eps: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale * xf.astype(x.dtype)


class _Proj(nn.Module):
    """x [B, T, D] -> [B, T, N, E] with kernel [D, N, E] (+ bias [N, E])."""

    n: int
    e: int
    bias: bool
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _kernel_init, (x.shape[-1], self.n, self.e), self.param_dtype)  # [D, N, E]
        y = jnp.einsum("btd,dne->btne", x, kernel.astype(x.dtype))  # [B, T, N, E]
        if self.bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.n, self.e), self.param_dtype).astype(x.dtype)
        return y


class _OutProj(nn.Module):
    """attn [B, T, H, E] -> [B, T, D] with kernel [H, E, D] (+ bias [D])."""

    d: int
    bias: bool
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, h, e = x.shape
        if self.has_variable("params", "kernel_p"):  # derived CPU layout: panels of [D, H*E]
            y = matmul_p(x.reshape(b, t, h * e), self.get_variable("params", "kernel_p"), self.d)  # [B, T, D]
        else:
            kernel = self.param("kernel", _kernel_init, (h, e, self.d), self.param_dtype)  # [H, E, D]
            # One [H*E, D] GEMM: XLA:CPU runs a dot with two contracting dims ~3x slower at small batch.
            y = x.reshape(b, t, h * e) @ kernel.reshape(h * e, self.d).astype(x.dtype)  # [B, T, D]
        if self.bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.d,), self.param_dtype).astype(x.dtype)
        return y


class _Dense(nn.Module):
    """x [B, T, I] -> [B, T, O] with kernel [I, O] (all MLP projections; a draft head's ``fc``, + bias [O])."""

    features: int
    param_dtype: Any = jnp.float32
    bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.has_variable("params", "kernel_p"):  # derived CPU layout: panels of [O, I]
            y = matmul_p(x, self.get_variable("params", "kernel_p"), self.features)
        else:
            kernel = self.param("kernel", _kernel_init, (x.shape[-1], self.features), self.param_dtype)  # [I, O]
            y = jnp.einsum("bti,io->bto", x, kernel.astype(x.dtype))
        if self.bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(y.dtype)
        return y


def fused_qkv(x: jax.Array, fused: Mapping[str, Any], h: int, g: int, e: int):
    """x [B, T, I] through a derived-layout ``qkv_proj`` (panels of [(H+2G)*E, I], optional bias) -> q [B, T, H, E],
    k and v [B, T, G, E]."""
    qkv = matmul_p(x, fused["kernel_p"], (h + 2 * g) * e)  # [B, T, (H+2G)*E]
    if "bias" in fused:
        qkv = qkv + fused["bias"].astype(x.dtype)
    b, t = x.shape[:2]
    q = qkv[..., : h * e].reshape(b, t, h, e)
    k = qkv[..., h * e : (h + g) * e].reshape(b, t, g, e)
    return q, k, qkv[..., (h + g) * e :].reshape(b, t, g, e)


class Attention(nn.Module):
    config: LlamaConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # int32 [B, T]
        k_cache: jax.Array,  # [num_slots, G, E]
        v_cache: jax.Array,  # [num_slots, G, E]
        attn_metadata: AttentionMetadata,
        block_size: int,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        c, pd = self.config, self.param_dtype
        h, g, e = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if self.has_variable("params", "qkv_proj"):  # derived CPU layout: one [(H+2G)*E, D] product
            fused = self.get_variable("params", "qkv_proj")
            q, k, v = fused_qkv(x, fused, h, g, e)
        else:
            q = _Proj(h, e, c.attention_bias, pd, name="q_proj")(x)  # [B, T, H, E]
            k = _Proj(g, e, c.attention_bias, pd, name="k_proj")(x)  # [B, T, G, E]
            v = _Proj(g, e, c.attention_bias, pd, name="v_proj")(x)  # [B, T, G, E]
        if c.qk_norm:  # Qwen3: per-head RMSNorm over E, before RoPE
            q = RMSNorm(c.rms_norm_eps, pd, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, pd, name="k_norm")(k)
        inv_freq = rope_inv_freq(c)  # host constant, folded into the compiled program
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)

        # Write first: the query tokens of this step must see their own keys.
        kv = _kv()
        k_cache, v_cache = kv.write_kv(k_cache, v_cache, k, v, attn_metadata.slot_mapping)
        attn = paged_attention(q, k_cache, v_cache, positions, attn_metadata.block_tables, block_size=block_size,
                               scale=e**-0.5, cpu_layout=self.has_variable("params", "qkv_proj"))  # [B, T, H, E]
        out = _OutProj(c.hidden_size, c.attention_out_bias, pd, name="o_proj")(attn)  # [B, T, D]
        return out, k_cache, v_cache


class MLP(nn.Module):
    config: LlamaConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        c, pd = self.config, self.param_dtype
        if self.has_variable("params", "gate_up_proj"):  # derived CPU layout: one [2F, D] product
            gate_up = matmul_p(x, self.get_variable("params", "gate_up_proj")["kernel_p"],
                               2 * c.intermediate_size)  # [B, T, 2F]
            gate, up = jnp.split(gate_up, 2, axis=-1)  # [B, T, F] each
        else:
            gate = _Dense(c.intermediate_size, pd, name="gate_proj")(x)  # [B, T, F]
            up = _Dense(c.intermediate_size, pd, name="up_proj")(x)  # [B, T, F]
        return _Dense(c.hidden_size, pd, name="down_proj")(nn.silu(gate) * up)  # [B, T, D]


FUSE_CPU_LAYERS = True
"""Whether a CPU-layout layer the fused kernel computes runs as one call (``models/cpu_kernels/decoder_layer.cc``).
Not an option (the same layer either way, to float32 rounding); tests and benchmarks turn it off to compare."""


class DecoderLayer(nn.Module):
    config: LlamaConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, positions, k_cache, v_cache, attn_metadata, block_size):
        """x [B, T, D] -> (x [B, T, D], k_cache, v_cache) with this step's K/V written."""
        c, pd = self.config, self.param_dtype
        fused = self._fused_weights(x, k_cache)
        if fused is not None:
            rope = jnp.concatenate(rope_cos_sin(positions, rope_inv_freq(c)), axis=-1)  # [B, T, E] (one per forward)
            return cpu_decoder_layer.decoder_layer(
                x, positions, attn_metadata.slot_mapping, attn_metadata.block_tables, k_cache, v_cache, rope,
                weights=fused, num_heads=c.num_attention_heads, intermediate=c.intermediate_size,
                block_size=block_size, eps=c.rms_norm_eps, stream=streaming())
        normed = RMSNorm(c.rms_norm_eps, pd, name="input_layernorm")(x)
        attn, k_cache, v_cache = Attention(c, pd, name="self_attn")(
            normed, positions, k_cache, v_cache, attn_metadata, block_size
        )
        x = x + attn  # [B, T, D]
        x = x + MLP(c, pd, name="mlp")(RMSNorm(c.rms_norm_eps, pd, name="post_attention_layernorm")(x))
        return x, k_cache, v_cache

    def _fused_weights(self, x: jax.Array, k_cache: jax.Array) -> Optional[dict]:
        """The layer's weights for the fused CPU kernel, or None where it runs as separate operations: outside the
        CPU layout, with attention forced to XLA, or with anything the kernel does not compute."""
        c = self.config
        if not (FUSE_CPU_LAYERS and x.dtype == jnp.float32 and not c.qk_norm
                and k_cache.dtype in (jnp.float32, jnp.bfloat16)
                and backends.attention_backend(x.shape[1], cpu_layout=True) == backends.PAGED_CPU
                and cpu_decoder_layer.available()):
            return None
        names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        if not all(self.has_variable("params", n) for n in names):
            return None
        return cpu_decoder_layer.fused_weights({n: self.get_variable("params", n) for n in names})


class Embed(nn.Module):
    num_embeddings: int
    features: int
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        if self.has_variable("params", "embedding_p"):  # derived CPU layout (tied): panels of [V, D]
            self.entry = {"embedding_p": self.get_variable("params", "embedding_p")}
        else:
            self.entry = {"embedding": self.param(
                "embedding", nn.initializers.normal(stddev=0.02), (self.num_embeddings, self.features),
                self.param_dtype
            )}  # [V, D]

    def __call__(self, tokens: jax.Array) -> jax.Array:  # int [B, T] -> [B, T, D]
        # ids are clipped: garbage ids in padding positions must not turn into NaN rows.
        return embedding_rows(self.entry, tokens)

    def attend(self, x: jax.Array) -> jax.Array:  # [B, L, D] -> float32 [B, L, V] (tied LM head)
        return _tied_logits(self.entry, x, self.num_embeddings)


class LMHead(nn.Module):
    vocab_size: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [B, L, D] -> float32 [B, L, V]
        if self.has_variable("params", "kernel_p"):  # derived CPU layout: panels of [V, D]
            return matmul_p(x, self.get_variable("params", "kernel_p"), self.vocab_size, out_dtype=jnp.float32)
        kernel = self.param("kernel", _kernel_init, (x.shape[-1], self.vocab_size), self.param_dtype)  # [D, V]
        return jnp.einsum("bld,dv->blv", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)


class Model(nn.Module):
    """Decoder + LM head. ``param_dtype`` only matters at init; apply computes in the params' dtype."""

    config: LlamaConfig
    param_dtype: Any = jnp.float32
    aux_layer_ids: tuple[int, ...] = ()
    """Layers whose output residual stream is sown into ``intermediates`` (EAGLE-3 features)."""

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,  # int32 [B, T]
        positions: jax.Array,  # int32 [B, T]
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        logits_indices: Optional[jax.Array] = None,  # int32 [B, L]
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        c, pd = self.config, self.param_dtype
        if len(kv_cache.k) != c.num_hidden_layers:
            raise ValueError(f"kv_cache has {len(kv_cache.k)} layers, config.num_hidden_layers={c.num_hidden_layers}")
        # Every product below as this model's (its weights beyond the last-level cache or not; cpu_layout).
        with weights_streamed(self.variables.get("params", {})):
            embed = Embed(c.vocab_size, c.hidden_size, pd, name="embed_tokens")
            x = embed(tokens)  # [B, T, D]
            if self.has_variable("params", "norm"):  # applying: rows of narrowed panels come back to the params' dtype
                x = x.astype(self.get_variable("params", "norm")["scale"].dtype)
            new_k, new_v = [], []
            for i in range(c.num_hidden_layers):  # Python loop: unrolled, fine at our depths
                x, k_i, v_i = DecoderLayer(c, pd, name=f"layers_{i}")(
                    x, positions, kv_cache.k[i], kv_cache.v[i], attn_metadata, kv_cache.block_size
                )
                new_k.append(k_i)
                new_v.append(v_i)
                if i in self.aux_layer_ids:
                    self.sow("intermediates", f"aux_{i}", x)
            hidden = RMSNorm(c.rms_norm_eps, pd, name="norm")(x)  # [B, T, D]

            selected = hidden  # [B, L, D] (L = T unless logits_indices)
            if logits_indices is not None:
                # Gather before the LM head: only L of the T positions need [V]-sized logits.
                idx = logits_indices.astype(jnp.int32)[:, :, None]  # [B, L, 1]
                selected = jnp.take_along_axis(hidden, idx, axis=1, mode="clip")  # [B, L, D]
            if c.tie_word_embeddings:
                logits = embed.attend(selected)  # float32 [B, L, V]
            else:
                logits = LMHead(c.vocab_size, pd, name="lm_head")(selected)  # float32 [B, L, V]
            cache = _kv().KVCache(k=tuple(new_k), v=tuple(new_v), block_size=kv_cache.block_size)
            return logits.astype(jnp.float32), hidden, cache


# --------------------------------------------------------------------------- functional API


def forward(
    params: Mapping[str, Any],
    tokens: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    attn_metadata: AttentionMetadata,
    *,
    config: LlamaConfig,
    logits_indices: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One step over a padded batch of query tokens through the paged KV cache.

    tokens, positions: int32 [B, T]. Padding tokens: slot_mapping -1 (nothing
    written) and any position >= 0 (their outputs are garbage, ignore them).
    Returns (float32 logits [B, T, V] or [B, L, V] with ``logits_indices``
    int32 [B, L], final-normed hidden_states [B, T, D] in the params' dtype,
    the updated KVCache). jit with ``static_argnames=("config",),
    donate_argnames=("kv_cache",)``.
    """
    return Model(config).apply({"params": params}, tokens, positions, kv_cache, attn_metadata, logits_indices)


@functools.partial(jax.jit, static_argnames=("config",))
def _prompt_forward(params, tokens, cache, meta, *, config: LlamaConfig):
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return forward(params, tokens, positions, cache, meta, config=config)[0][0]


def prompt_logits(params: Mapping[str, Any], tokens, *, config: LlamaConfig, block_size: int = 16) -> np.ndarray:
    """float32 ``[T, V]`` logits at every position of one prompt, through the paged forward with its KV in
    contiguous blocks of ``block_size`` (a reference for tests and benchmarks, not the engine's path)."""
    kv = _kv()
    t = len(tokens)
    blocks = -(-t // block_size)
    cache = kv.KVCache.allocate(num_layers=config.num_hidden_layers, num_blocks=blocks, block_size=block_size,
                                num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                dtype=jnp.float32)
    meta = kv.AttentionMetadata(slot_mapping=jnp.arange(t, dtype=jnp.int32)[None],
                                block_tables=jnp.arange(blocks, dtype=jnp.int32)[None])
    return np.asarray(_prompt_forward(params, jnp.asarray([tokens], jnp.int32), cache, meta, config=config))


def forward_features(
    params: Mapping[str, Any],
    tokens: jax.Array,
    positions: jax.Array,
    kv_cache: KVCache,
    attn_metadata: AttentionMetadata,
    *,
    config: LlamaConfig,
    logits_indices: Optional[jax.Array] = None,
    aux_layer_ids: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, Optional[jax.Array], KVCache]:
    """:func:`forward` that also returns the residual streams after ``aux_layer_ids``, concatenated.

    Returns (logits, hidden [B, T, D], aux [B, T, A*D] or None, cache): what draft heads read, from the
    same pass (no second forward).
    """
    model = Model(config, aux_layer_ids=tuple(aux_layer_ids))
    if not aux_layer_ids:
        logits, hidden, cache = model.apply({"params": params}, tokens, positions, kv_cache, attn_metadata,
                                            logits_indices)
        return logits, hidden, None, cache
    (logits, hidden, cache), state = model.apply(
        {"params": params}, tokens, positions, kv_cache, attn_metadata, logits_indices, mutable=["intermediates"]
    )
    inter = state["intermediates"]
    aux = jnp.concatenate([inter[f"aux_{i}"][0] for i in aux_layer_ids], axis=-1)  # [B, T, A*D]
    return logits, hidden, aux, cache


def lm_head_logits(params: Mapping[str, Any], hidden: jax.Array, *, config: LlamaConfig) -> jax.Array:
    """float32 logits [B, L, V] of final-normed ``hidden [B, L, D]`` (for heads that reuse the LM head)."""
    with weights_streamed(params):  # the model's products, as in Model
        if config.tie_word_embeddings:
            return _tied_logits(params["embed_tokens"], hidden, config.vocab_size)
        if "kernel_p" in params["lm_head"]:  # derived CPU layout
            return matmul_p(hidden, params["lm_head"]["kernel_p"], config.vocab_size, out_dtype=jnp.float32)
    w = params["lm_head"]["kernel"]  # [D, V]
    return jnp.einsum("bld,dv->blv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params in the layout above: normal(0.02) kernels/embedding, unit norm scales, zero biases.

    The tree comes from ``Model.init`` under ``jax.eval_shape`` (so the forward is
    not compiled); the leaves are drawn by one small jitted function.
    """
    kv = _kv()
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = kv.KVCache.allocate(
        num_layers=config.num_hidden_layers,
        num_blocks=1,
        block_size=1,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    meta = kv.AttentionMetadata(slot_mapping=jnp.zeros((1, 1), jnp.int32), block_tables=jnp.zeros((1, 1), jnp.int32))
    shapes = jax.eval_shape(Model(config, param_dtype=dtype).init, key, tokens, tokens, cache, meta)["params"]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    names = tuple(path[-1].key for path, _ in leaves)
    leaf_shapes = tuple(leaf.shape for _, leaf in leaves)
    return jax.tree_util.tree_unflatten(treedef, _draw_params(key, names, leaf_shapes, jnp.dtype(dtype)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_params(key, names, shapes, dtype):
    # One RNG draw per distinct shape (stacked over layers), in the target dtype: a
    # threefry per leaf makes compile time explode, one flat f32 draw wastes memory.
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if name not in ("scale", "bias"):
            groups.setdefault(shape, []).append(i)
    drawn: dict[int, jax.Array] = {}
    for k, (shape, idx) in zip(jax.random.split(key, max(1, len(groups))), groups.items()):
        stack = 0.02 * jax.random.normal(k, (len(idx), *shape), dtype)  # [n, *shape]
        drawn.update({i: stack[j] for j, i in enumerate(idx)})
    return [
        jnp.ones(shape, dtype) if name == "scale" else jnp.zeros(shape, dtype) if name == "bias" else drawn[i]
        for i, (name, shape) in enumerate(zip(names, shapes))
    ]


def num_params(params: Any) -> int:
    """Total number of parameter scalars."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
