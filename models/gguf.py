"""GGUF file (llama.cpp) -> (LlamaConfig, param pytree), tokenizer and chat template, without torch.

The ``gguf`` package reads the metadata and the tensors (memory-mapped) and
dequantizes them (F32/F16/BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants, ...)
to float32. Tensor names are mapped to Hugging Face names and the result goes
through :func:`models.loading.convert_hf_state_dict`, so a GGUF model gets
exactly the param layout an HF directory gets.

Supported: ``general.architecture`` "llama" (Llama 1-3, Mistral, SmolLM...),
"qwen2" and "qwen3" (dense; MoE refused). llama.cpp's converter reorders the
rows of each Q and K head for the llama architecture (interleaved RoPE pairs);
:func:`_unpermute_rows` undoes that. Llama-3 RoPE scaling arrives as the
``rope_freqs`` tensor (per-frequency divisors) and is accepted only when it is
exactly the ``llama3`` rope type of :mod:`models.llama` for parameters we can
recover; anything else is refused by name, as is any tensor the model would
not use.

Tokenizer: a ``tokenizer.json`` beside the file wins; otherwise a
``tokenizers.Tokenizer`` is built from the metadata for byte-level BPE
vocabularies (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizer named
by ``tokenizer.ggml.pre``. The chat template is ``tokenizer.chat_template``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from models.llama import LlamaConfig, rope_inv_freq

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

GGUF_MAGIC = b"GGUF"

# general.architecture -> the HF architecture whose layout the tensors follow.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Per-layer tensors: GGUF suffix after "blk.N." -> HF suffix after "model.layers.N.".
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# Split regexes of the Llama-3 and Qwen2 byte-level tokenizers (GPT-2's is ByteLevel's own, use_regex=True).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (how text is split before byte-level BPE, BOS added when the file does not say).
# "digits-gpt2" is llama.cpp's starcoder/smollm family: every \p{N} char alone, then GPT-2's split.
_PRE_TOKENIZERS = {
    "default": ("gpt2", False),
    "gpt2": ("gpt2", False),
    "smollm": ("digits-gpt2", False),
    "starcoder": ("digits-gpt2", False),
    "refact": ("digits-gpt2", False),
    "codeshell": ("digits-gpt2", False),
    "llama-bpe": ("llama3", True),
    "llama3": ("llama3", True),
    "llama-v3": ("llama3", True),
    "qwen2": ("qwen2", False),
}


# --------------------------------------------------------------------------- file access


def is_gguf_file(path: PathLike) -> bool:
    """True for an existing regular file that starts with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _reader_class():
    import gguf

    class _Reader(gguf.GGUFReader):
        # GGUFReader parses every metadata string through np.memmap slices, whose per-slice
        # overhead dominates on 50k-200k-token vocabularies; a plain ndarray view of the same
        # mapping parses ~4x faster (SmolLM2: 11 s -> 2.9 s here), and tensors stay memory-mapped.
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = np.asarray(value)

    return _Reader


def _field_value(field) -> Any:
    """A ReaderField as a Python value (str, int, float, bool, or a list of those)."""
    import gguf

    t = field.types
    if not t:
        return None

    def scalar(part, kind):
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        return bool(value) if kind == gguf.GGUFValueType.BOOL else value

    if t[0] == gguf.GGUFValueType.ARRAY:
        if len(t) > 2:
            raise ValueError(f"GGUF field {field.name!r}: nested arrays are not supported")
        kind = t[-1]
        if kind == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        values = [field.parts[i] for i in field.data]
        if not values:
            return []
        flat = np.concatenate([np.asarray(v).reshape(-1) for v in values])
        return [bool(v) for v in flat] if kind == gguf.GGUFValueType.BOOL else flat.tolist()
    return scalar(field.parts[field.data[0]], t[0])


class GGUFFile:
    """An opened GGUF file: metadata by key (decoded on first use) and tensors by name (memory-mapped)."""

    def __init__(self, path: PathLike):
        p = Path(path)
        if not is_gguf_file(p):
            raise ValueError(f"model path {str(p)!r} is not a GGUF file (no 'GGUF' magic)")
        try:
            self._reader = _reader_class()(str(p), "r")
        except Exception as exc:  # noqa: BLE001 - a damaged file is named as such
            raise ValueError(f"cannot read GGUF file {str(p)!r}: {type(exc).__name__}: {exc}") from None
        self.path = p
        self._values: dict[str, Any] = {}
        self.tensors = {t.name: t for t in self._reader.tensors}

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    def __contains__(self, key: object) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._reader.fields:
            return default
        if key not in self._values:
            self._values[key] = _field_value(self._reader.fields[key])
        return self._values[key]

    def require(self, key: str) -> Any:
        if key not in self._reader.fields:
            raise ValueError(f"GGUF file {str(self.path)!r} has no metadata key {key!r}")
        return self.get(key)

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Numpy-order shape ([out, in] for a matrix); GGUF stores the reverse."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def dequantize(self, name: str) -> np.ndarray:
        """float32 copy of tensor ``name`` in numpy order."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        try:
            x = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(
                f"GGUF file {str(self.path)!r}: tensor {name!r} has type "
                f"{GGMLQuantizationType(t.tensor_type).name}, which the gguf package cannot dequantize ({exc})"
            ) from None
        return np.asarray(x, dtype=np.float32).reshape(self.tensor_shape(name))


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: PathLike) -> GGUFFile:
    """Open (or reuse) a GGUF file: model, tokenizer and EOS reads share one parse of the metadata."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        raise ValueError(f"model path {str(path)!r} does not exist") from None
    return _open_cached(str(p), st.st_mtime_ns, st.st_size)


# --------------------------------------------------------------------------- config


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _positive_int(f: GGUFFile, key: str) -> int:
    value = f.require(key)
    if isinstance(value, list):
        raise ValueError(f"GGUF key {key!r} varies per layer ({value[:4]}...); not supported")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GGUF key {key!r} must be a positive int, got {value!r}")
    return value


