"""The built-in models: a small Llama target, its distilled draft and four draft heads, trained on the stdlib.

target and draft are Hugging Face-format directories (config.json, bf16
model.safetensors, tokenizer.json); eagle, eagle3, mtp and medusa are draft
heads for the target (``models.heads`` format, written by ``specjax
train-head``). All ship as package data and resolve as ``builtin:<name>``;
``specjax/train/README.md`` records how they were trained and their numbers.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def target_path() -> str:
    """Directory of the built-in target model."""
    return str(_HERE / "target")


def draft_path() -> str:
    """Directory of the built-in draft model (same tokenizer as the target)."""
    return str(_HERE / "draft")
