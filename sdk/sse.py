"""Reading an OpenAI SSE stream: each event's id and `data:` payload, up to `[DONE]`."""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Optional

__all__ = ["iter_sse_data", "iter_sse_events"]


async def iter_sse_events(chunks: AsyncIterable[bytes]
                          ) -> AsyncIterator[tuple[Optional[str], bytes]]:
    """`chunks`: the body in pieces of any size (e.g. `response.content.iter_any()`).
    Yield (the event's `id:` or None, its data: multi-line data joined with "\\n"); stop
    at `[DONE]` or at the end of the body. Comments and other fields are skipped."""
    buffer = b""
    data: list[bytes] = []
    event_id: Optional[str] = None
    async for piece in chunks:
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line:
                if line.startswith(b"data:"):
                    data.append(line[5:].removeprefix(b" "))
                elif line.startswith(b"id:"):
                    event_id = line[3:].removeprefix(b" ").decode(errors="replace")
                continue
            if data:  # a blank line ends the event
                payload = b"\n".join(data)
                data = []
                if payload == b"[DONE]":
                    return
                yield event_id, payload
            event_id = None
    if data and b"\n".join(data) != b"[DONE]":
        yield event_id, b"\n".join(data)


async def iter_sse_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The data of each event of `iter_sse_events`."""
    async for _, payload in iter_sse_events(chunks):
        yield payload
