"""Response and stream-chunk bodies of the two generation routes.

`CompletionFormat` and `ChatFormat` build the OpenAI objects from the pieces the
handler collects, so the handler's flow is the same for both routes. A format object
serves one request (it knows its echo and logprobs options, and keeps per-choice state
of a stream: whether its prompt was echoed, its text offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..engine.logprobs import TokenLogprob
from ..openai_types import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                         ChatDelta, ChatMessage, Completion, CompletionChoice, FunctionCall,
                         PromptTokensDetails, ToolCall, ToolCallDelta, UNSET, Usage)
from . import tool_parser
from .generation import ChoiceEvent
from .logprob_format import (TokenNames, chat_logprobs, completion_logprobs, merge_completion,
                             prompt_logprobs)

__all__ = ["Envelope", "ChoiceResult", "CompletionFormat", "ChatFormat", "make_usage"]


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every body of one request repeats."""

    id: str
    created: int
    model: str
    token_ids: bool = False  # `return_token_ids`: choices carry their tokens' ids


@dataclass(slots=True)
class ChoiceResult:
    """A whole choice, gathered from its events."""

    index: int
    text: str = ""
    finish_reason: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    cumulative_logprob: float = 0.0
    stop_reason: Any = None

    def add(self, event: ChoiceEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        if event.logprobs is not None:
            self.logprobs = (self.logprobs or []) + event.logprobs
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason


def _ids(env: Envelope, ids: Optional[list[int]]) -> Any:
    return ids if env.token_ids and ids is not None else UNSET


def _prompt_lps(names: Optional[TokenNames], lps) -> Any:
    return UNSET if names is None or lps is None else prompt_logprobs(names, lps)


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                 PromptTokensDetails(cached_tokens))


@dataclass(frozen=True, slots=True)
class EchoPrompt:
    """A prompt as `echo` repeats it: its text and token ids."""

    text: str
    token_ids: list[int]


