"""What a request's output must match: a JSON schema, any JSON object, a regex, one of
several strings, or a Lark grammar (plain data; `engine/grammars.py` compiles it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["StructuredOutput", "KINDS"]

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# JSON without free whitespace between tokens (a schema's "x-guidance" may ask for it):
# a weak or random model otherwise wanders into whitespace until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """`kind` and its `spec`: a JSON schema as JSON text (`json_schema`), nothing
    (`json_object`), a regex, a JSON list of strings (`choice`) or a Lark grammar
    (`lark`, llguidance's dialect, `%json {...}` included). Construct with the helpers;
    ValueError for a spec of the wrong shape (whether it compiles is checked on admission)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {type(self.spec).__name__}")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as e:
                raise ValueError(f"{self.kind}: not JSON: {e}") from None
            if self.kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise ValueError("json_schema: a schema must be a JSON object")
            if self.kind == "choice" and (not isinstance(value, list) or not value
                                          or not all(isinstance(v, str) for v in value)):
                raise ValueError("choice: must be a non-empty list of strings")

    @classmethod
    def json_schema(cls, schema) -> "StructuredOutput":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options) -> "StructuredOutput":
        return cls("choice", json.dumps(list(options)))

    def grammar(self) -> str:
        """The llguidance grammar text of this spec."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(re.escape(s) for s in json.loads(self.spec)))
        return LLMatcher.grammar_from_lark(self.spec)
