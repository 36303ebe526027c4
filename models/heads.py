"""Draft heads that read the target's own hidden states: EAGLE, EAGLE-3, MTP and Medusa.

Letters as in :mod:`models.llama`, plus ``F`` = feature width (``D``, or
``A*D_t`` for EAGLE-3's ``A`` fused target layers) and ``Vd`` = the head's
draft vocabulary.

* **EAGLE** (Li et al. 2024) / **MTP** (DeepSeek-V3): entry ``p`` of the head is
  ``fc([embed(x_{p+1}); feature_p])`` -> one decoder layer with its own paged KV
  -> ``norm`` -> LM head, predicting ``x_{p+2}``. Chained drafting feeds the
  layer's own output back as the next entry's feature. MTP normalises both
  inputs first (``enorm``, ``hnorm``); EAGLE does not.
* **EAGLE-3**: the feature of a target entry is ``fc_aux`` over the residual
  streams after ``aux_layer_ids`` (low / mid / high layers), concatenated;
  chained entries feed the layer output as for EAGLE.
* **Medusa** (Cai et al. 2024): ``num_medusa_heads`` stacks of
  ``medusa_num_layers`` residual SiLU blocks on the target's final hidden
  state; head ``i`` predicts ``x_{p+i+2}`` from ``h_p``.

**Layouts** (``HeadConfig.layout``) say how the fusion layer is wired, so heads
published by their authors draft exactly what their authors' code drafts:

* ``"specjax"``: ``fc`` then a standard pre-norm decoder layer (``input_layernorm``
  on the fused input, residual = the fused input), then ``norm``.
* ``"eagle1"`` (EAGLE-1 as published): ``fc`` (optionally with bias) then a decoder
  layer *without* ``input_layernorm``; no final norm: the layer output goes
  straight into the LM head (it regresses the target's final-normed feature).
* ``"eagle3"`` (EAGLE-3 as published, ``midlayer``): no ``fc`` on the entry;
  attention reads ``[input_layernorm(embed); hidden_norm(feature)]`` (q/k/v
  kernels take ``2D`` inputs), the residual is the feature itself
  (``hidden_norm(feature)`` with ``norm_before_residual``), then
  ``post_attention_layernorm`` + MLP as usual, then ``norm``.

**Vocabulary**: with ``draft_vocab_size=None`` a head reuses the target's LM head
and vocabulary. With ``draft_vocab_size=Vd`` it has its own ``lm_head`` over
``Vd`` draft tokens and an int32 ``d2t [Vd]`` holding the **absolute target
id** of each draft index (EAGLE-3 checkpoints store offsets ``target - index``;
:mod:`models.published_heads` converts on load). The engine calls
:func:`head_greedy_tokens` / :func:`head_target_logits` (and the ``medusa_*``
twins), which return target ids / target-vocabulary logits either way.

Param trees (``kernel`` layouts as in models/llama.py)::

    fusion heads: fc.kernel [2D, D] (+ fc.bias [D]; not in layout eagle3); enorm/hnorm.scale [D] (mtp);
                  fc_aux.kernel [A*D_t, D] (+ fc_aux.bias [D]) (eagle3);
                  layer.{input_layernorm (not eagle1), hidden_norm (eagle3), self_attn.{q,k,v,o}_proj,
                  post_attention_layernorm, mlp.*}; norm.scale [D] (not eagle1);
                  lm_head.kernel [D, Vd] + d2t int32 [Vd] (draft vocab); embed_tokens.embedding [V, D] (own)
    medusa:       blocks_i.{kernel [D, D], bias [D]} (block 0 of head i), blocks_i_j (block j >= 1);
                  lm_heads_i.kernel [D, Vd] + d2t [Vd] (draft vocab)

Beside a target in ``models.cpu_layout`` (the engine on one CPU device) a fusion head runs in that layout
too (:func:`head_to_cpu_layout`: ``layer`` as a target's layer, ``fc`` / ``fc_aux`` / ``lm_head`` as
``kernel_p`` panels), so its few rows per step stream each weight once through the same C++ kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.cpu_layout import (dequantize_q8_0, layer_q8_0, layer_to_cpu_layout, matmul_p, output_major, panels,
                               quantize_q8_0)
from models.llama import (MLP, LlamaConfig, RMSNorm, _Dense, _freeze, _OutProj, _Proj, apply_rope, embedding_rows,
                          fused_qkv, lm_head_logits, rope_inv_freq)

HEAD_METHODS = ("eagle", "eagle3", "mtp", "medusa")
FUSION_METHODS = ("eagle", "eagle3", "mtp")
HEAD_LAYOUTS = ("specjax", "eagle1", "eagle3")
HEAD_ARCHITECTURE = "SpecjaxDraftHead"
INT_PARAMS = ("d2t",)
"""Integer buffers in a head's param tree: never cast, never trained."""


def _default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and last layer (EAGLE-3 fuses three levels of the target)."""
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


def _positive_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer)) and v >= 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """A draft head for one target (static, hashable: a jit static argument)."""

    method: str
    """"eagle", "eagle3", "mtp" or "medusa"."""
    hidden_size: int
    """The head's width D (the target's, unless ``target_hidden_size`` says otherwise)."""
    vocab_size: int
    """The target's vocabulary V (drafts are target ids)."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple[tuple[str, Any], ...]] = None
    """RoPE scaling of the head's layer, as ``LlamaConfig.rope_scaling`` (a dict is frozen)."""
    max_position_embeddings: int = 4096
    aux_layer_ids: tuple[int, ...] = ()
    """EAGLE-3: target layers whose output residual streams are fused (fc_aux), in fc_aux's input order."""
    num_medusa_heads: int = 0
    """Medusa: number of heads (the most drafts per step)."""
    medusa_num_layers: int = 1
    """Medusa: residual SiLU blocks per head."""
    layout: str = "specjax"
    """Fusion heads: "specjax", "eagle1" or "eagle3" (see the module docstring)."""
    draft_vocab_size: Optional[int] = None
    """None: the target's LM head. Vd: the head's own lm_head over Vd tokens, mapped by d2t."""
    own_embedding: bool = False
    """Fusion heads: embed entries with the head's embed_tokens instead of the target's."""
    fc_bias: bool = False
    """A bias on fc (layout eagle1) or fc_aux (layout eagle3)."""
    norm_before_residual: bool = False
    """Layout eagle3: the residual is hidden_norm(feature) instead of the feature."""
    target_hidden_size: Optional[int] = None
    """Layout eagle3: the target's width D_t when it differs from the head's (needs own embedding + LM head)."""

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"method must be one of {list(HEAD_METHODS)}, got {self.method!r}")
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings", "medusa_num_layers"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _freeze(dict(self.rope_scaling)))
            self.layer_config  # noqa: B018 - LlamaConfig validates the scaling, naming what is wrong
        if self.method == "eagle3":
            if len(self.aux_layer_ids) < 1 or any(i < 0 for i in self.aux_layer_ids):
                raise ValueError(f"aux_layer_ids must be non-negative layer indices, got {self.aux_layer_ids!r}")
        elif self.aux_layer_ids:
            raise ValueError(f"aux_layer_ids is only for method='eagle3', got {self.aux_layer_ids!r}")
        if self.method == "medusa":
            if isinstance(self.num_medusa_heads, bool) or self.num_medusa_heads < 1:
                raise ValueError(f"num_medusa_heads must be >= 1 for medusa, got {self.num_medusa_heads!r}")
        elif self.num_medusa_heads:
            raise ValueError(f"num_medusa_heads is only for method='medusa', got {self.num_medusa_heads}")
        elif self.medusa_num_layers != 1:
            raise ValueError(f"medusa_num_layers is only for method='medusa', got {self.medusa_num_layers}")
        if self.layout not in HEAD_LAYOUTS:
            raise ValueError(f"layout must be one of {list(HEAD_LAYOUTS)}, got {self.layout!r}")
        need = {"eagle1": "eagle", "eagle3": "eagle3"}.get(self.layout)
        if need is not None and self.method != need:
            raise ValueError(f"layout={self.layout!r} is for method={need!r}, got method={self.method!r}")
        if self.draft_vocab_size is not None and not (
                _positive_int(self.draft_vocab_size) and self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be None or an int in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size!r}")
        if self.own_embedding and self.method == "medusa":
            raise ValueError("own_embedding is only for fusion heads (Medusa embeds nothing)")
        if self.fc_bias and self.layout == "specjax":
            raise ValueError("fc_bias is only for layout 'eagle1' or 'eagle3'")
        if self.norm_before_residual and self.layout != "eagle3":
            raise ValueError(f"norm_before_residual is only for layout='eagle3', got layout={self.layout!r}")
        if self.target_hidden_size is not None:
            if self.layout != "eagle3" or not _positive_int(self.target_hidden_size):
                raise ValueError(f"target_hidden_size must be a positive int and needs layout='eagle3', got "
                                 f"{self.target_hidden_size!r} with layout={self.layout!r}")
            if self.target_hidden_size != self.hidden_size and not (
                    self.own_embedding and self.draft_vocab_size is not None):
                raise ValueError(f"target_hidden_size={self.target_hidden_size} differs from hidden_size="
                                 f"{self.hidden_size}: the head needs its own embedding and LM head")

    @classmethod
    def for_target(cls, method: str, target: LlamaConfig, **kw) -> "HeadConfig":
        """A head sized for ``target``: its D, vocab, head_dim and RoPE; EAGLE-3 aux layers low/mid/high."""
        if method == "eagle3" and "aux_layer_ids" not in kw:
            kw["aux_layer_ids"] = _default_aux_layers(target.num_hidden_layers)
        if method == "medusa":
            kw.setdefault("num_medusa_heads", 4)
        heads = kw.pop("num_attention_heads", target.num_attention_heads)
        return cls(
            method=method, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
            num_attention_heads=heads, num_key_value_heads=kw.pop("num_key_value_heads", heads),
            head_dim=target.head_dim, intermediate_size=kw.pop("intermediate_size", target.intermediate_size),
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings, **kw,
        )

    @property
    def is_fusion(self) -> bool:
        return self.method in FUSION_METHODS

    @property
    def feature_size(self) -> int:
        """F: width of the target feature one entry takes."""
        if self.method != "eagle3":
            return self.hidden_size
        return (self.target_hidden_size or self.hidden_size) * len(self.aux_layer_ids)

    @property
    def layer_config(self) -> LlamaConfig:
        """The head's one decoder layer, as a LlamaConfig (plain attention: no biases, no qk norm)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    def check_target(self, target: LlamaConfig) -> None:
        """ValueError naming the field when this head cannot run on ``target``."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"draft head vocab_size={self.vocab_size} does not match the target's "
                             f"{target.vocab_size}")
        width = self.target_hidden_size or self.hidden_size
        if width != target.hidden_size:
            name = "target_hidden_size" if self.target_hidden_size else "hidden_size"
            raise ValueError(f"draft head {name}={width} does not match the target's {target.hidden_size}")
        bad = [i for i in self.aux_layer_ids if i >= target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux_layer_ids {bad} are not layers of the target (num_hidden_layers={target.num_hidden_layers})"
            )

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        d["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
        return {"architectures": [HEAD_ARCHITECTURE], **d}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "HeadConfig":
        if HEAD_ARCHITECTURE not in (d.get("architectures") or []):
            raise ValueError(
                f"config.json architectures must include {HEAD_ARCHITECTURE!r}, got {d.get('architectures')}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if k == "aux_layer_ids" else v) for k, v in d.items() if k in names})


# --------------------------------------------------------------------------- modules


def _dense(x: jax.Array, entry: Mapping[str, Any], features: int) -> jax.Array:  # [B, T, I] -> [B, T, O]
    """``x`` through a dense entry: ``kernel [I, O]`` or, in the derived CPU layout, ``kernel_p`` panels of [O, I]
    (``features`` = O); plus ``bias [O]`` if present."""
    if "kernel_p" in entry:
        y = matmul_p(x, entry["kernel_p"], features)
    else:
        y = jnp.einsum("bti,io->bto", x, entry["kernel"].astype(x.dtype))
    return y + entry["bias"].astype(y.dtype) if "bias" in entry else y


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense attention of ``q [B, T, H, E]`` over ``k, v [B, S, G, E]`` where ``mask`` ([T, S] or [B, T, S]).

    The training path of heads (and of the built-in LM): scores in float32, masked entries -1e30 (a row
    with nothing visible averages the values instead of producing NaN).
    """
    b, t, h, e = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, h // g, e)  # [B, T, G, R, E]
    scores = jnp.einsum("btgre,bsge->bgrts", qg, k, preferred_element_type=jnp.float32) * e**-0.5
    mask = mask if mask.ndim == 3 else mask[None]
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, G, R, T, S]
    return jnp.einsum("bgrts,bsge->btgre", probs, v).reshape(b, t, h, e)  # [B, T, H, E]


class _HeadAttention(nn.Module):
    """q/k/v/o projections under the names of ``models.llama.Attention``; q/k/v width follows the input."""

    config: LlamaConfig
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        c, pd = self.config, self.param_dtype
        self.q_proj = _Proj(c.num_attention_heads, c.head_dim, False, pd)
        self.k_proj = _Proj(c.num_key_value_heads, c.head_dim, False, pd)
        self.v_proj = _Proj(c.num_key_value_heads, c.head_dim, False, pd)
        self.o_proj = _OutProj(c.hidden_size, False, pd)

    def qkv(self, x: jax.Array, positions: jax.Array):
        """x [B, T, I] -> RoPE'd q [B, T, H, E], k [B, T, G, E] and v [B, T, G, E]."""
        c = self.config
        if self.has_variable("params", "qkv_proj"):  # derived CPU layout: one product
            q, k, v = fused_qkv(x, self.get_variable("params", "qkv_proj"), c.num_attention_heads,
                                c.num_key_value_heads, c.head_dim)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        inv_freq = rope_inv_freq(c)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, attn: jax.Array) -> jax.Array:  # [B, T, H, E] -> [B, T, D]
        return self.o_proj(attn)


class _HeadLayer(nn.Module):
    """The head's decoder layer, wired per ``HeadConfig.layout`` (param names as ``models.llama.DecoderLayer``)."""

    config: HeadConfig
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        c, pd = self.config, self.param_dtype
        if c.layout != "eagle1":
            self.input_layernorm = RMSNorm(c.rms_norm_eps, pd)
        if c.layout == "eagle3":
            self.hidden_norm = RMSNorm(c.rms_norm_eps, pd)
        self.self_attn = _HeadAttention(c.layer_config, pd)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, pd)
        self.mlp = MLP(c.layer_config, pd)

    def prepare(self, x: jax.Array, feature: Optional[jax.Array] = None):
        """(attention input, residual): x is the fused entry, or (eagle3) the embedding with ``feature``."""
        c = self.config
        if c.layout == "eagle3":
            h = self.hidden_norm(feature)
            residual = h if c.norm_before_residual else feature
            return jnp.concatenate([self.input_layernorm(x), h], axis=-1), residual  # [B, T, 2D], [B, T, D]
        if c.layout == "eagle1":
            return x, x
        return self.input_layernorm(x), x

    def qkv(self, x, positions):
        return self.self_attn.qkv(x, positions)

    def finish(self, residual: jax.Array, attn: jax.Array) -> jax.Array:
        """Residual + o_proj(attn), then the MLP block: the layer output [B, T, D]."""
        x = residual + self.self_attn.out(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class FusionHead(nn.Module):
    """Entries (token embedding, feature) -> head hidden, through the head's one decoder layer.

    ``__call__`` attends through the head's paged KV (the engine); :meth:`dense` attends over explicit keys
    with an explicit mask (training, including training-time test). Both return the layer output before
    ``norm``: what chained drafting feeds back as the next entry's feature.
    """

    config: HeadConfig
    param_dtype: Any = jnp.float32

    def setup(self) -> None:
        c, pd = self.config, self.param_dtype
        if c.method == "mtp":
            self.enorm = RMSNorm(c.rms_norm_eps, pd)
            self.hnorm = RMSNorm(c.rms_norm_eps, pd)
        if c.layout != "eagle3":
            self.fc = _Dense(c.hidden_size, pd, c.fc_bias)  # kernel [2D, D]
        self.layer = _HeadLayer(c, pd)

    def _entries(self, embeds, features, positions):
        """q, k, v and the residual of entries ``embeds, features [B, T, D]`` at ``positions [B, T]``."""
        features = features.astype(embeds.dtype)
        if self.config.layout == "eagle3":
            x, residual = self.layer.prepare(embeds, features)
        else:
            if self.config.method == "mtp":
                embeds, features = self.enorm(embeds), self.hnorm(features)
            x, residual = self.layer.prepare(self.fc(jnp.concatenate([embeds, features], axis=-1)))
        q, k, v = self.layer.qkv(x, positions)
        return q, k, v, residual

    def __call__(self, embeds, features, positions, k_cache, v_cache, attn_metadata, block_size,
                 cpu_layout: bool = False):
        """embeds, features [B, T, D] -> (head hidden [B, T, D] before ``norm``, k_cache, v_cache).

        ``cpu_layout``: the head runs beside a target in ``models.cpu_layout`` (one CPU device), so its
        attention may take the C++ kernel too (``specjax.backends.attention_backend``)."""
        from specjax.attention import paged_attention
        from specjax.kv_cache import write_kv

        q, k, v, residual = self._entries(embeds, features, positions)
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, attn_metadata.slot_mapping)  # write, then read
        attn = paged_attention(q, k_cache, v_cache, positions, attn_metadata.block_tables, block_size=block_size,
                               scale=self.config.head_dim**-0.5, cpu_layout=cpu_layout)  # [B, T, H, E]
        return self.layer.finish(residual, attn), k_cache, v_cache

    def dense(self, embeds, features, positions, past_k, past_v, mask):
        """Dense twin of ``__call__``: the entries attend to ``[past_k; own k]`` where ``mask [T, S]``.

        past_k, past_v [B, S0, G, E] or None; mask covers S = S0 + T keys. Returns (hidden [B, T, D],
        k, v [B, T, G, E] of these entries, for later depths of training-time test).
        """
        q, k, v, residual = self._entries(embeds, features, positions)
        keys = k if past_k is None else jnp.concatenate([past_k, k], axis=1)
        values = v if past_v is None else jnp.concatenate([past_v, v], axis=1)
        return self.layer.finish(residual, masked_attention(q, keys, values, mask)), k, v


