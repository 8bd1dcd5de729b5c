"""Server-sent events in the OpenAI shape: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`,
each with an `id:` line when resumable (resumable.py)."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

__all__ = ["SSEStream"]

_encoder = msgspec.json.Encoder()


class SSEStream:
    """One streaming response. Writes raise `ConnectionResetError` once the client
    has gone (aiohttp's `ClientConnectionResetError` is a subclass)."""

    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # no proxy buffering
            **(headers or {}),
        })

    async def start(self) -> None:
        """Send the status line and headers."""
        await self.response.prepare(self._request)

    async def send(self, payload: Any) -> None:
        """One event: a msgspec Struct or any JSON-encodable object."""
        await self.response.write(b"data: " + _encoder.encode(payload) + b"\n\n")

    async def event(self, event_id: str, payload: bytes) -> None:
        """One event with its SSE id; `payload`: the encoded data (or `[DONE]`)."""
        await self.response.write(b"id: " + event_id.encode() + b"\ndata: " + payload + b"\n\n")

    async def end(self) -> None:
        await self.response.write_eof()

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
