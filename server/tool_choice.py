"""`tools` and `tool_choice` of a chat request: which tools the chat template shows the
model, whether its output is parsed for calls, and the grammar that forces a call.

- no tools, or `tool_choice: "none"`: the template gets no tools; nothing is parsed.
- `"auto"` (the default with tools): tools rendered; calls parsed from the output.
- `"required"`: the output must be one or more calls of the given tools;
  `{"type": "function", "function": {"name": N}}`: one call of N. Both are a Lark grammar
  (llguidance `%json` with each tool's parameters schema) over the model's call syntax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from ..engine.structured_output import StructuredOutput
from .errors import OpenAIError

__all__ = ["FunctionSpec", "ToolSpec", "ToolPlan", "tool_plan"]


class FunctionSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: str
    function: FunctionSpec


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """`render`: the tools as the chat template takes them (None: none); `parse`: look for
    calls in the output; `constraint`: the grammar of a required or named call."""

    render: Optional[list[dict[str, Any]]] = None
    parse: bool = False
    constraint: Optional[StructuredOutput] = None


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def tool_plan(tools: Optional[list[ToolSpec]], choice: Any,
              parallel: Optional[bool]) -> ToolPlan:
    """The plan of a request's `tools`/`tool_choice`/`parallel_tool_calls` (400 when they
    do not fit together)."""
    tools = tools or []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise _bad(f"tools[{i}].type", f"tools[{i}].type must be \"function\", got {t.type!r}.")
        if not t.function.name:
            raise _bad(f"tools[{i}].function.name", "A tool needs a name.")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools", "Tool names must be unique.")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise _bad("tool_choice", f"tool_choice {choice!r} needs tools.")
    rendered = [msgspec.to_builtins(t) for t in tools]
    if choice == "auto":
        return ToolPlan(rendered, True)
    if choice == "required":
        return ToolPlan(rendered, True, _call_grammar(tools, parallel is not False))
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise _bad("tool_choice", f"tool_choice names {name!r}, which is not among the tools.")
        return ToolPlan(rendered, True, _call_grammar(chosen, False))
    raise _bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
               "{\"type\": \"function\", \"function\": {\"name\": ...}}.")


_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _call_grammar(tools: list[ToolSpec], several: bool) -> StructuredOutput:
    """One `<tool_call>` block (or several, one per line) whose body is a call of one of
    `tools`: `{"name": <its name>, "arguments": <its parameters>}`."""
    bodies = [{"type": "object",
               "properties": {"name": {"const": t.function.name},
                              "arguments": t.function.parameters or {"type": "object"}},
               "required": ["name", "arguments"], "additionalProperties": False}
              for t in tools]
    schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    schema = {**schema, "x-guidance": _JSON_STYLE}
    repeat = ' ("\\n" call)*' if several else ""
    lark = (f"start: call{repeat}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutput("lark", lark)
