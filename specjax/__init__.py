"""specjax: speculative decoding for large language models on JAX/XLA.

The public names are imported on first use, so ``import specjax.<module>`` (or
``models`` / ``pallas_kernels``, which import specjax modules) never runs into
an import cycle through this package's top level.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "specjax.llm",
    "RequestOutput": "specjax.outputs",
    "CompletionOutput": "specjax.outputs",
    "Logprob": "specjax.outputs",
    "SamplingParams": "specjax.config",
    "EngineConfig": "specjax.config",
    "SpeculativeConfig": "specjax.config",
    "rejection_sample": "specjax.sample.rejection",
    "rejection_sample_with_counts": "specjax.sample.rejection",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
