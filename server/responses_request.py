"""A Responses API request (responses_bodies.py) as the chat completion it runs as.

`instructions` become a system message before the input; an input string is one user
message; `max_output_tokens` is `max_completion_tokens`; `text.format` is the chat
route's `response_format`. The chat request then goes through the chat route's checks
and plan, and a refusal there names the Responses field (`input` for `messages`, ...).
Fields of a stored-response or tool workflow are refused with a 400 naming them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import protocol as proto
from .errors import OpenAIError
from .responses_bodies import ResponsesRequest

__all__ = ["chat_request", "RESPONSES_PARAMS"]

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# chat fields that carry a Responses field (for the `param` of a refusal)
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format"}
_SHARED = ("temperature", "top_p", "user", "seed", "top_k", "min_p", "repetition_penalty",
           "cache_salt", "ignore_eos", "metadata")


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_value")


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None or req.conversation is not None:
        name = "previous_response_id" if req.previous_response_id is not None else "conversation"
        raise _bad(name, f"{name}: this server keeps no responses or conversations; send "
                   "the whole conversation as `input`.")
    if req.tools:
        raise _bad("tools", "tools are not supported on /v1/responses here; use "
                   "/v1/chat/completions for tool calls.")
    if req.tool_choice not in (None, "none", "auto"):
        raise _bad("tool_choice", f"tool_choice={req.tool_choice!r} needs tools.")
    if req.background:
        raise _bad("background", "background responses are not supported.")
    if req.include:
        raise _bad("include", f"include={req.include!r} is not supported.")
    if req.truncation not in (None, "disabled"):
        raise _bad("truncation", "truncation must be \"disabled\": a prompt longer than the "
                   "context is a 400.")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _bad("text.verbosity", f"text.verbosity={req.text.verbosity!r} is not supported.")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    if not req.input:
        raise OpenAIError(400, "input must not be empty.", param="input", code="invalid_value")
    for i, item in enumerate(req.input):
        if item.type not in (None, "message"):
            raise _bad(f"input[{i}].type", f"input items of type {item.type!r} are not "
                       "supported (messages only).")
        if item.role not in _ROLES:
            raise _bad(f"input[{i}].role", f"Unsupported role {item.role!r}; expected one of "
                       f"{', '.join(_ROLES)}.")
        content = item.content
        if not isinstance(content, str):
            kinds = [p.type for p in content if p.type not in _TEXT_PARTS or p.text is None]
            if kinds:
                raise _bad(f"input[{i}].content", f"content parts of type {kinds[0]!r} are not "
                           "supported (input_text, output_text).")
            content = "".join(p.text for p in content)
        out.append({"role": item.role, "content": content})
    return out


def _response_format(req: ResponsesRequest) -> Any:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema or {},
            **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    return {"type": fmt.type}


def chat_request(req: ResponsesRequest) -> proto.ChatCompletionRequest:
    """The chat completion `req` runs as, checked as the chat route checks its own
    (OpenAIError naming the Responses field)."""
    _refuse_unsupported(req)
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req),
                            "stream": bool(req.stream)}
    for name in _SHARED:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    fmt = _response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    try:
        return proto.decode_request(msgspec.json.encode(body), proto.ChatCompletionRequest)
    except OpenAIError as e:
        raise renamed(e) from None


def renamed(e: OpenAIError) -> OpenAIError:
    """`e` with its `param` as the Responses API names it."""
    if e.param:
        head, _, rest = e.param.partition("[")
        if head in RESPONSES_PARAMS:
            e.param = RESPONSES_PARAMS[head] + (f"[{rest}" if rest else "")
    return e
