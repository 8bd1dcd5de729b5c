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
- after a failure the communicator is broken, so the exchanges still queued fail at once;
- on a CUDA device the thread issues its work on a stream of its own: each exchange first
  waits for an event recorded on the submitter's stream at submission (its inputs are
  written), and the submitter's stream waits for the exchange's done event in
  `Pending.wait` (its outputs are written), so the other micro-batch's kernels, queued
  meanwhile on the submitter's stream, overlap it on the device. Tensors an exchange
  returns are marked as used by the submitter's stream (`record_stream`): the allocator
  does not hand their memory to the next exchange while that stream still reads them.
  Every exchange ends on the host after its device work (NCCL polled to completion, gloo
  and the host relay synchronous), so its inputs are free once `wait` returns.

`INLINE` runs each exchange on the caller's thread at submission (one batch per step).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

import torch

from .errors import CollectiveError

__all__ = ["ExchangeWorker", "INLINE", "Pending"]


class Pending:
    """An exchange submitted to a worker: `wait` returns its result or raises its error."""

    __slots__ = ("_done", "_result", "_error", "_event", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._event: Any = None  # CUDA: recorded on the worker's stream after the exchange

    def _finish(self, result: Any, error: Optional[BaseException], event: Any = None) -> None:
        self._result, self._error, self._event = result, error, event
        self._done.set()

    def wait(self, deadline_s: float, epoch: int = -1, rank: int = -1) -> Any:
        if not self._done.wait(deadline_s):
            raise CollectiveError(self.name, epoch, rank,
                                  f"the exchange thread did not finish within {deadline_s:g} s")
        if self._error is not None:
            raise self._error
        if self._event is not None:  # the caller's later kernels run after the exchange
            torch.cuda.current_stream().wait_event(self._event)
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
    """A daemon thread draining a FIFO of exchanges; `close()` ends it. `device`: a
    CUDA device gives the thread a stream of its own there (see the module docstring)."""

    def __init__(self, name: str = "phalanx-exchange",
                 device: Optional[torch.device] = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        cuda = device is not None and torch.device(device).type == "cuda"
        self._device = torch.device(device) if cuda else None
        self._stream = torch.cuda.Stream(self._device) if cuda else None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.submitted = 0

    def submit(self, name: str, fn: Callable[[], Any]) -> Pending:
        pending = Pending(name)
        self.submitted += 1
        ready = consumer = None
        if self._stream is not None:
            consumer = torch.cuda.current_stream(self._device)
            ready = torch.cuda.Event()
            ready.record(consumer)
        self._queue.put((fn, pending, ready, consumer))
        return pending

    def _run(self) -> None:
        # The step's tensors are inference tensors: writing into them needs the mode,
        # which is per thread (as are the current device and stream).
        with torch.inference_mode(), self._on_stream():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                fn, pending, ready, consumer = item
                try:
                    result, done = self._exchange(fn, ready, consumer)
                    pending._finish(result, None, done)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    pending._finish(None, e)

    def _on_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        torch.cuda.set_device(self._device)
        return torch.cuda.stream(self._stream)

    def _exchange(self, fn: Callable[[], Any], ready: Any, consumer: Any) -> tuple[Any, Any]:
        """(fn's result, its done event or None), `fn` ordered after `ready`."""
        if self._stream is None:
            return fn(), None
        self._stream.wait_event(ready)
        result = fn()
        for t in _tensors(result):
            if t.is_cuda:
                t.record_stream(consumer)
        done = torch.cuda.Event()
        done.record(self._stream)
        return result, done

    def close(self, timeout_s: float = 5.0) -> None:
        """End the thread after what is queued (each exchange bounded by its deadline)."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def _tensors(result: Any) -> list[torch.Tensor]:
    """The tensors of an exchange's result (a tensor, or a tuple/list holding some)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []
