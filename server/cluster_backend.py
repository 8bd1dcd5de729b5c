"""`ServingBackend` over one multi-rank client (a colocated TP / DP×EP group, or the
disaggregated layout), with prefix-aware placement over its DP groups.

A `ClusterDriver` thread owns the client and the router (cluster_driver.py); this
class is the asyncio side. Each request in flight has a queue on the event loop that
called `generate`; the driver hands it `TokenDelta`s that its `RequestRecord` let
through (each output index once, in order). Nothing here calls the client from an
event loop thread.

When the client fails (a rank died: `GroupFailure`), every request in flight ends with
a 503 `OpenAIError` (code `backend_failed`), `healthy()` turns False (`/health` answers
503) and new requests are refused with the same error. Recovering decode groups is a
later step.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable, Optional

from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from ..router import Router
from .backend import ServingBackend, TokenDelta
from .cluster_driver import ClusterDriver, DriverConfig
from .errors import SERVER_ERROR, OpenAIError
from .pending import ABORTED, Pending, deliver_batches, post

log = get_logger(__name__)

__all__ = ["ClusterBackend"]


def _unavailable(error: BaseException) -> OpenAIError:
    return OpenAIError(503, f"The serving cluster failed and cannot complete requests: "
                       f"{str(error)[:300]}", type=SERVER_ERROR, code="backend_failed")


class ClusterBackend(ServingBackend):
    """Requests of any number of asyncio consumers, routed over one multi-rank client."""

    def __init__(self, client: Any, *, model_name: str, max_model_len: int, tokenizer: Any,
                 router: Optional[Router] = None, config: DriverConfig = DriverConfig(),
                 close_client: Optional[Callable[[], None]] = None) -> None:
        """`client`: a `GroupClient` or `DisaggClient` (or anything with their duck-typed
        interface), handed over to the driver thread: nobody else may call it from now
        on. `close_client` (default `client.close`) runs on that thread at `close()`.
        `router`: default one built from `client.topology()` with `config`'s policy."""
        self.model_name, self.max_model_len, self.tokenizer = model_name, max_model_len, tokenizer
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self._closed = False
        self._driver = ClusterDriver(client, self, router=router, config=config,
                                     close_client=close_client)
        self._driver.start()

    @classmethod
    def from_llm(cls, llm: Any, *, model_name: Optional[str] = None,
                 config: DriverConfig = DriverConfig()) -> "ClusterBackend":
        """Serve the multi-rank group an `LLM` built (ValueError for a single-rank one:
        use `EngineBackend`). The backend owns the LLM from now on: `close()` closes it."""
        if llm.group is None:
            raise ValueError("this LLM runs a single in-process engine (tp = dp = 1): serve "
                             "it with EngineBackend")
        path = llm.config.model_path
        return cls(llm.group, model_name=model_name or os.path.basename(os.path.normpath(path)),
                   max_model_len=llm.config.max_model_len, tokenizer=llm.tokenizer,
                   config=config, close_client=llm.close)

    @property
    def router(self) -> Router:
        """The driver's router (read it from another thread only for diagnostics)."""
        return self._driver.router

    @property
    def layout(self):
        return self._driver.layout

    # -- ServingBackend --------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """See `ServingBackend.generate`; a failed cluster raises a 503 `OpenAIError`."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        pending = self._register(request_id)
        done = False
        try:
            self._driver.submit(request_id, list(prompt_token_ids), params)
            backlog: deque = deque()
            emitted = 0
            while not done:
                if not backlog:
                    backlog.append(await pending.queue.get())
                while not pending.queue.empty():
                    backlog.append(pending.queue.get_nowait())
                delta = _next_delta(backlog, emitted)
                emitted += len(delta.token_ids)
                done = delta.finished
                yield delta
        finally:
            with self._lock:
                if self._pending.get(request_id) is pending:
                    del self._pending[request_id]
            if not done:
                self._driver.abort(request_id)

    def _register(self, request_id: str) -> Pending:
        pending = Pending(asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                raise RuntimeError("backend is closed")
            if self._driver.failure is not None:
                raise _unavailable(self._driver.failure)
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._pending[request_id] = pending
        return pending

    async def abort(self, request_id: str) -> None:
        """See `ServingBackend.abort`; only enqueues, never waits for the cluster."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        self._driver.abort(request_id)
        if pending is not None:
            post(pending, ABORTED)

    def stats(self) -> dict[str, float]:
        """The driver's last snapshot (cluster_stats.py) plus `num_pending` (requests
        with a consumer) and `healthy` (1.0 / 0.0)."""
        snapshot = dict(self._driver.stats)
        snapshot["num_pending"] = len(self._pending)
        snapshot["healthy"] = 1.0 if self.healthy() else 0.0
        return snapshot

    def healthy(self) -> bool:
        return not self._closed and self._driver.alive

    async def close(self) -> None:
        """Stop the driver (aborting what is live, closing the client) and end every
        request in flight with `finish_reason="abort"`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        await asyncio.to_thread(self._driver.stop)
        self._end_all(lambda: ABORTED)

    # -- DriverSink (called on the driver thread) ------------------------------------
    def on_deltas(self, deltas: list[tuple[str, TokenDelta]]) -> None:
        with self._lock:
            items = [(self._pending[rid], d) for rid, d in deltas if rid in self._pending]
        deliver_batches(items)

    def on_error(self, request_id: str, error: Exception) -> None:
        if self._driver.failure is not None:
            error = _unavailable(self._driver.failure)
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None:
            post(pending, error)

    def on_failure(self, error: BaseException) -> None:
        self._end_all(lambda: _unavailable(error))

    def _end_all(self, make_item: Callable[[], object]) -> None:
        with self._lock:
            pendings = list(self._pending.values())
            self._pending.clear()
        for pending in pendings:
            post(pending, make_item())


def _next_delta(backlog: deque, emitted: int) -> TokenDelta:
    """Fold the leading deltas of `backlog` into one; raise a queued error. `emitted`:
    tokens the consumer already has (the index of an abort's empty last delta)."""
    head = backlog[0]
    if isinstance(head, BaseException):
        backlog.clear()
        raise head
    if head is ABORTED:
        backlog.clear()
        return TokenDelta(emitted, [], True, "abort")
    first: TokenDelta = backlog.popleft()
    if first.finished or not backlog or not isinstance(backlog[0], TokenDelta):
        return first
    tokens = list(first.token_ids)
    while backlog and isinstance(backlog[0], TokenDelta):
        d: TokenDelta = backlog.popleft()
        tokens.extend(d.token_ids)
        if d.finished:
            return TokenDelta(first.index, tokens, True, d.finish_reason, d.num_cached_tokens)
    return TokenDelta(first.index, tokens)
