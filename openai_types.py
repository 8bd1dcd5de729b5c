"""Response bodies of the OpenAI routes phalanx serves, as msgspec Structs.

One definition for both sides: the server encodes these, the SDK decodes them. Field
names and nesting follow `openai/openapi-subset.json` (CreateCompletionResponse,
CreateChatCompletionResponse, CreateChatCompletionStreamResponse, ListModelsResponse,
ErrorResponse). Decoding ignores fields it does not know, so other OpenAI-compatible
servers decode too. Optional fields that are absent encode as absent (`UNSET`), never
as `null`, except where the spec marks them required-but-nullable (`logprobs`,
`finish_reason`, a chat message's `content`/`refusal`) and vLLM's `stop_reason`, which
vLLM always sends (null unless a stop string or listed token ended the choice).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "UNSET", "Usage", "PromptTokensDetails", "CompletionChoice", "Completion",
    "CompletionLogprobs", "TopLogprob", "PromptLogprob", "PromptLogprobs", "ChatTokenLogprob", "ChatLogprobs",
    "ChatMessage", "ChatChoice", "FunctionCall", "ToolCall", "ToolCallDelta", "ChatCompletion", "ChatDelta", "ChatChunkChoice",
    "ChatCompletionChunk", "Model", "ModelList", "TokenizeResponse", "DetokenizeResponse",
    "Version", "ErrorDetail", "ErrorResponse",
]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """Token counts of one request (summed over its choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Union[PromptTokensDetails, UnsetType] = UNSET


class CompletionLogprobs(msgspec.Struct):
    """A completion choice's `logprobs` (the legacy shape): per token its text, its
    logprob, its top alternatives `{text: logprob}` and its character offset in the
    choice's text. With `echo`, the prompt's tokens come first (the first one has null
    logprob and null top_logprobs: nothing scores it)."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(msgspec.Struct):
    """One token of a chat choice's `logprobs.content`."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct):
    content: Optional[list[ChatTokenLogprob]] = None
    refusal: Optional[list[ChatTokenLogprob]] = None


class PromptLogprob(msgspec.Struct):
    """A token's entry in vLLM's `prompt_logprobs` (a dict per prompt position, keyed by
    token id: the prompt's own token and the best alternatives)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]  # None at position 0


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: Optional[str] = None  # "stop" | "length"; null on non-final chunks
    logprobs: Any = None
    # vLLM's `return_token_ids` extension: the generated token ids (a chunk: since the
    # previous chunk of the choice); absent unless the request asked for them
    token_ids: Union[list[int], UnsetType] = UNSET
    # vLLM's: the stop string or `stop_token_ids` id that ended the choice (null otherwise,
    # EOS included)
    stop_reason: Union[int, str, None] = None
    # vLLM's: with `return_token_ids`, the prompt's ids (a stream: on the choice's first
    # chunk); with `prompt_logprobs`, each prompt position's logprobs
    prompt_token_ids: Union[list[int], UnsetType] = UNSET
    prompt_logprobs: Union[PromptLogprobs, UnsetType] = UNSET


class Completion(msgspec.Struct):
    """`/v1/completions` response, and each chunk of its stream (same object type).

    A stream's usage chunk (when `stream_options.include_usage`) has no choices."""

    id: str
    object: str  # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Union[Usage, None, UnsetType] = UNSET

    @property
    def text(self) -> str:
        """The first choice's text ("" for a usage-only chunk)."""
        return self.choices[0].text if self.choices else ""


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(msgspec.Struct):
    """A call the model made (a chat message's `tool_calls`)."""

    id: str
    function: FunctionCall
    type: str = "function"


class ToolCallDelta(msgspec.Struct):
    """A stream's tool call: phalanx sends each call whole, in one delta."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str  # "assistant"
    content: Optional[str]
    refusal: Optional[str] = None
    tool_calls: Union[list[ToolCall], UnsetType] = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: Optional[str] = None
    logprobs: Any = None
    token_ids: Union[list[int], UnsetType] = UNSET  # as `CompletionChoice.token_ids`
    stop_reason: Union[int, str, None] = None  # as `CompletionChoice.stop_reason`


class ChatCompletion(msgspec.Struct):
    """`/v1/chat/completions` response (non-streaming)."""

    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Union[Usage, None, UnsetType] = UNSET
    prompt_token_ids: Union[list[int], UnsetType] = UNSET  # as in `CompletionChoice`
    prompt_logprobs: Union[PromptLogprobs, UnsetType] = UNSET  # as in `CompletionChoice`

    @property
    def text(self) -> str:
        return (self.choices[0].message.content or "") if self.choices else ""


class ChatDelta(msgspec.Struct):
    role: Union[str, UnsetType] = UNSET
    content: Union[str, None, UnsetType] = UNSET
    tool_calls: Union[list[ToolCallDelta], UnsetType] = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: Any = None
    token_ids: Union[list[int], UnsetType] = UNSET  # as `CompletionChoice.token_ids`
    stop_reason: Union[int, str, None] = None  # as `CompletionChoice.stop_reason`


class ChatCompletionChunk(msgspec.Struct):
    """One SSE chunk of a streamed chat completion (`object == "chat.completion.chunk"`)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Union[Usage, None, UnsetType] = UNSET
    prompt_token_ids: Union[list[int], UnsetType] = UNSET  # on the first chunk (token ids asked)

    @property
    def text(self) -> str:
        """The first choice's content delta ("" when none)."""
        if not self.choices:
            return ""
        content = self.choices[0].delta.content
        return content if isinstance(content, str) else ""


class Model(msgspec.Struct):
    id: str
    object: str  # "model"
    created: int
    owned_by: str
    max_model_len: Union[int, UnsetType] = UNSET  # extension: the served context length


class ModelList(msgspec.Struct):
    object: str  # "list"
    data: list[Model]


class TokenizeResponse(msgspec.Struct):
    """`POST /tokenize` (vLLM's shape): the prompt's token ids and their count, beside
    the served context length; `token_strs` when asked for."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str  # `POST /detokenize`: the text of the given token ids


class Version(msgspec.Struct):
    version: str  # `GET /version`


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail
