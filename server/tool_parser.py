"""Tool calls in a Qwen3-style model's output: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks, whole (`parse`) or as they stream (`ToolCallStream`).

Text outside the blocks is the message's content. A block whose body is not a JSON object
with a string `name` stays content (the model did not make a call). Each call gets an id
(`call_` + 24 hex digits) and its `arguments` as a JSON string, as the OpenAI API has it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Optional

__all__ = ["ToolCall", "parse", "ToolCallStream", "OPEN", "CLOSE"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


def _call(body: str) -> Optional[ToolCall]:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{secrets.token_hex(12)}", value["name"],
                    json.dumps(args, ensure_ascii=False))


def parse(text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a whole output; content is None when only calls remain."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    tail, more = stream.finish()
    content += tail
    calls += more
    if calls:
        return content.strip() or None, calls
    return content, calls


class ToolCallStream:
    """Splits streamed text into content and completed tool calls. Text that may be the
    start of `<tool_call>` is held back until it is known not to be; a call is emitted
    whole once its closing tag arrives."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to emit now, calls completed now)."""
        self._buf += text
        content, calls = [], []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                body, self._buf, self._inside = self._buf[:end], self._buf[end + len(CLOSE):], False
                call = _call(body.strip())
                if call is None:  # not a call after all: give the text back as content
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                content.append(self._buf[:start])
                self._buf, self._inside = self._buf[start + len(OPEN):], True
                continue
            keep = _partial_suffix(self._buf, OPEN)
            if self.num_calls and not self._buf.strip():
                keep = len(self._buf)  # whitespace between or after calls: held
            content.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: held text, or an unclosed block, as content."""
        rest = (OPEN if self._inside else "") + self._buf
        if self.num_calls and not rest.strip():
            rest = ""
        self._buf, self._inside = "", False
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
