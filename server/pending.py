"""A request's mailbox on the event loop that consumes it.

Worker threads (an engine loop, a cluster driver) never touch asyncio objects
directly: they hand items to a request's `Pending` with `post` (one item) or
`deliver_batches` (many requests, one `call_soon_threadsafe` per event loop).
A closed event loop means nobody is listening: the item is dropped.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["Pending", "post", "deliver_batches", "ABORTED"]

ABORTED = object()  # queue item: the request was aborted from outside its consumer


@dataclass(slots=True)
class Pending:
    """The queue of one request in flight, bound to the loop that awaits it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


def post(pending: Pending, item: object) -> None:
    """Put `item` on `pending`'s queue from any thread."""
    try:
        pending.loop.call_soon_threadsafe(pending.queue.put_nowait, item)
    except RuntimeError:  # the consumer's loop is closed
        pass


def deliver_batches(items: Iterable[tuple[Pending, object]]) -> None:
    """Put each (pending, item) on its queue, in order, with one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for pending, item in items:
        by_loop[pending.loop].append((pending.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that event loop is closed; nobody is listening
            pass


def _put_all(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)