def _llama3_rope_scaling(f: GGUFFile, base: LlamaConfig) -> dict:
    """Recover llama3 rope params from llama.cpp's ``rope_freqs`` divisors, or refuse."""
    freqs = f.dequantize("rope_freqs.weight").reshape(-1)  # [E/2]
    if freqs.shape != (base.head_dim // 2,):
        raise ValueError(f"GGUF rope_freqs.weight has shape {freqs.shape}, expected ({base.head_dim // 2},)")
    if np.all(freqs == 1.0):
        return {}
    plain = rope_inv_freq(base).astype(np.float64)  # [E/2]
    factor = _f32(freqs.max())
    # Meta's published Llama 3.x values; llama.cpp does not store them, so a match must be exact.
    for low, high, old_len in ((1.0, 4.0, 8192),):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": old_len}
        scaled = rope_inv_freq(dataclasses.replace(base, rope_scaling=scaling)).astype(np.float64)
        if np.allclose(plain / scaled, freqs, rtol=1e-5, atol=0):
            return scaling
    raise ValueError(
        f"GGUF file {str(f.path)!r}: rope_freqs.weight (per-frequency RoPE divisors, max {factor:g}) does not "
        "match llama3 rope scaling with low_freq_factor=1, high_freq_factor=4, "
        "original_max_position_embeddings=8192; other frequency tables are not supported"
    )


def config_from_gguf(f: GGUFFile) -> LlamaConfig:
    """Map GGUF metadata (and tensor presence) to a :class:`LlamaConfig`."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(f.path)!r}: general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    if (f.get(f"{arch}.expert_count") or 0) > 0:
        raise ValueError(f"GGUF file {str(f.path)!r}: mixture-of-experts models ({arch}.expert_count) are not supported")
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    hidden = _positive_int(f, k("embedding_length"))
    heads = _positive_int(f, k("attention.head_count"))
    kv_heads = _positive_int(f, k("attention.head_count_kv")) if k("attention.head_count_kv") in f else heads
    head_dim = _positive_int(f, k("attention.key_length")) if k("attention.key_length") in f else hidden // heads
    value_dim = f.get(k("attention.value_length"), head_dim)
    if value_dim != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length={value_dim} differs from key_length={head_dim}; not supported")
    rot = f.get(k("rope.dimension_count"), head_dim)
    if rot != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count={rot} < head_dim={head_dim} (partial RoPE) is not supported")
    if "token_embd.weight" not in f.tensors:
        raise ValueError(f"GGUF file {str(f.path)!r} has no token_embd.weight tensor")
    vocab, embed_dim = f.tensor_shape("token_embd.weight")
    if embed_dim != hidden:
        raise ValueError(f"GGUF token_embd.weight has width {embed_dim}, but {arch}.embedding_length={hidden}")
    meta_vocab = f.get(k("vocab_size"))
    if meta_vocab is not None and meta_vocab != vocab:
        raise ValueError(f"GGUF {arch}.vocab_size={meta_vocab} but token_embd.weight has {vocab} rows")

    rope_scaling: Optional[dict] = None
    scaling_type = f.get(k("rope.scaling.type"), "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(f.require(k("rope.scaling.factor")))}
    elif scaling_type != "none":
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported (supported: none, linear)")
    if f.get(k("rope.scaling.factor")) not in (None, 0.0, 1.0) and rope_scaling is None:
        raise ValueError(f"GGUF {arch}.rope.scaling.factor is set without a supported rope.scaling.type")

    def has(suffix: str) -> bool:
        return f"blk.0.{suffix}" in f.tensors

    if arch == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias, o_bias = has("attn_q.bias"), has("attn_output.bias")
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = f.get("tokenizer.ggml.eos_token_id")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_positive_int(f, k("feed_forward_length")),
        num_hidden_layers=_positive_int(f, k("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(f.require(k("attention.layer_norm_rms_epsilon"))),
        rope_theta=_f32(f.get(k("rope.freq_base"), 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias=qkv_bias,
        attention_out_bias=o_bias,
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(f.get(k("context_length"), 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=ARCHITECTURES[arch],
    )
    if "rope_freqs.weight" in f.tensors:
        if rope_scaling is not None:
            raise ValueError("GGUF file has both rope_freqs.weight and rope.scaling.type; not supported")
        scaling = _llama3_rope_scaling(f, config)
        if scaling:
            config = dataclasses.replace(config, rope_scaling=scaling)
    return config


# --------------------------------------------------------------------------- tensors


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for the llama architecture.

    HF keeps each head's rows as [first halves of the rotary pairs; second halves]
    (rotate-half RoPE); llama.cpp's converter interleaves them (pair i at rows 2i,
    2i+1) for its interleaved RoPE. Rows of ``w: [H*E, ...]`` (weight or bias) go
    back from [H, E/2, 2] to [H, 2, E/2].
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _HFView(Mapping):
    """The GGUF tensors under HF names, dequantized (and un-permuted) one at a time on access.

    ``convert_hf_state_dict`` reads each tensor once, so peak memory is the
    converted params plus one float32 tensor. ``used`` records what was read.
    """

    def __init__(self, f: GGUFFile, config: LlamaConfig, permute_qk: bool):
        self._f = f
        self._config = config
        self._permute_qk = permute_qk
        self._names: dict[str, str] = {}  # HF name -> GGUF name
        for name in f.tensors:
            hf = self._hf_name(name)
            if hf is not None:
                self._names[hf] = name
        self.used: set[str] = set()

    @staticmethod
    def _hf_name(name: str) -> Optional[str]:
        if name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[name]
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
        return None

    def __contains__(self, hf_name: object) -> bool:
        return hf_name in self._names

    def __getitem__(self, hf_name: str) -> np.ndarray:
        name = self._names[hf_name]
        self.used.add(name)
        x = self._f.dequantize(name)
        if self._permute_qk:
            if ".attn_q." in name:
                x = _unpermute_rows(x, self._config.num_attention_heads)
            elif ".attn_k." in name:
                x = _unpermute_rows(x, self._config.num_key_value_heads)
        return x

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def load_gguf_model(path: PathLike, dtype: Any = np.float32) -> tuple[LlamaConfig, dict]:
    """``(config, numpy params)`` from a GGUF file, in :mod:`models.llama`'s layout, cast to ``dtype``."""
    from models.loading import convert_hf_state_dict

    f = open_gguf(path)
    config = config_from_gguf(f)
    view = _HFView(f, config, permute_qk=f.architecture == "llama")
    params = convert_hf_state_dict(view, config, dtype=dtype, path=str(f.path))
    ignorable = {"rope_freqs.weight"} | ({"output.weight"} if config.tie_word_embeddings else set())
    unused = sorted(set(f.tensors) - view.used - ignorable)
    if unused:
        raise ValueError(
            f"GGUF file {str(f.path)!r} has tensors a {config.architecture} does not use "
            f"(unsupported variant): {unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    return config, params


# --------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits-gpt2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[kind]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def tokenizer_from_gguf(path: PathLike):
    """``tokenizers.Tokenizer`` for a GGUF model: ``tokenizer.json`` beside the file, else built from metadata.

    Returns None when the file carries no tokenizer (like an HF directory without tokenizer.json).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    p = Path(path)
    beside = p.parent / "tokenizer.json"
    if beside.is_file():
        logger.info("tokenizer for %s: %s", p.name, beside)
        return Tokenizer.from_file(str(beside))
    f = open_gguf(p)
    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ValueError(
            f"GGUF file {str(p)!r}: tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            f"put the model's tokenizer.json beside the file"
        )
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF file {str(p)!r}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}); put the model's tokenizer.json beside the file"
        )
    split_kind, default_bos = _PRE_TOKENIZERS[pre]
    tokens = f.require("tokenizer.ggml.tokens")
    merges = f.require("tokenizer.ggml.merges")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated spelling keeps its first id, as llama.cpp's lookup does
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"GGUF tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=split_kind == "llama3"))
    tok.pre_tokenizer = _pre_tokenizer(split_kind)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise ValueError(f"GGUF tokenizer: added tokens changed the vocabulary size ({len(vocab)} ids)")

    def special(key: str, add_key: str, default: bool) -> Optional[tuple[str, int]]:
        tid = f.get(key)
        if not f.get(add_key, default) or tid is None:
            return None
        return tokens[tid], int(tid)

    bos = special("tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", default_bos)
    eos = special("tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_eos_token", False)
    if bos or eos:
        single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
        pair = single + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=[s for s in (bos, eos) if s]
        )
    return tok


def gguf_generation_eos(path: PathLike) -> tuple[int, ...]:
    """llama.cpp's end-of-generation ids: ``eos_token_id`` plus ``eot``/``eom`` ids when the file names them."""
    f = open_gguf(path)
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tid = f.get(key)
        if tid is not None and int(tid) not in ids:
            ids.append(int(tid))
    return tuple(ids)


def gguf_chat_template(path: PathLike) -> Optional[str]:
    """``tokenizer.chat_template`` from the metadata, or None."""
    return open_gguf(path).get("tokenizer.chat_template")


__all__ = [
    "ARCHITECTURES",
    "GGUFFile",
    "config_from_gguf",
    "gguf_chat_template",
    "gguf_generation_eos",
    "is_gguf_file",
    "load_gguf_model",
    "open_gguf",
    "tokenizer_from_gguf",
]
