"""``LlamaConfig``: the static, hashable config of the Llama-family decoder (:mod:`models.llama`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional

import numpy as np

logger = logging.getLogger("models.llama")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Keys each rope type needs in ``rope_scaling`` (besides rope_type).
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _freeze(value: Any) -> Any:
    """Make a JSON-ish value hashable (dict -> sorted tuple of pairs, list -> tuple)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Static, hashable model config (used as a static jit argument).

    ``rope_scaling`` is None (plain RoPE) or a sorted tuple of ``(key, value)``
    pairs that includes ``("rope_type", ...)``; a dict passed in is frozen to that
    form. ``sliding_window`` is stored only: :func:`forward` ignores it.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple[tuple[str, Any], ...]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections."""
    attention_out_bias: bool = False
    """Bias on the o projection (HF Llama/Qwen3 ``attention_bias=True``; never Qwen2)."""
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: Optional[int] = None
    """Stored only; forward attends over the full causal context."""
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # Normalise containers so the config is hashable (static jit arg).
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _freeze(dict(self.rope_scaling)))
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if k not in scaling]
            if missing:
                raise ValueError(f"rope_scaling for rope_type {rope_type!r} is missing {missing}")
            if rope_type in ("linear", "llama3") and not scaling["factor"] > 0:
                raise ValueError(f"rope_scaling factor must be > 0, got {scaling['factor']}")
            if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                raise ValueError("rope_scaling high_freq_factor must be > low_freq_factor")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    # ---------------------------------------------------------------- derived

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else dict(self.rope_scaling)["rope_type"]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # ---------------------------------------------------------------- HF

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Map a Hugging Face ``config.json`` dict (transformers 4.x or 5.x form)."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures {archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads

        # RoPE: 5.x writes `rope_parameters` {rope_theta, rope_type, ...};
        # 4.x writes `rope_theta` + `rope_scaling` {type|rope_type, ...}.
        rope = dict(d.get("rope_parameters") or {})
        if "rope_scaling" in d and d["rope_scaling"]:
            rope = {**dict(d["rope_scaling"]), **rope}
        if "rope_theta" not in rope:
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        rope_theta = float(rope.pop("rope_theta"))
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported")
        rope.pop("partial_rotary_factor", None)
        if rope_type == "default":
            rope_scaling = None
        else:
            rope_scaling = {"rope_type": rope_type, **rope}
            if rope_type == "llama3":
                rope_scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))

        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False  # hard-wired in HF Qwen2, whatever the config says
        elif arch == "MistralForCausalLM":
            qkv_bias, o_bias = False, False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))

        sliding_window = d.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not d.get("use_sliding_window", False):
            sliding_window = None
        if sliding_window is not None:
            logger.warning("sliding_window=%s is stored but not applied by the forward pass", sliding_window)

        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=o_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )
