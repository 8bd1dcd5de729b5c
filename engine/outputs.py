"""What the engine hands back: per-step token deltas and finished completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .logprobs import TokenLogprob


@dataclass(slots=True)
class StepOutput:
    """The tokens one request gained in one step (at most one today) and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0  # prefix-cache hits, reported with the last token
    epoch: int = 0  # the group epoch of the step that produced it (0: single rank)
    index: int = -1  # output position of new_token_ids[0] (-1: not known)
    logprobs: Optional[list[TokenLogprob]] = None  # one per new token (requests asking)
    # With the first token of a request asking for them: one per prompt token (None for
    # the first, which nothing scores).
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # With the first token: seconds queued (added to first scheduled) and prefilling
    # (first scheduled to first token) on the engine that produced it (-1: not known).
    queued_s: float = -1.0
    prefill_s: float = -1.0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # of token_ids without the EOS / stop token that ended them (as vLLM's)
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[TokenLogprob]] = None  # one per token (requests asking)
    cumulative_logprob: Optional[float] = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request in the shape vLLM users know: `.outputs[0].token_ids`."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
