"""`ShutdownDrain`: the generation requests in flight when the server shuts down.

On shutdown (the app's `on_shutdown`, after the listening sockets closed and before
aiohttp cancels handlers) the requests in flight get `grace_s` seconds to finish. Past
it, each one still running is cancelled as *shut down*: its handler ends it cleanly, a
stream with an error event (`server_shutting_down`, 503) and `[DONE]`, a JSON request with
a 503 answer, and its backend requests are aborted as on any other exit. A client thus
always learns that its answer is incomplete, never from a connection cut mid-event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Optional

from .errors import SERVER_ERROR, OpenAIError

__all__ = ["ShutdownDrain", "InFlight", "shutting_down_error"]


def shutting_down_error() -> OpenAIError:
    return OpenAIError(503, "The server is shutting down; this request was not finished.",
                       type=SERVER_ERROR, code="server_shutting_down")


class InFlight:
    """One request's handler task; `shut_down` once the drain cancelled it."""

    __slots__ = ("task", "shut_down")

    def __init__(self, task: Optional[asyncio.Task]) -> None:
        self.task, self.shut_down = task, False

    def absorb(self) -> None:
        """Within the handler, on its CancelledError: re-raise unless the drain cancelled
        it (then the handler goes on to end the request cleanly)."""
        if not self.shut_down:
            raise asyncio.CancelledError
        if self.task is not None:
            self.task.uncancel()


class ShutdownDrain:
    """The requests in flight, and the drain of them at shutdown."""

    def __init__(self) -> None:
        self._in_flight: set[InFlight] = set()

    @contextlib.contextmanager
    def track(self) -> Iterator[InFlight]:
        entry = InFlight(asyncio.current_task())
        self._in_flight.add(entry)
        try:
            yield entry
        finally:
            self._in_flight.discard(entry)

    async def drain(self, grace_s: float, settle_s: float = 2.0) -> int:
        """Wait up to `grace_s` for the requests in flight to end; cancel the rest as shut
        down and wait up to `settle_s` for their handlers to answer. Returns how many
        were cut short."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while self._in_flight and loop.time() < end:
            await asyncio.sleep(0.02)
        cut = list(self._in_flight)
        for entry in cut:
            entry.shut_down = True
            if entry.task is not None:
                entry.task.cancel()
        end = loop.time() + settle_s
        while self._in_flight and loop.time() < end:
            await asyncio.sleep(0.01)
        return len(cut)
