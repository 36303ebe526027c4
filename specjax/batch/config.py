"""YAML run configs for ``specjax batch --config``: ``LLM`` keyword arguments, keys checked before any model loads."""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from specjax.config import SpeculativeConfig


def llm_argument_names() -> tuple[str, ...]:
    """The keyword arguments of :class:`specjax.LLM`: what a YAML config may set."""
    from specjax.llm import LLM

    return tuple(p for p in inspect.signature(LLM.__init__).parameters if p != "self")


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file of ``LLM`` keyword arguments, keys checked (values are checked by ``LLM`` itself).

    ``speculative_config``'s keys are checked against :class:`SpeculativeConfig`
    here too, but the config is not built: a file naming a method that is not
    implemented yet still loads, and ``LLM(...)`` raises on it.
    """
    import yaml

    path = os.fspath(path)
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"config {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path!r} must be a mapping of LLM arguments, got {type(data).__name__}")
    known = llm_argument_names()
    for key in data:
        if key not in known:
            raise ValueError(f"config {path!r}: unknown key {key!r}; known keys: {list(known)}")
    spec = data.get("speculative_config")
    if spec is not None:
        if not isinstance(spec, dict):
            raise ValueError(f"config {path!r}: speculative_config must be a mapping, got {type(spec).__name__}")
        fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        for key in spec:
            if key not in fields:
                raise ValueError(
                    f"config {path!r}: unknown key 'speculative_config.{key}'; known keys: {sorted(fields)}"
                )
    return data
