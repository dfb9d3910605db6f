"""kvd: a local LLM inference daemon with a paged KV cache, continuous batching and prefix caching."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import kvd` (the CLI, the client side) must not pay for importing torch.
    if name == "LLM":
        from kvd.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvd.request.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvd' has no attribute {name!r}")