def head_to_cpu_layout(params: Mapping[str, Any], config: HeadConfig, *, q8_0: bool = False) -> dict:
    """A fusion head's params in the derived CPU layout of :mod:`models.cpu_layout` (its layer's projections,
    ``fc`` / ``fc_aux`` and a draft-vocabulary ``lm_head`` as panels), for a head beside a target in that
    layout: a verify step's entries then stream each head weight once, narrowed like the target's. Medusa heads
    are returned as given (their blocks keep XLA's dots). ``q8_0``: those panels as Q8_0 blocks multiplied with
    int8 activations (``speculative_config.quantization``; ``models.cpu_layout.quantize_q8_0``)."""
    if not config.is_fusion:
        if q8_0:
            raise ValueError(f"a {config.method} head has no Q8_0 layout (its blocks keep XLA's dots)")
        return dict(params)
    if "qkv_proj" in params["layer"]["self_attn"]:
        raise ValueError("head params are already in the CPU layout")
    layer, blocks = layer_q8_0(params["layer"]) if q8_0 else (params["layer"], None)
    out = {**params, "layer": layer_to_cpu_layout(layer, quantized=blocks, int8_activations=q8_0)}
    for name in ("fc", "fc_aux", "lm_head"):
        if name in params:
            w = output_major(params[name]["kernel"], np.shape(params[name]["kernel"])[0])  # [O, I]
            if q8_0:
                m = quantize_q8_0(w)
                kernel_p = panels(dequantize_q8_0(m), quantized=[m], dot=True)
            else:
                kernel_p = panels(w)
            out[name] = {**{k: v for k, v in params[name].items() if k != "kernel"}, "kernel_p": kernel_p}
    return out


