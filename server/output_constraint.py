"""An output constraint from the fields clients send for one: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
`grammar` in Lark or GBNF, `json_object`) and its older `guided_*` fields."""

from __future__ import annotations

from typing import Any

from ..engine.structured_output import StructuredOutput

__all__ = ["constraint_of"]


def constraint_of(name: str, value: Any) -> StructuredOutput:
    """The constraint field `name` holding `value` asks for; ValueError or TypeError
    saying what is wrong with it."""
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        options = {k: v for k, v in value.items() if v not in (None, False)}
        if len(options) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, "
                             "choice, grammar, json_object")
        ((key, option),) = options.items()
        return _vllm_constraint(key, option)
    return _vllm_constraint(name.removeprefix("guided_"), value)


def _response_format(value: dict[str, Any]) -> StructuredOutput:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise ValueError("json_schema must be {\"name\": ..., \"schema\": {...}}")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON object")
        return StructuredOutput.json_schema(schema)
    raise ValueError(f"type must be text, json_object or json_schema, got {kind!r}")


def _vllm_constraint(key: str, option: Any) -> StructuredOutput:
    if key == "json":
        return StructuredOutput.json_schema(option)
    if key == "json_object":
        return StructuredOutput("json_object")
    if key == "regex" and isinstance(option, str):
        return StructuredOutput("regex", option)
    if key == "choice" and isinstance(option, list):
        return StructuredOutput.choice(option)
    if key == "grammar" and isinstance(option, str):
        if "::=" in option:  # GBNF (llama.cpp / xgrammar EBNF): llguidance converts it
            from llguidance.gbnf_to_lark import gbnf_to_lark
            option = gbnf_to_lark(option)
        return StructuredOutput("lark", option)
    raise ValueError(f"unknown or malformed constraint {key!r}")
