"""phalanx: a fault-tolerant, actor-based serving runtime for Mixture-of-Experts models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .version import __version__
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from .engine.sampling_params import SamplingParams
    from .llm import LLM


def __getattr__(name: str):
    # Lazy, so `import phalanx.config` stays free of torch.
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
