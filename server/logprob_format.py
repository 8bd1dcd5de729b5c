"""`TokenLogprob`s in the two OpenAI shapes: the completions route's legacy `logprobs`
object and the chat route's `logprobs.content` list.

A token's text is its own decoding (`tokenizer.decode([id])`, cached), as vLLM reports
it (or `token_id:<id>`, `TokenIdTexts`); a token that is part of a multi-byte character decodes to U+FFFD. A logprob of -inf
(a token the request's filters removed) is written as -9999.0, as vLLM does: JSON has no
infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

from ..engine.logprobs import TokenLogprob
from ..openai_types import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                            PromptLogprobs, TopLogprob)

__all__ = ["TokenTexts", "TokenIdTexts", "TokenNames", "completion_logprobs", "chat_logprobs",
           "prompt_logprobs", "finite"]

FLOOR = -9999.0
TokenNames = Callable[[int], str]  # a token id's name in logprobs (TokenTexts, TokenIdTexts)


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class TokenTexts:
    """Each token id's text, decoded once (the cache is bounded by the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


class TokenIdTexts:
    """Each token named `token_id:<id>` (vLLM's `return_tokens_as_token_ids`: a client
    reads ids back from logprobs whatever the tokens decode to)."""

    def __call__(self, token: int) -> str:
        return f"token_id:{token}"


def completion_logprobs(texts: TokenNames, logprobs: Sequence[Optional[TokenLogprob]],
                        prompt_tokens: Sequence[int] = (), offset: int = 0) -> CompletionLogprobs:
    """The legacy object for `logprobs` (a None entry: a token nothing scored, whose id
    comes from `prompt_tokens` at the same position); text offsets start at `offset`."""
    out = CompletionLogprobs([], [], [], [])
    for i, lp in enumerate(logprobs):
        token = lp.token if lp is not None else prompt_tokens[i]
        text = texts(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(lp.logprob))
        top: dict[str, float] = {}
        for t, v in lp.top:
            top.setdefault(texts(t), finite(v))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(texts: TokenNames, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    """`{"content": [...], "refusal": null}` for a chat choice's (or chunk's) tokens."""
    content = []
    for lp in logprobs:
        text = texts(lp.token)
        content.append(ChatTokenLogprob(
            text, finite(lp.logprob), list(text.encode()),
            [TopLogprob(texts(t), finite(v), list(texts(t).encode())) for t, v in lp.top]))
    return ChatLogprobs(content)


def prompt_logprobs(texts: TokenNames, logprobs: Sequence[Optional[TokenLogprob]]
                    ) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt position (None for the first, which nothing
    scores) `{token id: {logprob, rank, decoded_token}}` for the prompt's token and the
    best alternatives (ranked 1, 2, ... in their order)."""
    out: PromptLogprobs = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token): PromptLogprob(finite(lp.logprob), lp.rank, texts(lp.token))}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), PromptLogprob(finite(v), rank, texts(t)))
        out.append(entry)
    return out


def merge_completion(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs([], [], [], [])
    for p in parts:
        out.tokens += p.tokens
        out.token_logprobs += p.token_logprobs
        out.top_logprobs += p.top_logprobs
        out.text_offset += p.text_offset
    return out
