"""Chat messages of a request (`protocol.ChatCompletionRequest`) as the chat template
takes them."""

from __future__ import annotations

import json
from typing import Any

from .errors import OpenAIError

__all__ = ["chat_messages"]


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def chat_messages(req: Any) -> list[dict[str, Any]]:
    """Messages as dicts for the chat template (`developer` is rendered as `system`; text
    content only; an assistant's `tool_calls` with their arguments as objects, a `tool`
    message with its `tool_call_id`)."""
    if not req.messages:
        raise _bad("messages", "messages must contain at least one message.")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role", f"Unsupported role {m.role!r}; expected system, "
                       "developer, user, assistant or tool.")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _message_text(m, i)}
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", "Only assistant messages carry tool_calls.")
            message["tool_calls"] = [_call_in(call, i, k) for k, call in enumerate(m.tool_calls)]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or ""
        out.append(message)
    return out


def _call_in(call: Any, i: int, k: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise _bad(f"messages[{i}].tool_calls[{k}].function.arguments",
                   "Tool call arguments must be JSON text.") from None
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": arguments}}


def _message_text(m: Any, i: int) -> str:
    if m.content is None:
        if m.role != "assistant":
            raise _bad(f"messages[{i}].content", f"messages[{i}].content is required.")
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise _bad(f"messages[{i}].content[{j}]", "Only text content parts are supported.",
                       "unsupported_value")
        parts.append(part.text)
    return "".join(parts)
