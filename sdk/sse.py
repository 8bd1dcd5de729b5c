"""Reading an OpenAI SSE stream: the `data:` payload of each event, up to `[DONE]`."""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator

__all__ = ["iter_sse_data"]


async def iter_sse_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """`chunks`: the body in pieces of any size (e.g. `response.content.iter_any()`).
    Yield each event's data (multi-line data joined with "\\n"); stop at `[DONE]` or
    at the end of the body. Comments and other fields (`event:`, `id:`) are skipped."""
    buffer = b""
    data: list[bytes] = []
    async for piece in chunks:
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line:
                if line.startswith(b"data:"):
                    data.append(line[5:].removeprefix(b" "))
                continue
            if data:  # a blank line ends the event
                payload = b"\n".join(data)
                data = []
                if payload == b"[DONE]":
                    return
                yield payload
    if data and b"\n".join(data) != b"[DONE]":
        yield b"\n".join(data)
