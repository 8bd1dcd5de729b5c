"""Request bodies of `/v1/completions` and `/v1/chat/completions` as msgspec structs
(strict: unknown fields are refused). protocol.py decodes and checks them; its
docstring lists what each field does."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from .tool_choice import ToolSpec

__all__ = ["StreamOptions", "SamplingFields", "CompletionRequest", "ContentPart",
           "FunctionCallIn", "ToolCallIn", "ChatMessageIn", "ChatCompletionRequest"]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's: usage on every chunk too
    include_obfuscation: Optional[bool] = None  # accepted, no effect


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True):
    """Fields shared by both routes."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # extension
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    repetition_penalty: Optional[float] = None  # extension
    min_tokens: Optional[int] = None  # extension
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None  # extension
    guided_json: Union[dict[str, Any], str, None] = None  # extension (vLLM's older names)
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    ignore_eos: Optional[bool] = None  # extension
    return_token_ids: Optional[bool] = None  # extension
    min_p: Optional[float] = None  # extension
    stop_token_ids: Optional[list[int]] = None  # extension
    include_stop_str_in_output: Optional[bool] = None  # extension
    skip_special_tokens: Optional[bool] = None  # extension
    allowed_token_ids: Optional[list[int]] = None  # extension
    bad_words: Optional[list[str]] = None  # extension
    truncate_prompt_tokens: Optional[int] = None  # extension
    truncation_side: Optional[str] = None  # extension: "left" (default) or "right"
    add_special_tokens: Optional[bool] = None  # extension (default: the route's)
    return_tokens_as_token_ids: Optional[bool] = None  # extension
    priority: Optional[int] = None  # extension (0 only)
    cache_salt: Optional[str] = None  # extension
    prompt_logprobs: Optional[int] = None  # extension
    # vLLM's, accepted at their defaults only (no beam search; fast tokenizers' text)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    spaces_between_special_tokens: Optional[bool] = None


class CompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    """CreateCompletionRequest. `prompt`: a string, a list of token ids, or a list of
    either (one choice per prompt, `index` = the prompt's position)."""

    prompt: Union[str, list[Any]]
    best_of: Optional[int] = None
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(msgspec.Struct):
    type: str
    text: Optional[str] = None


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct):
    id: str
    function: FunctionCallIn
    type: str = "function"


class ChatMessageIn(msgspec.Struct):
    """A chat message; only text content (a string or `{"type": "text"}` parts). An
    assistant message may carry the `tool_calls` it made; a `tool` message answers one
    (`tool_call_id`)."""

    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    """CreateChatCompletionRequest (text only). `max_completion_tokens` wins over the
    deprecated `max_tokens` when both are given."""

    messages: list[ChatMessageIn]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    add_generation_prompt: bool = True  # extension: the template's assistant header
    continue_final_message: bool = False  # extension: extend the last (assistant) message
    echo: bool = False  # extension (vLLM): an assistant's last message leads the answer
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extension: template variables
