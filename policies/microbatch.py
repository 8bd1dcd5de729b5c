"""Micro-batching policies: whether a DP×EP step runs as one batch or as two micro-batches
whose MoE exchanges overlap the other's compute (two-batch overlap, ARCHITECTURE §3).

A policy gets the step's shape as the group agreed on it (`StepShape`: the most tokens
any DP rank runs, whether any rank prefills, the EP width) and returns 1 or 2. After the
step it is told what the step cost (`observe`: the group's step time, the slowest rank's,
which also rides on the agreement). Every rank of a group runs its own copy of the policy
on the same agreed inputs, so every rank steps the same way without another message.

Contract of every `MicrobatchPolicy`:
- `decide(shape)` returns 1 or 2 and depends only on its inputs and the policy's state;
- deterministic: the same sequence of `decide` / `observe` calls gives the same
  decisions (`adaptive`'s re-probes come from a seeded generator), which is what keeps
  the ranks of a group in step;
- `observe(shape, microbatches, step_s)` after every step decided by it (no-op for the
  fixed policies).

Policies (registry kind "microbatch"): `off` (one batch), `on` (two micro-batches
always), `threshold` (two from `min_tokens` tokens per rank), `adaptive` (measures both
per token-count bucket while serving, keeps the faster, re-probes a small fraction of
steps).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from . import registry
from .checks import Configured, NoSettings, is_int, is_real, require

__all__ = ["AdaptiveConfig", "AdaptivePolicy", "KIND", "MicrobatchPolicy", "StepShape",
           "ThresholdConfig", "bucket_of", "make_microbatch_policy", "microbatch_policy_names"]

KIND = "microbatch"


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step as the group agreed on it: the most tokens a DP rank runs, whether any
    rank runs prefill tokens (not a decode-only step), and the group's EP width."""

    tokens: int
    prefill: bool = False
    ep_width: int = 1

    def __post_init__(self) -> None:
        require(is_int(self.tokens) and self.tokens >= 0, "StepShape", "tokens",
                f"must be an integer >= 0, got {self.tokens!r}")
        require(is_int(self.ep_width) and self.ep_width >= 1, "StepShape", "ep_width",
                f"must be an integer >= 1, got {self.ep_width!r}")


def bucket_of(tokens: int) -> int:
    """The token-count bucket of a step: 0 for 0-1 tokens, else ceil(log2(tokens))
    (2 -> 1, 3-4 -> 2, 5-8 -> 3, ...)."""
    return 0 if tokens <= 1 else math.ceil(math.log2(tokens))


class MicrobatchPolicy(Configured, ABC):
    """See the module docstring for the contract (settings: `Configured`)."""

    @abstractmethod
    def decide(self, shape: StepShape) -> int:
        ...

    def observe(self, shape: StepShape, microbatches: int, step_s: float) -> None:
        """What a step this policy decided cost (the group's step time)."""


@registry.register(KIND, "off")
class OffPolicy(MicrobatchPolicy):
    """One batch per step, always."""

    Config = NoSettings

    def decide(self, shape: StepShape) -> int:
        return 1


@registry.register(KIND, "on")
class OnPolicy(MicrobatchPolicy):
    """Two micro-batches whenever a rank has two or more tokens to split."""

    Config = NoSettings

    def decide(self, shape: StepShape) -> int:
        return 2 if shape.tokens >= 2 else 1


@dataclass(frozen=True, slots=True)
class ThresholdConfig:
    """`min_tokens`: two micro-batches from this many tokens per rank (seed 001: the
    overlap paid from about 32)."""

    min_tokens: int = 32

    def __post_init__(self) -> None:
        require(is_int(self.min_tokens) and self.min_tokens >= 2, "ThresholdConfig",
                "min_tokens", f"must be an integer >= 2, got {self.min_tokens!r}")


@registry.register(KIND, "threshold")
class ThresholdPolicy(MicrobatchPolicy):
    """Two micro-batches from `min_tokens` tokens per rank."""

    Config = ThresholdConfig

    def decide(self, shape: StepShape) -> int:
        return 2 if shape.tokens >= self.config.min_tokens else 1


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """- `samples`: steps measured per choice and bucket before the faster is kept;
    - `probe`: the fraction of later steps that run the other choice (re-measured, so a
      change of conditions is seen);
    - `window`: the most recent steps a choice's mean is taken over;
    - `seed`: the re-probes' generator (the same on every rank of a group)."""

    samples: int = 4
    probe: float = 0.02
    window: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        me = "AdaptiveConfig"
        require(is_int(self.samples) and self.samples >= 1, me, "samples",
                f"must be an integer >= 1, got {self.samples!r}")
        require(is_real(self.probe) and 0 <= self.probe < 1, me, "probe",
                f"must be a number in [0, 1), got {self.probe!r}")
        require(is_int(self.window) and self.window >= self.samples, me, "window",
                f"must be an integer >= samples ({self.samples}), got {self.window!r}")
        require(is_int(self.seed), me, "seed", f"must be an integer, got {self.seed!r}")


@registry.register(KIND, "adaptive")
class AdaptivePolicy(MicrobatchPolicy):
    """Per token-count bucket (`bucket_of`) and choice, the recent steps' time per
    token; each choice is measured `samples` times (alternating), then the faster mean
    is kept and the other re-probed on a `probe` fraction of steps. Steps of one token
    per rank never split."""

    Config = AdaptiveConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)
        self._times: dict[tuple[int, int], list[float]] = {}  # (bucket, n) -> s per token

    def decide(self, shape: StepShape) -> int:
        if shape.tokens < 2:
            return 1
        b = bucket_of(shape.tokens)
        one, two = self._times.get((b, 1), []), self._times.get((b, 2), [])
        if min(len(one), len(two)) < self.config.samples:
            return 1 if len(one) <= len(two) else 2  # measure both first, alternating
        best = 1 if _mean(one) <= _mean(two) else 2
        return 3 - best if self._rng.random() < self.config.probe else best

    def observe(self, shape: StepShape, microbatches: int, step_s: float) -> None:
        if shape.tokens < 2 or microbatches not in (1, 2) or not step_s > 0:
            return
        times = self._times.setdefault((bucket_of(shape.tokens), microbatches), [])
        times.append(step_s / shape.tokens)
        del times[:-self.config.window]

    def table(self) -> dict[int, dict[int, float]]:
        """{bucket: {choice: mean seconds per token}} of what was measured."""
        out: dict[int, dict[int, float]] = {}
        for (b, n), times in sorted(self._times.items()):
            out.setdefault(b, {})[n] = _mean(times)
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def make_microbatch_policy(name: str, config: Any = None) -> MicrobatchPolicy:
    """A new policy registered as `name` (ValueError listing the known names)."""
    return registry.get(KIND, name)(config)  # type: ignore[operator]


def microbatch_policy_names() -> list[str]:
    return registry.names(KIND)
