"""OpenAI's Responses API (`POST /v1/responses`), text in and text out: the request body,
the response object and the stream's events, as msgspec structs.

The request is strict like the other routes' (unknown fields are a 400). What phalanx
does not keep or run is accepted only at its neutral value: no stored responses
(`previous_response_id`, `conversation`, `background` are refused; `store` is accepted,
nothing is kept and the response says `store: false`), no tools, no reasoning items.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec
from msgspec import UNSET, UnsetType

__all__ = ["InputContent", "InputMessage", "TextFormat", "TextOptions", "StreamOptions",
           "ResponsesRequest",
           "OutputText", "OutputMessage", "ResponseUsage", "InputTokensDetails",
           "OutputTokensDetails", "IncompleteDetails", "Response", "ResponseEvent"]


class InputContent(msgspec.Struct):
    """A content part of an input message: `input_text` (or an earlier turn's
    `output_text`); other kinds are refused when the request is read."""

    type: str
    text: Optional[str] = None


class InputMessage(msgspec.Struct):
    """An input item: a message (`type` "message" or absent). `content`: a string or
    text parts."""

    role: str
    content: Union[str, list[InputContent]]
    type: Optional[str] = None
    id: Optional[str] = None
    status: Optional[str] = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    """`text.format`: "text", "json_object", or "json_schema" with its schema."""

    type: str = "text"
    name: Optional[str] = None
    schema: Optional[dict[str, Any]] = None
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # "medium" only


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Accepted, no effect: the usage is always on `response.completed`."""

    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: Union[str, list[InputMessage]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    text: Optional[TextOptions] = None
    tools: Optional[list[Any]] = None  # empty only
    tool_choice: Optional[str] = None  # "none" / "auto" with no tools
    parallel_tool_calls: Optional[bool] = None
    truncation: Optional[str] = None  # "disabled" only
    previous_response_id: Optional[str] = None  # refused: nothing is stored
    conversation: Optional[Any] = None  # refused
    background: Optional[bool] = None  # false only
    include: Optional[list[str]] = None  # empty only
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # accepted; the prefix cache needs no key
    safety_identifier: Optional[str] = None
    # vLLM's extensions, as on the other routes
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    cache_salt: Optional[str] = None
    ignore_eos: Optional[bool] = None


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct):
    id: str
    status: str  # "in_progress" | "completed" | "incomplete"
    content: list[OutputText]
    role: str = "assistant"
    type: str = "message"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str  # "max_output_tokens"


class Response(msgspec.Struct):
    """The `response` object (also inside the stream's created / completed events)."""

    id: str
    created_at: int
    model: str
    status: str  # "in_progress" | "completed" | "incomplete"
    output: list[OutputMessage]
    object: str = "response"
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    tools: list[Any] = msgspec.field(default_factory=list)
    tool_choice: str = "none"
    parallel_tool_calls: bool = False
    store: bool = False
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    error: Optional[Any] = None
    incomplete_details: Optional[IncompleteDetails] = None
    usage: Union[ResponseUsage, None] = None
    user: Union[str, None, UnsetType] = UNSET


class ResponseEvent(msgspec.Struct, omit_defaults=True):
    """One event of a streamed response (`type` names it; the fields its kind uses)."""

    type: str
    sequence_number: int
    response: Union[Response, UnsetType] = UNSET
    output_index: Union[int, UnsetType] = UNSET
    content_index: Union[int, UnsetType] = UNSET
    item_id: Union[str, UnsetType] = UNSET
    item: Union[OutputMessage, UnsetType] = UNSET
    part: Union[OutputText, UnsetType] = UNSET
    delta: Union[str, UnsetType] = UNSET
    text: Union[str, UnsetType] = UNSET
    logprobs: Union[list[Any], UnsetType] = UNSET
