"""Resumable SSE streams: a stream's events outlive its connection for a grace period.

Every event of a stream carries an SSE `id:` `<stream id>/<index>` (index: the event's
position, `[DONE]` included). The stream is produced by a task of its own into a
`StreamLog`, not by the HTTP handler: a handler only *follows* the log from an index.
A client whose connection dropped sends the same route again with the standard
`Last-Event-ID` header (the last id it read); the server follows the log from the next
index, so every event reaches the client exactly once, in order.

Lifetimes: while no handler follows a running stream, it runs on for `grace_s` seconds;
if nobody attaches by then its producer is cancelled (the backend requests aborted, as
on a dropped connection without resumption). An ended stream's log is kept `grace_s`
seconds for late resumptions, then dropped (a resumption then gets 404
`stream_not_found`). Plain asyncio; no HTTP here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Optional

__all__ = ["StreamLog", "ResumableStreams", "parse_event_id"]


def parse_event_id(text: str) -> Optional[tuple[str, int]]:
    """(stream id, index) of a `Last-Event-ID`, or None when it is not one of ours."""
    sid, sep, index = text.strip().rpartition("/")
    if not sep or not sid or not index.isdigit():
        return None
    return sid, int(index)


class StreamLog:
    """One stream's event payloads in order (appended by its producer) and whether it
    ended; any number of followers read it from any index."""

    __slots__ = ("id", "events", "ended", "_wake", "followers", "producer", "_idle")

    def __init__(self, stream_id: str) -> None:
        self.id = stream_id
        self.events: list[bytes] = []
        self.ended = False
        self._wake = asyncio.Event()
        self.followers = 0
        self.producer: Optional[asyncio.Task] = None
        self._idle: Optional[asyncio.TimerHandle] = None

    def push(self, payload: bytes) -> None:
        self.events.append(payload)
        self._wake.set()

    def end(self) -> None:
        self.ended = True
        self._wake.set()

    async def follow(self, start: int) -> AsyncIterator[tuple[int, bytes]]:
        """(index, payload) from `start` on, waiting for new ones, until the end."""
        i = start
        while True:
            while i < len(self.events):
                yield i, self.events[i]
                i += 1
            if self.ended:
                return
            self._wake.clear()
            if i == len(self.events) and not self.ended:
                await self._wake.wait()


class ResumableStreams:
    """The streams of one server, by id."""

    def __init__(self, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._logs: dict[str, StreamLog] = {}

    def __len__(self) -> int:
        return len(self._logs)

    def get(self, stream_id: str) -> Optional[StreamLog]:
        return self._logs.get(stream_id)

    def open(self, stream_id: str, produce: Callable[[StreamLog], Awaitable[None]]) -> StreamLog:
        """A new stream whose events `produce(log)` pushes (on a task of its own)."""
        log = StreamLog(stream_id)
        self._logs[stream_id] = log
        log.producer = asyncio.ensure_future(self._run(log, produce))
        return log

    async def _run(self, log: StreamLog, produce: Callable[[StreamLog], Awaitable[None]]) -> None:
        try:
            await produce(log)
        finally:
            log.end()
            asyncio.get_running_loop().call_later(self.grace_s, self._drop, log)

    def _drop(self, log: StreamLog) -> None:
        if self._logs.get(log.id) is log:
            del self._logs[log.id]

    @contextlib.contextmanager
    def attach(self, log: StreamLog) -> Iterator[StreamLog]:
        """Within: a follower reads `log`; the last one leaving a running stream starts
        its grace period."""
        if log._idle is not None:
            log._idle.cancel()
            log._idle = None
        log.followers += 1
        try:
            yield log
        finally:
            log.followers -= 1
            if log.followers == 0 and not log.ended:
                log._idle = asyncio.get_running_loop().call_later(
                    self.grace_s, self._abandon, log)

    @staticmethod
    def _abandon(log: StreamLog) -> None:
        log._idle = None
        if log.followers == 0 and not log.ended and log.producer is not None:
            log.producer.cancel()

    async def close(self) -> None:
        """Cancel every running producer and wait for them (shutdown)."""
        tasks = [log.producer for log in self._logs.values()
                 if log.producer is not None and not log.producer.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
