"""The skeleton of a thread that owns objects which are not thread-safe.

`EngineLoop` (one `LLMEngine`) and `ClusterDriver` (a multi-rank client and its router)
are `OwnerThread`s: every call on what they own happens on their thread. Other threads
only enqueue commands into the inbox (`submit`, `abort`, `stop`) and read two fields the
thread publishes: `stats` (replaced by a fresh dict, never mutated) and `failure` (set
before the sink hears of a failure). Commands are applied on the thread, in the order
they were enqueued, by `_drain`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Optional

from ..engine.sampling_params import SamplingParams

__all__ = ["OwnerThread", "STOP"]

STOP = object()  # inbox item: end the thread


class OwnerThread:
    """One daemon thread fed through an inbox of commands.

    Subclasses implement, all called on the thread:
      `_run()`: the thread's body; it calls `_drain` to apply queued commands and
        returns once `_drain` answers False (a `stop`).
      `_apply_submit(request_id, prompt_token_ids, params)`: take a request (a refusal
        goes to the sink, never raised to the submitter).
      `_apply_abort(request_id)`: drop a request; unknown ids are ignored.
    `sink` receives what the thread produces; its methods are called on the thread and
    must return quickly (hand off to another thread or event loop, never block).
    """

    def __init__(self, sink: Any, name: str) -> None:
        self._sink = sink
        self._inbox: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.failure: Optional[BaseException] = None  # set before the sink hears of it
        self.stats: dict[str, float] = {}

    # -- any thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the thread runs and has not failed."""
        return self._thread.is_alive() and self.failure is None

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; a refusal arrives later through the sink."""
        self._inbox.put(("submit", request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        """Queue the abort of a request (unknown or finished ids are ignored)."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: Optional[float] = None) -> None:
        """Ask the thread to end (it aborts what is in flight on its way out; subclasses
        say what else it does) and wait for it. A no-op once the thread has ended."""
        if self._thread.is_alive():
            self._inbox.put(STOP)
            self._thread.join(timeout)

    # -- the owner thread ------------------------------------------------------------
    def _run(self) -> None:
        raise NotImplementedError

    def _apply_submit(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> None:
        raise NotImplementedError

    def _apply_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _drain(self, block: bool, timeout: Optional[float] = None) -> bool:
        """Apply every queued command; when `block`, first wait for one (up to `timeout`
        seconds; None: no limit). Returns False on `stop` (commands queued after it
        stay unapplied), True otherwise."""
        try:
            cmd = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is STOP:
                return False
            if cmd[0] == "submit":
                self._apply_submit(*cmd[1:])
            else:
                self._apply_abort(cmd[1])
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True
