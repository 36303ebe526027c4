"""The built-in models: a small Llama target, its distilled draft and four draft heads, trained on the stdlib.

target and draft are Hugging Face-format directories (config.json, bf16
model.safetensors, tokenizer.json); eagle, eagle3, mtp and medusa are draft
heads for the target (``models.heads`` format, written by ``specjax
train-head``). All ship as package data and resolve as ``builtin:<name>``;
``specjax/train/README.md`` records how they were trained and their numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent

PREFIX = "builtin:"
DEFAULT_SPEC = {"method": "draft_model", "model": f"{PREFIX}draft", "num_speculative_tokens": 4}
"""The speculative config ``LLM()`` uses with no model: the shipped target verified against its draft."""
DEFAULT_TARGET = f"{PREFIX}target"


def resolve_model(model: str | os.PathLike) -> str:
    """A model path, with ``builtin:<name>`` mapped to the directory shipped inside the package."""
    name = os.fspath(model)
    if not name.startswith(PREFIX):
        return name
    available = sorted(d.name for d in _HERE.iterdir() if (d / "config.json").is_file())
    short = name[len(PREFIX):]
    if short not in available:
        raise ValueError(f"model={name!r}: no built-in model {short!r}; available: {available}")
    return str(_HERE / short)


def target_path() -> str:
    """Directory of the built-in target model."""
    return str(_HERE / "target")


def draft_path() -> str:
    """Directory of the built-in draft model (same tokenizer as the target)."""
    return str(_HERE / "draft")