# --------------------------------------------------------------------------- functional API


def combine_hidden_states(params: Mapping[str, Any], features: jax.Array, *, config: HeadConfig) -> jax.Array:
    """Target features [B, T, F] -> the head's feature space [B, T, D] (EAGLE-3's fc_aux; identity otherwise)."""
    if config.method != "eagle3":
        return features
    return _dense(features, params["fc_aux"], config.hidden_size)


def head_embed(params, target_params, tokens: jax.Array, *, config: HeadConfig) -> jax.Array:
    """int tokens [B, T] -> entry embeddings [B, T, D]: the head's own table if it has one, else the target's."""
    if config.own_embedding:
        return embedding_rows(params["embed_tokens"], tokens)
    # The target's may be in the derived CPU layout (rows then in its params' dtype).
    return embedding_rows(target_params["embed_tokens"], tokens, dtype=target_params["norm"]["scale"].dtype)


def _argmax(x: jax.Array) -> jax.Array:
    from specjax.sample.transforms import argmax_last  # the fast first-max argmax on XLA:CPU

    return argmax_last(x)


def _scatter_to_target(logits: jax.Array, d2t: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V], -inf at ids outside the draft vocab."""
    out = jnp.full((*logits.shape[:-1], vocab_size), -jnp.inf, jnp.float32)
    return out.at[..., d2t].set(logits.astype(jnp.float32))


def head_draft_logits(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                      target_config: LlamaConfig) -> jax.Array:
    """float32 logits [B, T, Vd] (Vd = V without a draft vocabulary) of fusion-head hidden [B, T, D]."""
    normed = hidden if config.layout == "eagle1" else RMSNorm(config.rms_norm_eps).apply(
        {"params": params["norm"]}, hidden)
    if config.draft_vocab_size is None:
        return lm_head_logits(target_params, normed, config=target_config)
    if "kernel_p" in params["lm_head"]:  # derived CPU layout: panels of [Vd, D]
        return matmul_p(normed, params["lm_head"]["kernel_p"], config.draft_vocab_size, out_dtype=jnp.float32)
    w = params["lm_head"]["kernel"]  # [D, Vd]
    return jnp.einsum("btd,dv->btv", normed, w.astype(normed.dtype), preferred_element_type=jnp.float32)


def _target_ids(params, idx: jax.Array, config: HeadConfig) -> jax.Array:
    """Draft-vocabulary indices -> int32 target ids (identity without a draft vocabulary)."""
    return idx if config.draft_vocab_size is None else params["d2t"][idx].astype(jnp.int32)


def _target_vocab(params, logits: jax.Array, config: HeadConfig) -> jax.Array:
    """Draft-vocabulary logits -> target-vocabulary logits, -inf at ids outside the draft vocabulary."""
    if config.draft_vocab_size is None:
        return logits
    return _scatter_to_target(logits, params["d2t"], config.vocab_size)


def head_greedy_tokens(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                       target_config: LlamaConfig) -> jax.Array:
    """int32 target ids [B, T]: the head's argmax draft for each hidden [B, T, D] (what greedy drafting takes)."""
    logits = head_draft_logits(params, target_params, hidden, config=config, target_config=target_config)
    return _target_ids(params, _argmax(logits), config)


