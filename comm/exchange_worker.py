"""`ExchangeWorker`: one thread that runs a rank's world exchanges in the order they were
submitted, so that a step's two micro-batches overlap one's MoE dispatch or combine with
the other's compute (two-batch overlap, ARCHITECTURE §3).

Invariants:
- every rank of a world submits the same exchanges in the same order (the step's stage
  schedule is the same on every rank), and only this thread issues world exchanges while
  any is pending, so the collectives meet in order; TP collectives stay on the caller's
  thread (their own group and channels);
- every exchange is bounded by its communicator's deadline; `Pending.wait` adds its own
  deadline on top (a backstop: a thread stuck past it fails the step with
  `CollectiveError`, never a hang);
- after a failure the communicator is broken, so the exchanges still queued fail at once.

`INLINE` runs each exchange on the caller's thread at submission (one batch per step).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from .errors import CollectiveError

__all__ = ["ExchangeWorker", "INLINE", "Pending"]


class Pending:
    """An exchange submitted to a worker: `wait` returns its result or raises its error."""

    __slots__ = ("_done", "_result", "_error", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        self._result, self._error = result, error
        self._done.set()

    def wait(self, deadline_s: float, epoch: int = -1, rank: int = -1) -> Any:
        if not self._done.wait(deadline_s):
            raise CollectiveError(self.name, epoch, rank,
                                  f"the exchange thread did not finish within {deadline_s:g} s")
        if self._error is not None:
            raise self._error
        return self._result


class _Inline:
    """Runs an exchange at submission on the caller's thread."""

    def submit(self, name: str, fn: Callable[[], Any]) -> Pending:
        pending = Pending(name)
        try:
            pending._finish(fn(), None)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait, on the same thread
            pending._finish(None, e)
        return pending


INLINE = _Inline()


class ExchangeWorker:
    """A daemon thread draining a FIFO of exchanges; `close()` ends it."""

    def __init__(self, name: str = "phalanx-exchange") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.submitted = 0

    def submit(self, name: str, fn: Callable[[], Any]) -> Pending:
        pending = Pending(name)
        self.submitted += 1
        self._queue.put((fn, pending))
        return pending

    def _run(self) -> None:
        # The step's tensors are inference tensors: writing into them needs the mode,
        # which is per thread.
        with torch.inference_mode():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                fn, pending = item
                try:
                    pending._finish(fn(), None)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    pending._finish(None, e)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the thread after what is queued (each exchange bounded by its deadline)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
