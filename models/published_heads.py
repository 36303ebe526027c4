"""Draft heads as their authors publish them -> (:class:`models.heads.HeadConfig`, params), at load time.

Detected from ``config.json`` the way vLLM detects them:

* **EAGLE-3** (SafeAILab/EAGLE; ``architectures`` ``LlamaForCausalLMEagle3`` or
  vLLM's ``Eagle3LlamaForCausalLM``): a Llama config of the head (one layer) with
  ``draft_vocab_size``; tensors ``midlayer.*`` (q/k/v take ``2D`` inputs, plus
  ``hidden_norm``), ``fc`` ``[D, 3*D_t]`` over three target hidden states, ``norm``,
  ``lm_head`` ``[Vd, D]``, ``d2t`` (offsets: target id = index + d2t[index]) and
  ``t2d`` (bool mask over the target vocabulary), optionally ``embed_tokens``.
  The fused target layers are ``eagle_config.eagle_aux_hidden_state_layer_ids``
  (else vLLM's default ``(2, L//2, L-3)`` for an ``L``-layer target), counted as
  vLLM counts them: id ``i`` is the residual stream *entering* layer ``i``, i.e.
  specjax's ``aux_layer_ids`` entry ``i - 1`` (the stream after layer ``i - 1``).
* **speculators EAGLE-3** (``speculators_model_type: "eagle3"``): the decoder
  config under ``transformer_layer_config``; tensors ``layers.0.*``, ``fc``
  (optionally with bias), ``norm``, ``lm_head``, ``d2t``, ``t2d``, ``embed_tokens``;
  ``norm_before_residual`` (absent: true, as vLLM reads it).
* **EAGLE-1** (SafeAILab/EAGLE; a one-layer ``LlamaForCausalLM`` config, or vLLM's
  ``EagleLlamaForCausalLM``): ``fc`` ``[D, 2D]`` (+ bias) over ``[embedding;
  feature]``, ``layers.0.*`` without ``input_layernorm``; the target's LM head
  reads the layer output directly. A copied ``embed_tokens`` is ignored (the
  target's is used, as vLLM does).
* **Medusa** (FasterDecoding: config ``medusa_num_heads``, ``medusa_num_layers``;
  ``medusa_lm_head.safetensors`` with ``{i}.{j}.linear.{weight,bias}`` residual
  SiLU blocks and ``{i}.{num_layers}.weight`` per-head LM heads) and vLLM's
  converted ``MedusaModel`` (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``, optional
  ``token_map`` with ``truncated_vocab_size``).

Weights are read from ``*.safetensors``; a ``*.bin`` / ``*.pt`` pickle is read only
when torch is installed (specjax itself does not need it). Anything the
published code would do that specjax does not reproduce is refused by name.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from models.heads import HeadConfig, check_head_params, medusa_block_name
from models.llama import LlamaConfig

logger = logging.getLogger(__name__)

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM")


# --------------------------------------------------------------------------- reading


def _weight_files(path: Path, names: tuple[str, ...] = ()) -> list[Path]:
    for name in names:
        if (path / name).is_file():
            return [path / name]
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin")) or sorted(path.glob("*.pt"))
    if not files:
        raise ValueError(f"draft head directory {str(path)!r} has no *.safetensors (or *.bin / *.pt) weights")
    return files


def _read(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors of ``files`` as numpy (floats as float32, integer/bool buffers as they are)."""
    out: dict[str, np.ndarray] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.numpy import load_file

            out.update(load_file(str(f)))
            continue
        try:
            import torch
        except ImportError as exc:
            raise ValueError(f"{f} is a torch pickle and torch is not installed: convert it to safetensors "
                             f"(safetensors.torch.save_file) or install torch") from exc
        state = torch.load(str(f), map_location="cpu", weights_only=True)
        for k, v in state.items():
            out[k] = (v.float() if v.is_floating_point() else v).numpy()
    return out


