"""A GGUF file's quantized blocks for the CPU panel kernel (``models.cpu_layout``'s quantized panels).

:func:`gguf_blocks` maps a GGUF model's Q4_0 / Q4_1 / Q8_0 matrices, under ``models.cpu_layout.to_cpu_layout``'s
``quantized`` keys, to :class:`~models.cpu_layout.QuantizedMatrix` blocks read from the file (the float32 params
come from :mod:`models.gguf` as before; the layout keeps the blocks only where they give those values exactly).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Optional

import numpy as np

from models.cpu_layout import QuantizedMatrix
from models.gguf import GGUFFile, PathLike, _HFView, _unpermute_rows, config_from_gguf, open_gguf
from models.llama import LlamaConfig


def blocks_from_raw(raw: Any, tensor_type: Any, shape: tuple[int, ...]) -> Optional[QuantizedMatrix]:
    """A GGUF tensor's raw bytes (``[N, bytes per row]``) of an ``[N, K]`` matrix -> its blocks, for Q4_0, Q4_1 and
    Q8_0 (the types the CPU panel kernel reads); None for any other type.

    Q4_0 (``d * (q - 8)``) becomes Q4_1 with ``m = -8 d``: ``d * q`` and ``8 d`` are exact in float32 and so is their
    difference ``d * (q - 8)``, so the kernel's ``d * q + m`` is the package's value (None if ``8 d`` overflows
    float16)."""
    from gguf import GGMLQuantizationType as T

    if tensor_type not in (T.Q4_0, T.Q4_1, T.Q8_0) or len(shape) != 2 or shape[1] % 32:
        return None
    raw = np.asarray(raw, np.uint8).reshape(shape[0], shape[1] // 32, -1)  # [N, K / 32, block bytes]
    d = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0]  # [N, K / 32]
    if tensor_type == T.Q8_0:  # block: d, 32 int8
        return QuantizedMatrix(kind="q8_0", q=raw[..., 2:34].view(np.int8).reshape(shape), d=d)
    if tensor_type == T.Q4_0:  # block: d, 16 bytes of nibbles
        with np.errstate(over="ignore", invalid="ignore"):
            m = d * np.float16(-8)
        if not np.isfinite(m).all():
            return None
        qs = raw[..., 2:18]
    else:  # Q4_1 block: d, m, 16 bytes of nibbles
        m = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0]
        qs = raw[..., 4:20]
    # element i: low nibble of byte i, element i + 16: its high nibble
    return QuantizedMatrix(kind="q4_1", q=np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(shape), d=d, m=m)


class _BlocksView(Mapping):
    """The Q4_0 / Q4_1 / Q8_0 matrices of a GGUF model under ``models.cpu_layout.to_cpu_layout``'s ``quantized`` keys
    (``"layers_3/self_attn/q_proj"``, ``"embed_tokens"``, ...), read (and un-permuted) one at a time on access."""

    def __init__(self, f: GGUFFile, config: LlamaConfig, permute_qk: bool):
        self._f, self._config, self._permute_qk = f, config, permute_qk
        self._names: dict[str, str] = {}  # key -> GGUF name
        for name in f.tensors:
            hf = _HFView._hf_name(name)
            if hf is None or not hf.endswith(".weight"):
                continue
            key = hf[: -len(".weight")].removeprefix("model.").replace("layers.", "layers_", 1).replace(".", "/")
            self._names[key] = name

    def __getitem__(self, key: str) -> QuantizedMatrix:
        name = self._names[key]
        t = self._f.tensors[name]
        b = blocks_from_raw(t.data, t.tensor_type, self._f.tensor_shape(name))
        if b is None:
            raise KeyError(key)
        if self._permute_qk and (".attn_q." in name or ".attn_k." in name):
            heads = self._config.num_attention_heads if ".attn_q." in name else self._config.num_key_value_heads
            b = b.map_rows(lambda a: _unpermute_rows(a, heads))
        return b

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def gguf_blocks(path: PathLike) -> Mapping[str, QuantizedMatrix]:
    """A GGUF model's matrices in blocks the CPU panel kernel reads, for ``models.cpu_layout.to_cpu_layout``
    (lazy: nothing is read until a key is; a key whose type the kernel does not read raises KeyError)."""
    f = open_gguf(path)
    return _BlocksView(f, config_from_gguf(f), permute_qk=f.architecture == "llama")
