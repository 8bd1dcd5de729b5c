"""`LocalClient`: the `AsyncClient` API over an in-process backend, without HTTP.

    from phalanx.server import start_local
    client = start_local(prefill_tp=1, decode_dp=2)   # blocks while the cluster loads
    async with client:
        done = await client.complete("Hello", max_tokens=8, temperature=0)
        async for chunk in client.stream("Hello", max_tokens=8):
            print(chunk.text, end="")

Same methods, keyword parameters, return types and errors as `AsyncClient`: requests
are validated exactly as the HTTP server does (the same code: `server.handlers`), and
every failure is an `APIError` carrying the status the server would have answered.
Streams end when the generation does (no `[DONE]` object); breaking out of one aborts
its request. Not thread-safe across event loops: use one client from one event loop
at a time.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import msgspec

from ..openai_types import ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList
from ..sdk.errors import APIError

__all__ = ["LocalClient", "start_local"]


def _api_error(e: Exception) -> APIError:
    from .errors import OpenAIError
    if isinstance(e, OpenAIError):
        return APIError(e.status, e.type, e.message, e.param, e.code)
    return APIError(500, "server_error", f"{type(e).__name__}: {e}")


class LocalClient:
    """The OpenAI routes over a `ServingBackend` in this process; an async context manager
    (or call `close()`). The client owns the backend: `close()` closes it."""

    def __init__(self, backend: Any, *, model_name: Optional[str] = None,
                 on_close: Optional[Callable[[], None]] = None) -> None:
        """`model_name`: the id requests may name (default `backend.model_name`); requests
        that name no model use it. `on_close` runs after the backend is closed."""
        from .handlers import GenerationHandlers
        from .metrics import ServerMetrics

        self.backend, self.model = backend, model_name or backend.model_name
        self.metrics = ServerMetrics()
        self._handlers = GenerationHandlers(backend, self.metrics, self.model)
        self._on_close = on_close
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> "LocalClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.backend.close()
        finally:
            self._handlers.close()
            if self._on_close is not None:
                self._on_close()

    # -- the API ---------------------------------------------------------------------
    async def models(self) -> ModelList:
        return ModelList("list", [Model(self.model, "model", 0, "phalanx",
                                        self.backend.max_model_len)])

    async def complete(self, prompt: str | Sequence[int] | Sequence[str], *,
                       model: Optional[str] = None, **params: Any) -> Completion:
        """Like `AsyncClient.complete`: the whole completion."""
        return await self._respond("completion", model, params, prompt=prompt)

    def stream(self, prompt: str | Sequence[int] | Sequence[str], *,
               model: Optional[str] = None, **params: Any) -> AsyncIterator[Completion]:
        """Like `AsyncClient.stream`: yields each chunk (`chunk.text`)."""
        return self._stream("completion", model, params, prompt=prompt)

    async def chat(self, messages: Sequence[dict[str, Any]], *, model: Optional[str] = None,
                   **params: Any) -> ChatCompletion:
        """Like `AsyncClient.chat`: the whole reply (`reply.text`)."""
        return await self._respond("chat", model, params, messages=list(messages))

    def chat_stream(self, messages: Sequence[dict[str, Any]], *, model: Optional[str] = None,
                    **params: Any) -> AsyncIterator[ChatCompletionChunk]:
        """Like `AsyncClient.chat_stream`: yields each chunk."""
        return self._stream("chat", model, params, messages=list(messages))

    # -- plumbing --------------------------------------------------------------------
    async def _plan(self, kind: str, model: Optional[str], params: dict, stream: bool,
                    **fields: Any):
        """The validated plan of a request body built from the keywords (OpenAIError)."""
        from . import protocol as proto

        if self._closed:
            raise APIError(None, "client_closed", "the client is closed")
        body = {"model": model or self.model, **fields, **params}
        if stream:
            body["stream"] = True
        data = msgspec.json.encode(body)
        kind_of = proto.ChatCompletionRequest if kind == "chat" else proto.CompletionRequest
        return await self._handlers.plan(proto.decode_request(data, kind_of))

    async def _respond(self, kind: str, model: Optional[str], params: dict, **fields: Any) -> Any:
        try:
            plan = await self._plan(kind, model, params, False, **fields)
            async with self._handlers.running(plan, time.monotonic()) as runs:
                return await self._handlers.collect(plan, runs)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is an APIError, as over HTTP
            raise _api_error(e) from e

    async def _stream(self, kind: str, model: Optional[str], params: dict,
                      **fields: Any) -> AsyncIterator[Any]:
        try:
            plan = await self._plan(kind, model, params, True, **fields)
            async with self._handlers.running(plan, time.monotonic()) as runs:
                async with aclosing(self._handlers.chunks(plan, runs)) as chunks:
                    async for chunk in chunks:
                        yield chunk
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _api_error(e) from e


def start_local(model: Optional[str | os.PathLike] = None, *, model_name: Optional[str] = None,
                routing_policy: Optional[str] = None,
                progress: Optional[Callable[[str], None]] = None, **kwargs: Any) -> LocalClient:
    """Start a backend in this process and return a `LocalClient` over it (blocks while it
    loads). `kwargs`: `phalanx.LLM`'s keywords (layout, cache, scheduler, `ray_address`);
    the layout rule is `phalanx serve`'s: no layout keyword, the disaggregated default
    (prefill TP=1 -> decode DP=2) on Ray; `tp=1, dp=1`, one in-process engine without
    Ray. If this call starts (or joins) Ray, closing the client shuts it down."""
    from .launch import build_backend

    was_connected = _ray_connected()

    def shutdown_ray() -> None:
        if not was_connected and _ray_connected():
            import ray
            ray.shutdown()

    try:
        backend = build_backend(model, model_name=model_name, routing_policy=routing_policy,
                                progress=progress, **kwargs)
    except BaseException:
        shutdown_ray()
        raise
    return LocalClient(backend, on_close=shutdown_ray)


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())