def _header_names(path: Path) -> list[str]:
    """Tensor names in the safetensors files of ``path`` (headers only; [] when there are none)."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as fh:
            names.extend(fh.keys())
    return names


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32)


# --------------------------------------------------------------------------- detection


def detect_layout(config: Mapping[str, Any], tensor_names: Optional[list[str]] = None) -> Optional[str]:
    """The published layout of a head config: "eagle3", "speculators_eagle3", "eagle1", "medusa",
    "vllm_medusa", or None when it is not a head this module knows (e.g. a plain draft model).

    EAGLE-1 heads carry an ordinary one-layer Llama config, so they are told apart from a one-layer
    draft model by their tensors (``fc.weight`` and ``layers.0.``); pass ``tensor_names`` for that.
    """
    archs = list(config.get("architectures") or [])
    if config.get("speculators_model_type") is not None:
        return f"speculators_{config['speculators_model_type']}"
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return "eagle3"
    if "medusa_num_heads" in config:
        return "medusa"
    if "MedusaModel" in archs:
        return "vllm_medusa"
    if "EagleLlamaForCausalLM" in archs:
        return "eagle1"
    if "LlamaForCausalLM" in archs and tensor_names is not None:
        names = set(tensor_names)
        if "fc.weight" in names and any(n.startswith("layers.0.") for n in names) and not any(
                n.startswith("model.layers.") for n in names):
            return "eagle1"
    return None


METHOD_OF_LAYOUT = {"eagle3": "eagle3", "speculators_eagle3": "eagle3", "eagle1": "eagle", "medusa": "medusa",
                    "vllm_medusa": "medusa"}


def detect_head_method(path: str | Path) -> Optional[str]:
    """The speculative method of the published head at ``path`` ("eagle3", "eagle", "medusa"), or None."""
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    config = json.loads(cfg.read_text())
    return METHOD_OF_LAYOUT.get(detect_layout(config, _header_names(path)) or "")


# --------------------------------------------------------------------------- conversion helpers


def _llama_part(d: Mapping[str, Any], where: str) -> LlamaConfig:
    """The head's decoder shape from a Llama-style config dict (validated by LlamaConfig, naming fields)."""
    d = dict(d)
    d["architectures"] = ["LlamaForCausalLM"]
    d.setdefault("num_hidden_layers", 1)
    try:
        return LlamaConfig.from_hf_config(d)
    except KeyError as exc:
        raise ValueError(f"{where}: config has no {exc.args[0]!r}") from None


def _head_kw(c: LlamaConfig) -> dict:
    return dict(hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings)


def _linear(w: np.ndarray) -> np.ndarray:  # torch Linear [out, in] -> kernel [in, out]
    return _f32(w).T


def _layer(t: Mapping[str, np.ndarray], prefix: str, c: HeadConfig, where: str) -> dict:
    """A torch Llama decoder layer under ``prefix`` -> the head's ``layer`` params."""
    h, g, e, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size

    def get(name):
        if prefix + name not in t:
            raise ValueError(f"{where}: missing tensor {prefix + name!r}")
        return t[prefix + name]

    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if f"{prefix}self_attn.{proj}.bias" in t:
            raise ValueError(f"{where}: attention biases ({prefix}self_attn.{proj}.bias) are not supported")
    q, k, v = (_linear(get(f"self_attn.{n}_proj.weight")) for n in "qkv")  # [I, H*E], [I, G*E] x2
    layer = {
        "self_attn": {
            "q_proj": {"kernel": q.reshape(q.shape[0], h, e)},
            "k_proj": {"kernel": k.reshape(k.shape[0], g, e)},
            "v_proj": {"kernel": v.reshape(v.shape[0], g, e)},
            "o_proj": {"kernel": _linear(get("self_attn.o_proj.weight")).reshape(h, e, d)},
        },
        "mlp": {n: {"kernel": _linear(get(f"mlp.{n}.weight"))} for n in ("gate_proj", "up_proj", "down_proj")},
        "post_attention_layernorm": {"scale": _f32(get("post_attention_layernorm.weight"))},
    }
    if c.layout != "eagle1":
        layer["input_layernorm"] = {"scale": _f32(get("input_layernorm.weight"))}
    elif prefix + "input_layernorm.weight" in t:
        raise ValueError(f"{where}: an EAGLE-1 head has no input_layernorm, but {prefix}input_layernorm.weight "
                         f"is present")
    if c.layout == "eagle3":
        layer["hidden_norm"] = {"scale": _f32(get("hidden_norm.weight"))}
    return layer


