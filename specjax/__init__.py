"""specjax: speculative decoding for large language models on JAX/XLA."""

from specjax.config import EngineConfig, SamplingParams
from specjax.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "rejection_sample"]
__version__ = "0.1.0"


def __getattr__(name):
    # The rejection sampler is imported lazily so the package imports without it being built.
    if name in ("rejection_sample", "rejection_sample_with_counts"):
        from specjax.sample import rejection

        return getattr(rejection, name)
    raise AttributeError(name)
