"""Model files -> (LlamaConfig, param pytree), tokenizer, EOS ids and chat template, without torch.

:func:`load_model`, :func:`load_tokenizer`, :func:`read_generation_eos` and
:func:`read_chat_template` take either a Hugging Face directory or a GGUF file
(:mod:`models.gguf`), so callers never branch on the format.

For HF directories: reads ``config.json`` and ``*.safetensors`` (single file or sharded with
``model.safetensors.index.json``; fp32/fp16/bf16 files) with numpy, converts
HF ``[out, in]`` Linear weights into the layout documented in
:mod:`models.llama`, casts to the requested dtype and puts the result on the
default device.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.llama import LlamaConfig

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _check_dir(path: PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        if p.suffix.lower() == ".gguf" and not p.exists():
            raise ValueError(f"model path {str(p)!r}: GGUF file does not exist")
        raise ValueError(f"model path {str(p)!r} is not a directory (nor a GGUF file)")
    return p


def _is_gguf(path: PathLike) -> bool:
    from models.gguf import is_gguf_file

    return is_gguf_file(path)


def read_hf_config(path: PathLike) -> dict:
    p = _check_dir(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ValueError(f"no config.json in model directory {str(p)!r}")
    with open(cfg) as f:
        return json.load(f)


def _safetensors_files(p: Path) -> list[Path]:
    index = p / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({p / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shard files that do not exist: {missing}")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {str(p)!r}")
    return files


def _read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                try:
                    tensors[name] = f.get_tensor(name)
                except (TypeError, ValueError):
                    # Older safetensors cannot hand bf16 to numpy; go through jax instead.
                    with safe_open(str(file), framework="flax") as fj:
                        tensors[name] = np.asarray(fj.get_tensor(name))
    return tensors


def convert_hf_state_dict(
    tensors: dict[str, np.ndarray], config: LlamaConfig, *, dtype: Any = np.float32, path: str = "<tensors>"
) -> dict:
    """HF tensor names/layouts -> nested numpy param dict (see :mod:`models.llama`)."""
    c = config
    d, h, g, e = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def get(name: str, shape: tuple[int, ...], fn: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"checkpoint {path!r} is missing tensor {name!r}")
        x = np.asarray(tensors[name])
        if x.shape != shape:
            raise ValueError(f"checkpoint {path!r}: tensor {name!r} has shape {x.shape}, expected {shape}")
        # Transpose in float32: exact for fp32/bf16/fp16 sources, then one rounding to dtype.
        return np.ascontiguousarray(fn(x.astype(np.float32))).astype(dtype)

    def linear(name: str, out_dim: int, in_dim: int) -> np.ndarray:
        return get(f"{name}.weight", (out_dim, in_dim), lambda w: w.T)  # [in, out]

    params: dict[str, Any] = {
        "embed_tokens": {"embedding": get("model.embed_tokens.weight", (c.vocab_size, d))},
        "norm": {"scale": get("model.norm.weight", (d,))},
    }
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        attn: dict[str, Any] = {
            "q_proj": {"kernel": linear(f"{pre}.self_attn.q_proj", h * e, d).reshape(d, h, e)},
            "k_proj": {"kernel": linear(f"{pre}.self_attn.k_proj", g * e, d).reshape(d, g, e)},
            "v_proj": {"kernel": linear(f"{pre}.self_attn.v_proj", g * e, d).reshape(d, g, e)},
            "o_proj": {"kernel": linear(f"{pre}.self_attn.o_proj", d, h * e).reshape(h, e, d)},
        }
        if c.attention_bias:
            for name, n in (("q_proj", h), ("k_proj", g), ("v_proj", g)):
                attn[name]["bias"] = get(f"{pre}.self_attn.{name}.bias", (n * e,)).reshape(n, e)
        if c.attention_out_bias:
            attn["o_proj"]["bias"] = get(f"{pre}.self_attn.o_proj.bias", (d,))
        if c.qk_norm:
            attn["q_norm"] = {"scale": get(f"{pre}.self_attn.q_norm.weight", (e,))}
            attn["k_norm"] = {"scale": get(f"{pre}.self_attn.k_norm.weight", (e,))}
        params[f"layers_{i}"] = {
            "input_layernorm": {"scale": get(f"{pre}.input_layernorm.weight", (d,))},
            "post_attention_layernorm": {"scale": get(f"{pre}.post_attention_layernorm.weight", (d,))},
            "self_attn": attn,
            "mlp": {
                "gate_proj": {"kernel": linear(f"{pre}.mlp.gate_proj", c.intermediate_size, d)},
                "up_proj": {"kernel": linear(f"{pre}.mlp.up_proj", c.intermediate_size, d)},
                "down_proj": {"kernel": linear(f"{pre}.mlp.down_proj", d, c.intermediate_size)},
            },
        }
    if not c.tie_word_embeddings:  # tied checkpoints may or may not store lm_head; it is ignored then
        params["lm_head"] = {"kernel": linear("lm_head", c.vocab_size, d)}
    return params


def _validate_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    for name, t in _DTYPES.items():
        if np_dtype == np.dtype(t):
            return t
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def load_model(path: PathLike, dtype: Any = "float32") -> tuple[LlamaConfig, dict]:
    """Load a model as ``(config, params)`` from an HF Llama/Mistral/Qwen2/Qwen3 directory or a GGUF file.

    ``dtype``: "float32" or "bfloat16" (or the equivalent numpy/jnp dtype); GGUF
    tensors are dequantized to float32 first, then cast.
    """
    np_dtype = _validate_dtype(dtype)
    if _is_gguf(path):
        from models.gguf import load_gguf_model

        config, params = load_gguf_model(path, dtype=np_dtype)
        source = "GGUF"
    else:
        p = _check_dir(path)
        config = LlamaConfig.from_hf_config(read_hf_config(p))
        tensors = _read_tensors(_safetensors_files(p))
        params = convert_hf_state_dict(tensors, config, dtype=np_dtype, path=str(p))
        del tensors
        source = "HF"
    params = jax.tree_util.tree_map(jnp.asarray, params)
    logger.info("loaded %s from %s %s (%s)", config.architecture, source, path, np.dtype(np_dtype).name)
    return config, params


def load_blocks(path: PathLike):
    """The quantized blocks of a GGUF model file (``models.gguf_blocks.gguf_blocks``: lazy, for the CPU layout's
    quantized panels), or None for an HF directory."""
    if _is_gguf(path):
        from models.gguf_blocks import gguf_blocks

        return gguf_blocks(path)
    return None


def load_hf_model(path: PathLike, dtype: Any = "float32") -> tuple[LlamaConfig, dict]:
    """Same as :func:`load_model` (kept for existing callers; a GGUF file path works here too)."""
    return load_model(path, dtype)


def load_tokenizer(path: PathLike):
    """``tokenizers.Tokenizer`` from ``tokenizer.json`` if the directory has one, else None.

    For a GGUF file: ``tokenizer.json`` beside it, else the tokenizer its metadata describes (None if none).
    """
    if _is_gguf(path):
        from models.gguf import tokenizer_from_gguf

        return tokenizer_from_gguf(path)
    p = _check_dir(path)
    file = p / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def read_generation_eos(path: PathLike, config: Optional[LlamaConfig] = None) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` when it names any, else ``config.eos_token_ids``.

    For a GGUF file: the metadata's eos id plus its eot/eom ids (llama.cpp's end-of-generation set), else
    ``config.eos_token_ids``.
    """
    if _is_gguf(path):
        from models.gguf import gguf_generation_eos

        ids = gguf_generation_eos(path)
        if ids:
            return ids
        return tuple(config.eos_token_ids) if config is not None else ()
    p = _check_dir(path)
    file = p / "generation_config.json"
    if file.is_file():
        with open(file) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if config is None:
        config = LlamaConfig.from_hf_config(read_hf_config(p))
    return tuple(config.eos_token_ids)


def read_chat_template(path: PathLike) -> Optional[str]:
    """The model's Jinja chat template, or None if it has none.

    HF directory: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or the
    entry named "default" of a list of ``{name, template}``). GGUF file: ``tokenizer.chat_template``.
    """
    if _is_gguf(path):
        from models.gguf import gguf_chat_template

        return gguf_chat_template(path)
    p = _check_dir(path)
    jinja = p / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = p / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    with open(cfg, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{cfg}: chat_template must be a string or a list of {{name, template}}")
    return template