def head_target_logits(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                       target_config: LlamaConfig) -> jax.Array:
    """float32 logits [B, T, V] over the target's vocabulary (-inf outside a draft vocabulary)."""
    logits = head_draft_logits(params, target_params, hidden, config=config, target_config=target_config)
    return _target_vocab(params, logits, config)


head_hidden_to_logits = head_target_logits
"""The name engines before the draft vocabulary used (same result)."""


def medusa_block_name(head: int, layer: int) -> str:
    return f"blocks_{head}" if layer == 0 else f"blocks_{head}_{layer}"


def medusa_hidden(params, hidden: jax.Array, *, config: HeadConfig) -> jax.Array:
    """Target final hidden [B, D] -> per-head hidden [B, N, D] (stacks of residual SiLU blocks)."""
    out = []
    for i in range(config.num_medusa_heads):
        x = hidden
        for j in range(config.medusa_num_layers):
            p = params[medusa_block_name(i, j)]
            x = x + jax.nn.silu(x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype))
        out.append(x)
    return jnp.stack(out, axis=1)  # [B, N, D]


def medusa_draft_logits(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                        target_config: LlamaConfig) -> jax.Array:
    """float32 logits [B, N, Vd] of every Medusa head from the target's final hidden [B, D]."""
    h = medusa_hidden(params, hidden, config=config)  # [B, N, D]
    if config.draft_vocab_size is None:
        return lm_head_logits(target_params, h, config=target_config)
    w = jnp.stack([params[f"lm_heads_{i}"]["kernel"] for i in range(config.num_medusa_heads)])  # [N, D, Vd]
    return jnp.einsum("bnd,ndv->bnv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def medusa_greedy_tokens(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                         target_config: LlamaConfig) -> jax.Array:
    """int32 target ids [B, N]: each Medusa head's argmax draft."""
    logits = medusa_draft_logits(params, target_params, hidden, config=config, target_config=target_config)
    return _target_ids(params, _argmax(logits), config)


def medusa_target_logits(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                         target_config: LlamaConfig) -> jax.Array:
    """float32 logits [B, N, V] over the target's vocabulary (-inf outside a draft vocabulary)."""
    logits = medusa_draft_logits(params, target_params, hidden, config=config, target_config=target_config)
    return _target_vocab(params, logits, config)


def init_head_params(config: HeadConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random head params: normal(0.02) matrices, unit norms; Medusa blocks start at zero (identity heads).

    A draft vocabulary starts as ``d2t = 0..Vd-1`` (callers set the real map, e.g. the most frequent
    tokens); ``lm_head``/``embed_tokens`` are drawn at random (training copies the target's rows in).
    """
    d = config.hidden_size
    k1, k2, k3, k4 = jax.random.split(key, 4)
    vd = config.draft_vocab_size
    if config.method == "medusa":
        # Zero init: every head starts as the target's own next-token prediction, as Medusa does.
        params = {medusa_block_name(i, j): {"kernel": jnp.zeros((d, d), dtype), "bias": jnp.zeros((d,), dtype)}
                  for i in range(config.num_medusa_heads) for j in range(config.medusa_num_layers)}
        if vd is not None:
            for i, k in enumerate(jax.random.split(k3, config.num_medusa_heads)):
                params[f"lm_heads_{i}"] = {"kernel": 0.02 * jax.random.normal(k, (d, vd), dtype)}
            params["d2t"] = jnp.arange(vd, dtype=jnp.int32)
        return params
    from specjax.kv_cache import AttentionMetadata, KVCache

    cache = KVCache.allocate(num_layers=1, num_blocks=1, block_size=1, num_kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, dtype=dtype)
    x = jnp.zeros((1, 1, d), dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    md = AttentionMetadata(slot_mapping=pos, block_tables=pos)
    params = dict(FusionHead(config, dtype).init(k1, x, x, pos, cache.k[0], cache.v[0], md, 1)["params"])
    if config.layout != "eagle1":
        params["norm"] = {"scale": jnp.ones((d,), dtype)}
    if config.method == "eagle3":
        params["fc_aux"] = {"kernel": 0.02 * jax.random.normal(k2, (config.feature_size, d), dtype)}
        if config.fc_bias:
            params["fc_aux"]["bias"] = jnp.zeros((d,), dtype)
    if vd is not None:
        params["lm_head"] = {"kernel": 0.02 * jax.random.normal(k3, (d, vd), dtype)}
        params["d2t"] = jnp.arange(vd, dtype=jnp.int32)
    if config.own_embedding:
        params["embed_tokens"] = {"embedding": 0.02 * jax.random.normal(k4, (config.vocab_size, d), dtype)}
    return params


def split_trainable(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """(float params to train, integer buffers such as d2t): optimizers and grads see only the first."""
    params = dict(params)
    return {k: v for k, v in params.items() if k not in INT_PARAMS}, {k: params[k] for k in INT_PARAMS
                                                                        if k in params}


def head_num_params(params) -> int:
    """Float parameter scalars of a head (d2t not counted)."""
    return int(sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(split_trainable(params)[0])))


# Files (save / load / check) live in models.head_files; re-exported for callers of this module.
from models.head_files import check_head_params, is_head_dir, load_head, save_head  # noqa: E402,F401
