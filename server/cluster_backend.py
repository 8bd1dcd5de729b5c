"""`ServingBackend` over one multi-rank client (a colocated TP / DP×EP group, or the
disaggregated layout), with prefix-aware placement over its DP groups.

A `ClusterDriver` thread owns the client and the router (cluster_driver.py); this
class is the asyncio side, a `ThreadedBackend` (threaded_backend.py: request queues,
`generate`, `abort`, `close`). The driver hands each request's queue the `TokenDelta`s
that its `RequestRecord` let through (each output index once, in order). Nothing here
calls the client from an event loop thread.

A rank's death is recovered inside the client (its groups re-form and the requests
continue). When the client gives up (`GroupFailure`: more re-formations than the
restart intensity allows), every request in flight ends with a 503 `OpenAIError` (code
`backend_failed`), `healthy()` turns False (`/health` answers 503) and new requests
are refused with the same error.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from ..log import get_logger
from ..router import Router
from .backend import TokenDelta
from .cluster_driver import ClusterDriver, DriverConfig
from .errors import SERVER_ERROR, OpenAIError
from .threaded_backend import ThreadedBackend

log = get_logger(__name__)

__all__ = ["ClusterBackend"]


def _unavailable(error: BaseException) -> OpenAIError:
    return OpenAIError(503, f"The serving cluster failed and cannot complete requests: "
                       f"{str(error)[:300]}", type=SERVER_ERROR, code="backend_failed")


class ClusterBackend(ThreadedBackend):
    """Requests of any number of asyncio consumers, routed over one multi-rank client.

    `stats()`: the driver's last snapshot (cluster_stats.py) plus `num_pending`
    (requests with a consumer) and `healthy` (1.0 / 0.0). `close()` stops the driver
    (aborting what is live, closing the client). Once the cluster failed, `generate`
    raises a 503 `OpenAIError` (requests in flight end with one too)."""

    def __init__(self, client: Any, *, model_name: str, max_model_len: int, tokenizer: Any,
                 router: Optional[Router] = None, config: DriverConfig = DriverConfig(),
                 close_client: Optional[Callable[[], None]] = None,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        """`client`: an `actors.cluster.ClusterClient` (`GroupClient`, `DisaggClient`),
        handed over to the driver thread: nobody else may call it from now on.
        `close_client` (default `client.close`) runs on that thread at `close()`.
        `router`: default one built from `client.topology()` with `config`'s policy.
        `eos_token_ids`: the model's (ServingBackend documents them)."""
        super().__init__()
        self.model_name, self.max_model_len, self.tokenizer = model_name, max_model_len, tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._driver = ClusterDriver(client, self, router=router, config=config,
                                     close_client=close_client)
        self._start(self._driver)

    @property
    def router(self) -> Router:
        """The driver's router (read it from another thread only for diagnostics)."""
        return self._driver.router

    @property
    def layout(self):
        return self._driver.layout

    # -- ThreadedBackend -------------------------------------------------------------
    def _fold(self, backlog: deque, emitted: int) -> TokenDelta:
        """Fold the leading `TokenDelta`s of `backlog` into one (they are contiguous: the
        driver forwards each output index once, in order); a lone one is returned as is."""
        delta: TokenDelta = backlog.popleft()
        while not delta.finished and backlog and isinstance(backlog[0], TokenDelta):
            delta = delta.merged(backlog.popleft())
        return delta

    def _refusal(self) -> Optional[Exception]:
        failure = self._driver.failure
        return None if failure is None else _unavailable(failure)

    # -- DriverSink (called on the driver thread) ------------------------------------
    def on_deltas(self, deltas: list[tuple[str, TokenDelta]]) -> None:
        self._deliver(deltas)

    def on_error(self, request_id: str, error: Exception) -> None:
        if self._driver.failure is not None:
            error = _unavailable(self._driver.failure)
        self._post_to(request_id, error)

    def on_failure(self, error: BaseException) -> None:
        self._end_all(lambda: _unavailable(error))
