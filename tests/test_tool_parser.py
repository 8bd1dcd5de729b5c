"""The Qwen3 tool-call parser, whole and streamed at every split."""

from __future__ import annotations

import json

import pytest

from phalanx.server.tool_parser import ToolCallStream, parse

TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
       '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def test_whole_output():
    content, calls = parse(TWO)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id
    only = parse('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert only[0] is None and only[1][0].name == "f" and only[1][0].arguments == "{}"
    assert parse("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "<tool_call>{\"name\": \"f\"",
    "a < b and <tool", "<tool_call"])
def test_what_is_not_a_call_stays_content(text):
    content, calls = parse(text)
    assert calls == [] and content == text


def test_arguments_given_as_a_string_are_normalised():
    (call,) = parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1]
    assert json.loads(call.arguments) == {"x": 1}


@pytest.mark.parametrize("step", [1, 2, 3, 7, 13])
def test_streamed_at_every_split_equals_whole(step):
    for text in (TWO, "plain < text <tool_ and more", "<tool_call>bad</tool_call> after"):
        stream = ToolCallStream()
        content, calls = "", []
        for i in range(0, len(text), step):
            c, k = stream.feed(text[i:i + step])
            content += c
            calls += k
        c, k = stream.finish()
        content, calls = content + c, calls + k
        whole_content, whole_calls = parse(text)
        assert content.strip() == (whole_content or "").strip()
        assert [(c.name, c.arguments) for c in calls] == \
            [(c.name, c.arguments) for c in whole_calls]
