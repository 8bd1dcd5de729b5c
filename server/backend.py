"""The contract between the HTTP server and whatever generates tokens.

The server speaks OpenAI on one side and only `ServingBackend` on the other:
`EngineBackend` (one in-process engine on a thread) and `ClusterBackend` (a multi-rank
group behind the prefix-aware router, driven from one thread) implement it. Everything
here is plain asyncio: the server calls these methods from its event loop and they must
never block it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from ..engine.logprobs import TokenLogprob
from ..engine.sampling_params import SamplingParams

__all__ = ["TokenDelta", "ServingBackend", "FINISH_REASONS"]

# "stop": an EOS or stop token; "length": max_tokens or the context is full;
# "abort": the request was cancelled (abort(), close(), or a backend shutting down).
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens a request gained since its previous delta.

    `index` is the output position of `token_ids[0]` (0 for the first generated token):
    the deltas of one request tile its output exactly once and in order, so
    `delta.index == sum(len(d.token_ids) for d in earlier deltas)`. The last delta has
    `finished=True` and a `finish_reason` from `FINISH_REASONS`; it may carry tokens or
    none. `num_cached_tokens` (prompt tokens served from the prefix cache) is reported on
    the last delta; 0 elsewhere or when unknown. A request whose params ask for
    `logprobs` gets one `TokenLogprob` per token in `logprobs`; one asking for
    `prompt_logprobs` gets them (None first) on the delta of index 0.
    """

    index: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    queued_s: float = -1.0  # with index 0: the engine's queue and prefill seconds (-1: unknown)
    prefill_s: float = -1.0

    def merged(self, later: "TokenDelta") -> "TokenDelta":
        """This delta followed by the contiguous `later` one, as one delta."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        first = self if self.prefill_s >= 0 else later
        return TokenDelta(self.index, self.token_ids + later.token_ids, later.finished,
                          later.finish_reason, later.num_cached_tokens, logprobs,
                          self.prompt_logprobs or later.prompt_logprobs, first.queued_s,
                          first.prefill_s)


class ServingBackend(abc.ABC):
    """What the HTTP server needs from a serving backend.

    Attributes (set by the implementation before the server starts):
      model_name: the model's id (the server may serve it under another name).
      max_model_len: context length in tokens; prompt + output never exceed it.
      tokenizer: a Hugging Face tokenizer of the model folder (`encode`, `decode`,
        `apply_chat_template` with the folder's chat template). The server uses it on
        its event loop thread only.
      eos_token_ids: the ids that end a request unless it ignores EOS (the engine's;
        the server keeps their text out of the output). Default: none known.
    """

    model_name: str
    max_model_len: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...] = ()

    @abc.abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Generate for one request; an async generator (`async def ... yield`).

        - `request_id` must be unique among requests in flight (ValueError otherwise).
        - Invalid requests (empty prompt, token outside the vocabulary, prompt that
          leaves no room in the context, more KV than the cache holds, ...) raise
          `ValueError` with a readable message *before the first delta*; the server
          answers them 400. Any other exception means the backend failed (500).
        - Yields `TokenDelta`s as described there; the iterator ends after the delta
          with `finished=True`.
        - If the consumer stops early (break + `aclose()`, or its task is cancelled),
          the backend aborts the request itself and frees its KV; calling `abort` as
          well is harmless.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Cancel a request and free its KV. Idempotent; unknown or finished ids are
        ignored. A consumer still iterating `generate` receives a last delta with
        `finish_reason="abort"`. Must not block the event loop."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """A cheap snapshot for /metrics, callable from the event loop. Keys (all
        numbers): `num_waiting` (queue depth), `num_running`, `kv_usage` (0..1 fraction
        of KV pages in use), `prefix_hit_rate` (0..1, prompt tokens served from the
        prefix cache); implementations may add more."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Abort every request (their consumers see `finish_reason="abort"`) and release
        the backend's resources. Idempotent; `generate` afterwards raises RuntimeError."""

    def healthy(self) -> bool:
        """False once the backend can no longer serve (its workers died); /health
        then answers 503."""
        return True
