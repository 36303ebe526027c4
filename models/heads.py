"""Draft heads that read the target's own hidden states: EAGLE, EAGLE-3, MTP and Medusa.

All four reuse the target's token embedding and LM head (only their own small
weights are trained and shipped). Letters as in :mod:`models.llama`, plus
``F`` = feature width (``D``, or ``A*D`` for EAGLE-3's ``A`` fused layers).

* **EAGLE** (Li et al. 2024) / **MTP** (DeepSeek-V3): entry ``p`` of the head is
  ``fc([embed(x_{p+1}); feature_p])`` -> one decoder layer with its own paged KV
  -> ``norm`` -> target LM head, predicting ``x_{p+2}``. Chained drafting feeds
  the layer's own output back as the next entry's feature. MTP normalises both
  inputs first (``enorm``, ``hnorm``); EAGLE does not, and is trained to regress
  the target's next feature as well.
* **EAGLE-3**: the feature of a target entry is ``fc_aux`` over the residual
  streams of ``aux_layer_ids`` (low / mid / high layers), concatenated; chained
  entries feed the layer output as for EAGLE. Trained with training-time test.
* **Medusa** (Cai et al. 2024): ``num_medusa_heads`` residual SiLU blocks on the
  target's final hidden state; block ``i`` predicts ``x_{p+i+2}`` from ``h_p``
  (the target itself predicts ``x_{p+1}``), all K drafts from one evaluation.

Param trees (``kernel`` layouts as in models/llama.py)::

    fusion heads: fc.kernel [2D, D]; fc_aux.kernel [A*D, D] (eagle3); enorm/hnorm.scale [D] (mtp);
                  layer.* (one models.llama.DecoderLayer); norm.scale [D]
    medusa:       blocks_i.kernel [D, D], blocks_i.bias [D] for i < num_medusa_heads
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.llama import DecoderLayer, LlamaConfig, RMSNorm

HEAD_METHODS = ("eagle", "eagle3", "mtp", "medusa")
FUSION_METHODS = ("eagle", "eagle3", "mtp")
HEAD_ARCHITECTURE = "SpecjaxDraftHead"


def _default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and last layer (EAGLE-3 fuses three levels of the target)."""
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """A draft head for one target (static, hashable: a jit static argument)."""

    method: str
    """"eagle", "eagle3", "mtp" or "medusa"."""
    hidden_size: int
    """The target's hidden size D (the head works in the target's feature space)."""
    vocab_size: int
    """The target's vocabulary (the head reuses its embedding and LM head)."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    aux_layer_ids: tuple[int, ...] = ()
    """EAGLE-3: target layers whose output residual streams are fused (fc_aux)."""
    num_medusa_heads: int = 0
    """Medusa: number of heads (the most drafts per step)."""

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"method must be one of {list(HEAD_METHODS)}, got {self.method!r}")
        for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
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
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings, **kw,
        )

    @property
    def is_fusion(self) -> bool:
        return self.method in FUSION_METHODS

    @property
    def feature_size(self) -> int:
        """F: width of the target feature one entry takes."""
        return self.hidden_size * (len(self.aux_layer_ids) if self.method == "eagle3" else 1)

    @property
    def layer_config(self) -> LlamaConfig:
        """The head's one decoder layer, as a LlamaConfig (plain attention: no biases, no qk norm)."""
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
        )

    def check_target(self, target: LlamaConfig) -> None:
        """ValueError naming the field when this head cannot run on ``target``."""
        for name in ("hidden_size", "vocab_size"):
            if getattr(self, name) != getattr(target, name):
                raise ValueError(
                    f"draft head {name}={getattr(self, name)} does not match the target's {getattr(target, name)}"
                )
        bad = [i for i in self.aux_layer_ids if i >= target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux_layer_ids {bad} are not layers of the target (num_hidden_layers={target.num_hidden_layers})"
            )

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
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


def _dense(x: jax.Array, kernel: jax.Array) -> jax.Array:  # [B, T, I] x [I, O] -> [B, T, O]
    return jnp.einsum("bti,io->bto", x, kernel.astype(x.dtype))


class FusionHead(nn.Module):
    """Entry features -> head hidden: ``fc([embed; feature])`` then one decoder layer over the head's paged KV."""

    config: HeadConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, embeds, features, positions, k_cache, v_cache, attn_metadata, block_size):
        """embeds, features [B, T, D] -> (head hidden [B, T, D] before ``norm``, k_cache, v_cache)."""
        c, pd = self.config, self.param_dtype
        if c.method == "mtp":
            embeds = RMSNorm(c.rms_norm_eps, pd, name="enorm")(embeds)
            features = RMSNorm(c.rms_norm_eps, pd, name="hnorm")(features)
        fc = nn.Dense(c.hidden_size, use_bias=False, kernel_init=nn.initializers.normal(0.02), param_dtype=pd,
                      name="fc")  # kernel [2D, D]
        x = fc(jnp.concatenate([embeds, features.astype(embeds.dtype)], axis=-1))  # [B, T, D]
        return DecoderLayer(c.layer_config, pd, name="layer")(x, positions, k_cache, v_cache, attn_metadata,
                                                              block_size)


