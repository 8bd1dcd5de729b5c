"""The asyncio side shared by the backends whose work happens on one owner thread.

`EngineBackend` (an `EngineLoop` owning one engine) and `ClusterBackend` (a
`ClusterDriver` owning a multi-rank client) are `ThreadedBackend`s. Each request in
flight has a `Pending` (an asyncio queue on the event loop that called `generate`); the
owner thread hands it items through the helpers below (`_deliver`, `_post_to`,
`_end_all`), which never touch asyncio objects from that thread except through
`call_soon_threadsafe` (pending.py). Nothing here calls what the thread owns.

A request's queue holds, in order: the worker's outputs (folded into `TokenDelta`s by
the subclass's `_fold`), and possibly, last, an exception (raised to the consumer) or
`ABORTED` (a last delta with `finish_reason="abort"`).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections import deque
from typing import AsyncIterator, Callable, Iterable, Optional

from ..engine.sampling_params import SamplingParams
from .backend import ServingBackend, TokenDelta
from .owner_thread import OwnerThread
from .pending import ABORTED, Pending, deliver_batches, post

__all__ = ["ThreadedBackend"]


class ThreadedBackend(ServingBackend):
    """`ServingBackend` plumbing over one `OwnerThread` (its "worker").

    Subclasses call `super().__init__()`, then `_start(worker)` once, and implement
    `_fold` (how the worker's items become deltas) and `_refusal` (why new requests
    are refused, if they are). `stats()` is the worker's last published snapshot plus
    `num_pending` (requests with a consumer) and `healthy` (1.0 / 0.0).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _pending and _closed
        self._pending: dict[str, Pending] = {}
        self._closed = False
        self._worker: OwnerThread

    def _start(self, worker: OwnerThread) -> None:
        """Adopt `worker` (its sink must be this backend) and start it; re-raises what
        its `start` raises."""
        self._worker = worker
        worker.start()

    # -- what subclasses provide ---------------------------------------------------
    @abc.abstractmethod
    def _fold(self, backlog: deque, emitted: int) -> TokenDelta:
        """Pop the leading worker items of `backlog` (its head is one: never an error or
        `ABORTED`) and fold them into one delta; a finished item ends the fold. `emitted`:
        tokens the consumer already has."""

    @abc.abstractmethod
    def _refusal(self) -> Optional[Exception]:
        """The error a new request is refused with because the worker cannot serve it
        (None: it can). Called under the lock, so it must be cheap and not block."""

    # -- ServingBackend --------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """See `ServingBackend.generate`; a request the worker cannot take raises the
        subclass's `_refusal()`."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        pending = self._register(request_id)
        done = False
        try:
            self._worker.submit(request_id, list(prompt_token_ids), params)
            backlog: deque = deque()
            emitted = 0
            while not done:
                if not backlog:
                    backlog.append(await pending.queue.get())
                while not pending.queue.empty():
                    backlog.append(pending.queue.get_nowait())
                delta = self._next_delta(backlog, emitted)
                emitted += len(delta.token_ids)
                done = delta.finished
                yield delta
        finally:
            with self._lock:
                if self._pending.get(request_id) is pending:
                    del self._pending[request_id]
            if not done:
                self._worker.abort(request_id)

    def _next_delta(self, backlog: deque, emitted: int) -> TokenDelta:
        """The next delta from the non-empty `backlog`: a queued error is raised, `ABORTED`
        ends the request with an empty "abort" delta at index `emitted`, anything else
        goes to `_fold`."""
        head = backlog[0]
        if isinstance(head, BaseException):
            backlog.clear()
            raise head
        if head is ABORTED:
            backlog.clear()
            return TokenDelta(emitted, [], True, "abort")
        return self._fold(backlog, emitted)

    def _register(self, request_id: str) -> Pending:
        """A queue for `request_id` on the running loop. Raises RuntimeError once closed,
        `_refusal()` when the worker cannot serve, ValueError for an id in flight.
        Checked under the lock, so `close` and `_end_all` (which take it after the
        worker stops or fails) see every request registered before them."""
        pending = Pending(asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                raise RuntimeError("backend is closed")
            refusal = self._refusal()
            if refusal is not None:
                raise refusal
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._pending[request_id] = pending
        return pending

    async def abort(self, request_id: str) -> None:
        """See `ServingBackend.abort`; only enqueues, never waits for the worker."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        self._worker.abort(request_id)
        if pending is not None:
            post(pending, ABORTED)

    def stats(self) -> dict[str, float]:
        """See the class docstring."""
        snapshot = dict(self._worker.stats)
        snapshot["num_pending"] = len(self._pending)
        snapshot["healthy"] = 1.0 if self.healthy() else 0.0
        return snapshot

    def healthy(self) -> bool:
        """False once closed or once the worker thread has ended or failed."""
        return not self._closed and self._worker.alive

    async def close(self) -> None:
        """Stop the worker (off the event loop; waits for what it is doing) and end every
        request in flight with `finish_reason="abort"`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        await asyncio.to_thread(self._worker.stop)
        self._end_all(lambda: ABORTED)

    # -- for the worker's sink methods (called on the worker thread) ----------------
    def _deliver(self, items: Iterable[tuple[str, object]]) -> None:
        """Queue each (request_id, item) for its consumer, in order, with one wake-up per
        event loop; ids without a consumer are skipped."""
        with self._lock:
            batch = [(self._pending[rid], item) for rid, item in items if rid in self._pending]
        deliver_batches(batch)

    def _post_to(self, request_id: str, item: object) -> None:
        """Queue `item` for the request's consumer, if it still has one."""
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None:
            post(pending, item)

    def _end_all(self, make_item: Callable[[], object]) -> None:
        """End every request in flight with a fresh item from `make_item` (an exception
        or `ABORTED`); they no longer have a consumer here."""
        with self._lock:
            pendings = list(self._pending.values())
            self._pending.clear()
        for pending in pendings:
            post(pending, make_item())