def _vocab_map(t: Mapping[str, np.ndarray], vocab: int, draft_vocab: int, where: str) -> np.ndarray:
    """EAGLE-3's d2t offsets (and t2d mask, when present) -> absolute int32 target ids [Vd]."""
    if "d2t" not in t:
        if draft_vocab != vocab:
            raise ValueError(f"{where}: draft_vocab_size={draft_vocab} < vocab_size={vocab} but there is no d2t")
        return np.arange(vocab, dtype=np.int32)
    offsets = np.asarray(t["d2t"]).astype(np.int64)
    if offsets.shape != (draft_vocab,):
        raise ValueError(f"{where}: d2t has shape {offsets.shape}, expected ({draft_vocab},) (draft_vocab_size)")
    ids = np.arange(draft_vocab, dtype=np.int64) + offsets
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != draft_vocab:
        raise ValueError(f"{where}: d2t offsets map to ids outside [0, {vocab}) or to one id twice")
    if "t2d" in t:
        t2d = np.asarray(t["t2d"]).astype(bool)
        if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not t2d[ids].all():
            raise ValueError(f"{where}: t2d does not mark exactly the target ids d2t maps to")
    return ids.astype(np.int32)


def _strip(t: Mapping[str, np.ndarray], prefixes: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in t.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


# --------------------------------------------------------------------------- per layout


def _aux_ids(published: Optional[list[int]], target_config: Optional[LlamaConfig], where: str) -> tuple[int, ...]:
    """vLLM-counted aux ids (stream entering layer i) -> specjax aux_layer_ids (stream after layer i - 1)."""
    if published is None:
        if target_config is None:
            raise ValueError(f"{where}: the head names no eagle_aux_hidden_state_layer_ids, so its fused target "
                             f"layers are vLLM's default (2, L//2, L-3) of the target: pass target_config")
        n = target_config.num_hidden_layers
        published = [2, n // 2, n - 3]
    ids = [int(i) for i in published]
    if any(i < 1 for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} include the embedding output (0), "
                         f"which specjax's target does not expose")
    return tuple(i - 1 for i in ids)


def _eagle3(config: Mapping[str, Any], t: dict[str, np.ndarray], *, speculators: bool,
            target_config: Optional[LlamaConfig], where: str) -> tuple[HeadConfig, dict]:
    if speculators:
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if config.get(flag):
                raise ValueError(f"{where}: speculators option {flag}=true is not supported")
        layer_cfg = dict(config.get("transformer_layer_config") or {})
        if not layer_cfg:
            raise ValueError(f"{where}: speculators config has no transformer_layer_config")
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        norm_before_residual = bool(config.get("norm_before_residual", True))  # vLLM's reading when absent
        t = _strip(t, ("model.",))
        prefix = "layers.0."
    else:
        layer_cfg = dict(config)
        eagle_cfg = dict(config.get("eagle_config") or {})
        if eagle_cfg.get("use_aux_hidden_state", True) is False:
            raise ValueError(f"{where}: eagle_config.use_aux_hidden_state=false is not supported")
        aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
        norm_before_residual = bool(config.get("norm_before_residual", False))
        prefix = "midlayer."
        if "midlayer.self_attn.q_proj.weight" not in t and "layers.0.self_attn.q_proj.weight" in t:
            prefix = "layers.0."
    layers = layer_cfg.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{where}: num_hidden_layers={layers}; only one-layer EAGLE-3 heads are supported")
    lc = _llama_part({**layer_cfg, "vocab_size": layer_cfg.get("vocab_size", config.get("vocab_size"))}, where)
    vocab = lc.vocab_size
    draft_vocab = int(config.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size") or vocab)
    if "lm_head.weight" not in t:
        raise ValueError(f"{where}: missing tensor 'lm_head.weight'")
    fc = t.get("fc.weight")
    if fc is None:
        raise ValueError(f"{where}: missing tensor 'fc.weight'")
    aux_ids = _aux_ids(aux, target_config, where)
    target_hidden = config.get("target_hidden_size") or layer_cfg.get("target_hidden_size")
    if target_hidden is None and fc.shape[1] != len(aux_ids) * lc.hidden_size:
        target_hidden = fc.shape[1] // len(aux_ids)
    hc = HeadConfig(
        method="eagle3", layout="eagle3", aux_layer_ids=aux_ids, draft_vocab_size=draft_vocab,
        own_embedding="embed_tokens.weight" in t, fc_bias="fc.bias" in t,
        norm_before_residual=norm_before_residual,
        target_hidden_size=None if target_hidden in (None, lc.hidden_size) else int(target_hidden), **_head_kw(lc),
    )
    params = {
        "fc_aux": {"kernel": _linear(fc)},
        "layer": _layer(t, prefix, hc, where),
        "norm": {"scale": _f32(t["norm.weight"]) if "norm.weight" in t else _missing(where, "norm.weight")},
        "lm_head": {"kernel": _linear(t["lm_head.weight"])},
        "d2t": _vocab_map(t, vocab, draft_vocab, where),
    }
    if hc.fc_bias:
        params["fc_aux"]["bias"] = _f32(t["fc.bias"])
    if hc.own_embedding:
        params["embed_tokens"] = {"embedding": _f32(t["embed_tokens.weight"])}
    return hc, params


def _missing(where: str, name: str):
    raise ValueError(f"{where}: missing tensor {name!r}")


def _eagle1(config: Mapping[str, Any], t: dict[str, np.ndarray], where: str) -> tuple[HeadConfig, dict]:
    t = _strip(t, ("model.",))
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{where}: num_hidden_layers={layers}; only one-layer EAGLE-1 heads are supported")
    if config.get("add_para_norm"):
        raise ValueError(f"{where}: add_para_norm=true (HASS) is not supported")
    lc = _llama_part(config, where)
    hc = HeadConfig(method="eagle", layout="eagle1", fc_bias="fc.bias" in t, **_head_kw(lc))
    fc = t.get("fc.weight")
    if fc is None or fc.shape != (lc.hidden_size, 2 * lc.hidden_size):
        raise ValueError(f"{where}: fc.weight must have shape {(lc.hidden_size, 2 * lc.hidden_size)}, got "
                         f"{None if fc is None else fc.shape}")
    params = {"fc": {"kernel": _linear(fc)}, "layer": _layer(t, "layers.0.", hc, where)}
    if hc.fc_bias:
        params["fc"]["bias"] = _f32(t["fc.bias"])
    return hc, params


def _medusa(config: Mapping[str, Any], t: dict[str, np.ndarray], *, vllm: bool,
            where: str) -> tuple[HeadConfig, dict]:
    if vllm:
        n, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
        t = _strip(t, ("medusa_heads.",))
        block = lambda i, j: f"blocks.{i}.layers.{j}."  # noqa: E731
        head = lambda i: f"lm_heads.{i}.weight"  # noqa: E731
        if config.get("original_lm_head"):
            raise ValueError(f"{where}: original_lm_head=true (heads sharing the target's LM head) is not supported")
    else:
        n, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
        block = lambda i, j: f"{i}.{j}.linear."  # noqa: E731
        head = lambda i: f"{i}.{layers}.weight"  # noqa: E731
    if block(0, 0) + "weight" not in t or head(0) not in t:
        raise ValueError(f"{where}: missing Medusa tensors {block(0, 0) + 'weight'!r} / {head(0)!r}")
    d = t[block(0, 0) + "weight"].shape[0]
    lm_rows = t[head(0)].shape[0]
    vocab = int(config.get("vocab_size") or lm_rows)
    params: dict = {}
    for i in range(n):
        for j in range(layers):
            w, b = t.get(block(i, j) + "weight"), t.get(block(i, j) + "bias")
            if w is None:
                raise ValueError(f"{where}: missing tensor {block(i, j) + 'weight'!r}")
            params[medusa_block_name(i, j)] = {"kernel": _linear(w),
                                               "bias": np.zeros((d,), np.float32) if b is None else _f32(b)}
        if head(i) not in t:
            raise ValueError(f"{where}: missing tensor {head(i)!r}")
        params[f"lm_heads_{i}"] = {"kernel": _linear(t[head(i)])}
    if "token_map" in t:
        params["d2t"] = np.asarray(t["token_map"]).astype(np.int32)
    elif lm_rows == vocab:
        params["d2t"] = np.arange(vocab, dtype=np.int32)
    else:
        raise ValueError(f"{where}: the LM heads have {lm_rows} rows but vocab_size={vocab} and no token_map")
    hc = HeadConfig(method="medusa", hidden_size=d, vocab_size=vocab, num_medusa_heads=n, medusa_num_layers=layers,
                    draft_vocab_size=lm_rows)
    return hc, params


# --------------------------------------------------------------------------- entry


def load_published_head(path: str | Path, dtype=np.float32,
                        target_config: Optional[LlamaConfig] = None) -> tuple[HeadConfig, dict]:
    """(HeadConfig, params in specjax's layout) of a head directory in a published layout.

    ``target_config``: needed only for EAGLE-3 heads that name no fused layers (vLLM's default ids are a
    function of the target's depth). ValueError naming what is wrong or unsupported.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    names = _header_names(path)
    layout = detect_layout(config, names or None)
    if layout is None and not names:  # only torch pickles: decide on their tensor names
        layout = detect_layout(config, list(_read(_weight_files(path)).keys()))
    if layout not in METHOD_OF_LAYOUT:
        raise ValueError(f"{str(path)!r} is not a draft head specjax can load: config.json architectures "
                         f"{config.get('architectures')} (expected SpecjaxDraftHead, an EAGLE-3 / EAGLE-1 head, a "
                         f"speculators eagle3 head or a Medusa head)")
    where = str(path)
    if layout in ("medusa", "vllm_medusa"):
        t = _read(_weight_files(path, ("medusa_lm_head.safetensors", "medusa_lm_head.pt")))
        hc, params = _medusa(config, t, vllm=layout == "vllm_medusa", where=where)
    elif layout == "eagle1":
        hc, params = _eagle1(config, _read(_weight_files(path)), where)
    else:
        hc, params = _eagle3(config, _read(_weight_files(path)), speculators=layout == "speculators_eagle3",
                             target_config=target_config, where=where)
    check_head_params(hc, params, where)
    cast = lambda x: x if x.dtype == np.int32 else x.astype(dtype)  # noqa: E731
    params = {k: (cast(v) if not isinstance(v, dict) else _cast_tree(v, cast)) for k, v in params.items()}
    logger.info("loaded %s head from %s (layout %s)", hc.method, where, layout)
    return hc, params


def _cast_tree(tree: dict, cast) -> dict:
    return {k: (_cast_tree(v, cast) if isinstance(v, dict) else cast(np.asarray(v))) for k, v in tree.items()}
