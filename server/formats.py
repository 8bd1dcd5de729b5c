"""Response and stream-chunk bodies of the two generation routes.

`CompletionFormat` and `ChatFormat` build the OpenAI objects from the pieces the
handler collects, so the handler's flow is the same for both routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..openai_types import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                         ChatDelta, ChatMessage, Completion, CompletionChoice,
                         PromptTokensDetails, UNSET, Usage)
from .generation import ChoiceEvent

__all__ = ["Envelope", "CompletionFormat", "ChatFormat", "make_usage"]


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every body of one request repeats."""

    id: str
    created: int
    model: str
    token_ids: bool = False  # `return_token_ids`: choices carry their tokens' ids


def _ids(env: Envelope, ids: Optional[list[int]]) -> Any:
    return ids if env.token_ids and ids is not None else UNSET


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                 PromptTokensDetails(cached_tokens))


class CompletionFormat:
    """`text_completion` objects (the same object type for responses and chunks)."""

    def response(self, env: Envelope, texts: Sequence[str], reasons: Sequence[Optional[str]],
                 usage: Usage, ids: Sequence[list[int]] = ()) -> Completion:
        ids = list(ids) or [None] * len(texts)
        choices = [CompletionChoice(i, t, r, token_ids=_ids(env, d))
                   for i, (t, r, d) in enumerate(zip(texts, reasons, ids))]
        return Completion(env.id, "text_completion", env.created, env.model, choices, usage)

    def opening_chunks(self, env: Envelope, num_choices: int) -> list[Any]:
        return []

    def chunk(self, env: Envelope, event: ChoiceEvent) -> Completion:
        return Completion(env.id, "text_completion", env.created, env.model,
                          [CompletionChoice(event.index, event.text, event.finish_reason,
                                            token_ids=_ids(env, event.token_ids))])

    def usage_chunk(self, env: Envelope, usage: Usage) -> Completion:
        return Completion(env.id, "text_completion", env.created, env.model, [], usage)


class ChatFormat:
    """`chat.completion` responses and `chat.completion.chunk` chunks. A stream opens
    with one `{"role": "assistant", "content": ""}` delta per choice; the last chunk of
    each choice carries its `finish_reason` (and its remaining text, if any)."""

    def response(self, env: Envelope, texts: Sequence[str], reasons: Sequence[Optional[str]],
                 usage: Usage, ids: Sequence[list[int]] = ()) -> ChatCompletion:
        ids = list(ids) or [None] * len(texts)
        choices = [ChatChoice(i, ChatMessage("assistant", t), r, token_ids=_ids(env, d))
                   for i, (t, r, d) in enumerate(zip(texts, reasons, ids))]
        return ChatCompletion(env.id, "chat.completion", env.created, env.model, choices, usage)

    def opening_chunks(self, env: Envelope, num_choices: int) -> list[Any]:
        return [self._chunk(env, [ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
                for i in range(num_choices)]

    def chunk(self, env: Envelope, event: ChoiceEvent) -> ChatCompletionChunk:
        delta = ChatDelta(content=event.text) if event.text else ChatDelta()
        return self._chunk(env, [ChatChunkChoice(event.index, delta, event.finish_reason,
                                                 token_ids=_ids(env, event.token_ids))])

    def usage_chunk(self, env: Envelope, usage: Usage) -> ChatCompletionChunk:
        return self._chunk(env, [], usage)

    @staticmethod
    def _chunk(env: Envelope, choices: list, usage: Any = None) -> ChatCompletionChunk:
        if usage is None:
            return ChatCompletionChunk(env.id, "chat.completion.chunk", env.created, env.model,
                                       choices)
        return ChatCompletionChunk(env.id, "chat.completion.chunk", env.created, env.model,
                                   choices, usage)
