"""`Mailbox`: what crosses between a rank's callers (actor threads) and its loop thread.

Invariants:
- the loop thread alone takes inbox items, in the order they were posted;
- every published output and event is handed to exactly one poll;
- a request id is live from its admission until its last output or its abort, and no
  two live requests share an id;
- once the loop has failed, every admission, call and poll raises that failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

from ...engine.outputs import StepOutput
from .spec import RankFailure

__all__ = ["Mailbox"]

CALL_POLL_S = 0.0005  # how often a caller of `call` looks for its reply


class Mailbox:
    """Inbox (kind, item) pairs for the loop; outputs and role events for the callers."""

    def __init__(self) -> None:
        self.lock = threading.Condition()  # reentrant: roles hold it around their own state
        self.wake = threading.Event()  # set with every inbox item: an idle loop takes it now
        self.done = threading.Event()  # the loop has ended
        self.on_post: Callable[[], None] = lambda: None  # also wake the group's idle peers
        self._inbox: list[tuple[str, Any]] = []
        self._outbox: list[StepOutput] = []
        self._events: list = []
        self._live: set[str] = set()
        self._stop = False
        self.failure: Optional[RankFailure] = None

    # -- callers' side ---------------------------------------------------------------
    def post(self, kind: str, item: Any) -> None:
        """Queue an item for the loop thread and wake it."""
        with self.lock:
            self._inbox.append((kind, item))
        self.wake.set()
        self.on_post()

    def admit(self, request_id: str, kind: str, item: Any) -> None:
        """Make `request_id` live and queue `item`; ValueError if it is live already."""
        with self.lock:
            self.raise_if_failed()
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._live.add(request_id)
            self.post(kind, item)

    def claim(self, request_ids: Sequence[str]) -> None:
        """Make every id live at once (none if one is live already or repeated)."""
        with self.lock:
            self.raise_if_failed()
            taken = [rid for rid in request_ids if rid in self._live] + [
                rid for i, rid in enumerate(request_ids) if rid in request_ids[:i]]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use")
            self._live.update(request_ids)

    def release(self, request_ids: Iterable[str]) -> None:
        """Ids that were claimed but never reached the engine are free again."""
        with self.lock:
            self._live.difference_update(request_ids)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._live.discard(request_id)
            self.post("abort", request_id)

    def stop(self) -> None:
        with self.lock:
            self._stop = True
        self.wake.set()

    def call(self, fn: Callable, timeout_s: float, who: str):
        """Have the loop run `fn` (inbox kind "call") and return its result; its exception
        is raised here. TimeoutError if the loop does not get to it within `timeout_s`."""
        reply: list = []
        with self.lock:
            self.raise_if_failed()
            self.post("call", (fn, reply))
        end = time.monotonic() + timeout_s
        while not reply:
            if time.monotonic() > end:
                raise TimeoutError(f"{who}: loop busy for {timeout_s} s")
            with self.lock:
                self.raise_if_failed()
            time.sleep(CALL_POLL_S)
        ok, value = reply[0]
        if not ok:
            raise value
        return value

    def poll(self, timeout_s: float) -> list[StepOutput]:
        """Outputs published since the last poll (waits up to `timeout_s` for some);
        role events stay for `poll_events`."""
        with self.lock:
            if not self._outbox and self.failure is None:
                self.lock.wait(timeout_s)
            self.raise_if_failed()
            out, self._outbox = self._outbox, []
        return out

    def poll_events(self, timeout_s: float) -> tuple[list[StepOutput], list]:
        """(outputs, role events) since the last poll; waits up to `timeout_s` for any."""
        with self.lock:
            if not self._outbox and not self._events and self.failure is None:
                self.lock.wait(timeout_s)
            self.raise_if_failed()
            out, self._outbox = self._outbox, []
            events, self._events = self._events, []
        return out, events

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    # -- the loop's side -------------------------------------------------------------
    def take(self) -> tuple[list[tuple[str, Any]], bool]:
        """The items posted so far, and whether a stop was asked."""
        with self.lock:
            items, self._inbox = self._inbox, []
            return items, self._stop

    def publish(self, outputs: list[StepOutput]) -> None:
        """A step's outputs for the next poll; finished requests leave the live set."""
        if not outputs:
            return
        with self.lock:
            self._outbox.extend(outputs)
            self._live.difference_update(o.request_id for o in outputs if o.finished)
            self.lock.notify_all()

    def publish_events(self, events: list) -> None:
        if not events:
            return
        with self.lock:
            self._events.extend(events)
            self.lock.notify_all()

    def fail(self, failure: RankFailure) -> None:
        with self.lock:
            self.failure = failure
            self.lock.notify_all()