def combine_hidden_states(params: Mapping[str, Any], features: jax.Array, *, config: HeadConfig) -> jax.Array:
    """Target features [B, T, F] -> the head's feature space [B, T, D] (EAGLE-3's fc_aux; identity otherwise)."""
    if config.method == "eagle3":
        return _dense(features, params["fc_aux"]["kernel"])
    return features


def head_hidden_to_logits(params, target_params, hidden: jax.Array, *, config: HeadConfig,
                          target_config: LlamaConfig) -> jax.Array:
    """float32 logits [B, T, V] of fusion-head hidden [B, T, D]: the head's norm, then the target's LM head."""
    from models.llama import lm_head_logits

    normed = RMSNorm(config.rms_norm_eps).apply({"params": params["norm"]}, hidden)
    return lm_head_logits(target_params, normed, config=target_config)


def medusa_hidden(params, hidden: jax.Array, *, config: HeadConfig) -> jax.Array:
    """Target final hidden [B, D] -> per-head hidden [B, N, D] (residual SiLU blocks), fed to the LM head."""
    out = []
    for i in range(config.num_medusa_heads):
        p = params[f"blocks_{i}"]
        out.append(hidden + jax.nn.silu(hidden @ p["kernel"].astype(hidden.dtype) + p["bias"].astype(hidden.dtype)))
    return jnp.stack(out, axis=1)  # [B, N, D]


def init_head_params(config: HeadConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random head params: normal(0.02) matrices, unit norms; Medusa blocks start at zero (identity heads)."""
    d = config.hidden_size
    if config.method == "medusa":
        # Zero init: every head starts as the target's own next-token prediction, as Medusa does.
        return {f"blocks_{i}": {"kernel": jnp.zeros((d, d), dtype), "bias": jnp.zeros((d,), dtype)}
                for i in range(config.num_medusa_heads)}
    from specjax.kv_cache import AttentionMetadata, KVCache

    cache = KVCache.allocate(num_layers=1, num_blocks=1, block_size=1, num_kv_heads=config.num_key_value_heads,
                             head_dim=config.head_dim, dtype=dtype)
    x = jnp.zeros((1, 1, d), dtype)
    pos = jnp.zeros((1, 1), jnp.int32)
    md = AttentionMetadata(slot_mapping=pos, block_tables=pos)
    k1, k2 = jax.random.split(key)
    params = dict(FusionHead(config, dtype).init(k1, x, x, pos, cache.k[0], cache.v[0], md, 1)["params"])
    params["norm"] = {"scale": jnp.ones((d,), dtype)}
    if config.method == "eagle3":
        params["fc_aux"] = {"kernel": 0.02 * jax.random.normal(k2, (config.feature_size, d), dtype)}
    return params


# --------------------------------------------------------------------------- files


def _flatten(tree: Mapping[str, Any], leaf=np.asarray, prefix: str = "") -> dict[str, Any]:
    """Dotted names -> ``leaf(value)`` of a nested param dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, leaf, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = leaf(v)
    return out


def _unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, v in flat.items():
        node = tree
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def save_head(path: str | Path, config: HeadConfig, params, *, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` (dotted param names) to directory ``path``."""
    import ml_dtypes
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    np_dtype = dtypes[dtype]
    flat = {k: np.asarray(v, np.float32).astype(np_dtype) for k, v in _flatten(jax.device_get(params)).items()}
    save_file(flat, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config.to_json(), "torch_dtype": dtype}, indent=2) + "\n")
    return path


def is_head_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and HEAD_ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])


def load_head(path: str | Path, dtype=np.float32) -> tuple[HeadConfig, dict]:
    """(HeadConfig, params) from a directory written by :func:`save_head`; ValueError naming what is wrong."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"draft head directory {str(path)!r} has no config.json")
    config = HeadConfig.from_json(json.loads((path / "config.json").read_text()))
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"draft head directory {str(path)!r} has no model.safetensors")
    flat = {k: np.asarray(v, np.float32).astype(dtype) for k, v in load_file(str(weights)).items()}
    params = _unflatten(flat)
    expected = jax.eval_shape(lambda: init_head_params(config, jax.random.key(0)))
    want = _flatten(expected, lambda v: tuple(v.shape))
    got = {k: v.shape for k, v in flat.items()}
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"{weights}: params do not match config.json (missing {missing}, unexpected {extra}, "
                         f"wrong shapes {wrong})")
    return config, params
