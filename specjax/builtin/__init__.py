"""The built-in model pair: a small Llama target and its distilled draft, trained on the stdlib's source.

Both are Hugging Face-format directories (config.json, bf16 model.safetensors,
tokenizer.json) shipped as package data; ``specjax/train/README.md`` records how
they were trained and their held-out numbers.
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