class CompletionFormat:
    """`text_completion` objects (the same object type for responses and chunks).
    `echo`: each prompt (by prompt index = choice index // `per_prompt`) is repeated
    before its choices' text; `texts`: token texts for `logprobs` (None: not asked);
    `prompts`: the prompts' ids (sent when the envelope asks for token ids);
    `prompt_names`: token texts for vLLM's `prompt_logprobs` (None: not asked)."""

    def __init__(self, texts: Optional[TokenNames] = None,
                 echo: Optional[Sequence[EchoPrompt]] = None, per_prompt: int = 1,
                 prompts: Sequence[list[int]] = (),
                 prompt_names: Optional[TokenNames] = None) -> None:
        self.texts, self.echo, self.per_prompt = texts, echo, per_prompt
        self.prompts, self.prompt_names = prompts, prompt_names
        self._offsets: dict[int, int] = {}  # stream: next text offset of each choice

    def _prompt(self, index: int) -> Optional[EchoPrompt]:
        return None if self.echo is None else self.echo[index // self.per_prompt]

    def _logprobs(self, index: int, prompt_lps, logprobs, first: bool) -> Any:
        if self.texts is None:
            return None
        parts, offset = [], self._offsets.get(index, 0)
        echo = self._prompt(index) if first else None
        if echo is not None and prompt_lps is not None:
            parts.append(completion_logprobs(self.texts, prompt_lps, echo.token_ids, offset))
            offset += sum(len(t) for t in parts[0].tokens)
        elif echo is not None:
            offset += len(echo.text)
        parts.append(completion_logprobs(self.texts, logprobs or [], (), offset))
        self._offsets[index] = offset + sum(len(t) for t in parts[-1].tokens)
        return merge_completion(parts)

    def response(self, env: Envelope, results: Sequence[ChoiceResult], usage: Usage) -> Completion:
        choices = []
        for r in results:
            echo = self._prompt(r.index)
            text = (echo.text if echo else "") + r.text
            choices.append(CompletionChoice(
                r.index, text, r.finish_reason,
                self._logprobs(r.index, r.prompt_logprobs, r.logprobs, True),
                token_ids=_ids(env, r.token_ids), stop_reason=r.stop_reason,
                prompt_token_ids=self._prompt_ids(env, r.index),
                prompt_logprobs=_prompt_lps(self.prompt_names, r.prompt_logprobs)))
        return Completion(env.id, "text_completion", env.created, env.model, choices, usage)

    def _prompt_ids(self, env: Envelope, index: int) -> Any:
        return _ids(env, self.prompts[index // self.per_prompt] if self.prompts else None)

    def opening_chunks(self, env: Envelope, num_choices: int) -> list[Any]:
        return []

    def chunk(self, env: Envelope, event: ChoiceEvent) -> Completion:
        first = event.index not in self._offsets
        echo = self._prompt(event.index) if first else None
        text = (echo.text if echo else "") + event.text
        logprobs = self._logprobs(event.index, event.prompt_logprobs, event.logprobs, first)
        self._offsets.setdefault(event.index, 0)
        return Completion(env.id, "text_completion", env.created, env.model,
                          [CompletionChoice(event.index, text, event.finish_reason, logprobs,
                                            token_ids=_ids(env, event.token_ids),
                                            stop_reason=event.stop_reason,
                                            prompt_token_ids=self._prompt_ids(env, event.index)
                                            if first else UNSET)])

    def usage_chunk(self, env: Envelope, usage: Usage) -> Completion:
        return Completion(env.id, "text_completion", env.created, env.model, [], usage)


class ChatFormat:
    """`chat.completion` responses and `chat.completion.chunk` chunks. A stream opens
    with one `{"role": "assistant", "content": ""}` delta per choice; the last chunk of
    each choice carries its `finish_reason` (and its remaining text, if any).
    `texts`: token texts for `logprobs` (None: not asked); `tools`: parse tool calls out
    of the text (`tool_parser`): they become `tool_calls` (a stream: one delta per call,
    whole) and a choice that made any ends with finish reason "tool_calls". `prompt`: the
    prompt's ids (sent when the envelope asks for token ids); `prompt_names`: token texts
    for vLLM's `prompt_logprobs` (None: not asked); `echo`: text that leads each choice's
    content (vLLM's chat `echo`: a stream sends it in the opening delta)."""

    def __init__(self, texts: Optional[TokenNames] = None, tools: bool = False,
                 prompt: Optional[list[int]] = None,
                 prompt_names: Optional[TokenNames] = None, echo: str = "") -> None:
        self.texts, self.tools = texts, tools
        self.prompt, self.prompt_names, self.echo = prompt, prompt_names, echo
        self._streams: dict[int, tool_parser.ToolCallStream] = {}

    def _logprobs(self, logprobs: Optional[list[TokenLogprob]]) -> Any:
        return None if self.texts is None else chat_logprobs(self.texts, logprobs or [])

    def _message(self, r: ChoiceResult) -> tuple[ChatMessage, Optional[str]]:
        if not self.tools:
            return ChatMessage("assistant", self.echo + r.text), r.finish_reason
        content, calls = tool_parser.parse(r.text)
        if not calls:
            return ChatMessage("assistant", self.echo + r.text), r.finish_reason
        content = self.echo + (content or "") if self.echo else content
        return (ChatMessage("assistant", content, tool_calls=[
                    ToolCall(c.id, FunctionCall(c.name, c.arguments)) for c in calls]),
                "tool_calls" if r.finish_reason == "stop" else r.finish_reason)

    def response(self, env: Envelope, results: Sequence[ChoiceResult], usage: Usage) -> ChatCompletion:
        choices = []
        for r in results:
            message, reason = self._message(r)
            choices.append(ChatChoice(r.index, message, reason, self._logprobs(r.logprobs),
                                      token_ids=_ids(env, r.token_ids),
                                      stop_reason=r.stop_reason))
        return ChatCompletion(env.id, "chat.completion", env.created, env.model, choices, usage,
                              _ids(env, self.prompt),
                              _prompt_lps(self.prompt_names, results[0].prompt_logprobs
                                          if results else None))

    def opening_chunks(self, env: Envelope, num_choices: int) -> list[Any]:
        chunks = [self._chunk(env, [ChatChunkChoice(i, ChatDelta(role="assistant", content=self.echo))])
                  for i in range(num_choices)]
        if chunks:
            chunks[0].prompt_token_ids = _ids(env, self.prompt)
        return chunks

    def _delta(self, event: ChoiceEvent) -> tuple[ChatDelta, Optional[str]]:
        if not self.tools:
            return (ChatDelta(content=event.text) if event.text else ChatDelta()), event.finish_reason
        stream = self._streams.setdefault(event.index, tool_parser.ToolCallStream())
        before = stream.num_calls
        text, calls = stream.feed(event.text)
        reason = event.finish_reason
        if reason is not None:
            text += stream.finish()[0]
            if stream.num_calls and reason == "stop":
                reason = "tool_calls"
        delta = ChatDelta(content=text) if text else ChatDelta()
        if calls:
            delta.tool_calls = [ToolCallDelta(before + k, c.id, FunctionCall(c.name, c.arguments))
                                for k, c in enumerate(calls)]
        return delta, reason

    def chunk(self, env: Envelope, event: ChoiceEvent) -> ChatCompletionChunk:
        delta, reason = self._delta(event)
        return self._chunk(env, [ChatChunkChoice(event.index, delta, reason,
                                                 self._logprobs(event.logprobs),
                                                 token_ids=_ids(env, event.token_ids),
                                                 stop_reason=event.stop_reason)])

    def usage_chunk(self, env: Envelope, usage: Usage) -> ChatCompletionChunk:
        return self._chunk(env, [], usage)

    @staticmethod
    def _chunk(env: Envelope, choices: list, usage: Any = None) -> ChatCompletionChunk:
        if usage is None:
            return ChatCompletionChunk(env.id, "chat.completion.chunk", env.created, env.model,
                                       choices)
        return ChatCompletionChunk(env.id, "chat.completion.chunk", env.created, env.model,
                                   choices, usage)
