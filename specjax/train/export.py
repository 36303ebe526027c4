"""Param pytree (``models.llama`` layout) -> Hugging Face Llama directory.

The exact inverse of ``models.loading.convert_hf_state_dict``: kernels
``[in, out]`` (or ``[D, N, E]`` / ``[H, E, D]``) become HF Linear weights
``[out, in]``. Writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (bf16 by default) and copies the tokenizer files, so the
directory loads in ``transformers.AutoModelForCausalLM`` and in
``models.loading.load_hf_model`` alike. No torch needed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

import ml_dtypes
import numpy as np

from models.llama import LlamaConfig

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def hf_config_dict(config: LlamaConfig, *, dtype: str = "bfloat16") -> dict:
    """``config.json`` contents; writes RoPE both the 4.x way and the 5.x way so either transformers reads it."""
    if config.architecture != "LlamaForCausalLM" or config.qk_norm or config.attention_bias:
        raise ValueError(f"export supports plain Llama configs only, got {config.architecture} "
                         f"(qk_norm={config.qk_norm}, attention_bias={config.attention_bias})")
    if config.rope_scaling is not None:
        raise ValueError("export supports rope_scaling=None only")
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": eos[0] if eos else None,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def to_hf_state_dict(params: Mapping[str, Any], config: LlamaConfig, *, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """HF tensor name -> contiguous numpy array in ``dtype`` (inverse of ``convert_hf_state_dict``)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    np_dtype = _DTYPES[dtype]
    c = config
    d, h, g, e = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def arr(x) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def put(name: str, x: np.ndarray) -> None:
        out[name] = np.ascontiguousarray(x).astype(np_dtype)

    out: dict[str, np.ndarray] = {}
    put("model.embed_tokens.weight", arr(params["embed_tokens"]["embedding"]))  # [V, D]
    put("model.norm.weight", arr(params["norm"]["scale"]))  # [D]
    for i in range(c.num_hidden_layers):
        lp, pre = params[f"layers_{i}"], f"model.layers.{i}"
        a = lp["self_attn"]
        put(f"{pre}.self_attn.q_proj.weight", arr(a["q_proj"]["kernel"]).reshape(d, h * e).T)  # [H*E, D]
        put(f"{pre}.self_attn.k_proj.weight", arr(a["k_proj"]["kernel"]).reshape(d, g * e).T)  # [G*E, D]
        put(f"{pre}.self_attn.v_proj.weight", arr(a["v_proj"]["kernel"]).reshape(d, g * e).T)  # [G*E, D]
        put(f"{pre}.self_attn.o_proj.weight", arr(a["o_proj"]["kernel"]).reshape(h * e, d).T)  # [D, H*E]
        put(f"{pre}.input_layernorm.weight", arr(lp["input_layernorm"]["scale"]))
        put(f"{pre}.post_attention_layernorm.weight", arr(lp["post_attention_layernorm"]["scale"]))
        for name in ("gate_proj", "up_proj", "down_proj"):
            put(f"{pre}.mlp.{name}.weight", arr(lp["mlp"][name]["kernel"]).T)  # [out, in]
    if not c.tie_word_embeddings:
        put("lm_head.weight", arr(params["lm_head"]["kernel"]).T)  # [V, D]
    return out


def export_hf(params: Mapping[str, Any], config: LlamaConfig, out_dir: str | os.PathLike, *,
              tokenizer_dir: Optional[str | os.PathLike] = None, dtype: str = "bfloat16",
              max_new_tokens: int = 256) -> Path:
    """Write a complete HF model directory; returns its path."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_state_dict(params, config, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(config, dtype=dtype), indent=2) + "\n")
    eos = list(config.eos_token_ids)
    gen = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": eos[0] if eos else None,
        "do_sample": False,
        "max_new_tokens": max_new_tokens,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
                shutil.copyfile(src / name, out / name)
    size = sum(t.nbytes for t in tensors.values())
    logger.info("exported %d tensors (%.1f MB, %s) to %s", len(tensors), size / 1e6, dtype, out)
    return out
