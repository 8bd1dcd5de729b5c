"""`AsyncClient`: phalanx's (or any OpenAI-compatible server's) HTTP API from asyncio.

    async with AsyncClient("http://127.0.0.1:8000", api_key="secret") as client:
        done = await client.complete("Hello", max_tokens=8, temperature=0)
        print(done.text, done.usage.completion_tokens)
        async for chunk in client.stream("Hello", max_tokens=8):
            print(chunk.text, end="")
        reply = await client.chat([{"role": "user", "content": "Hi"}])

Keyword parameters are sent as JSON fields of the request (`max_tokens`, `temperature`,
`top_p`, `top_k`, `seed`, `stop`, `ignore_eos`, ...); `model` defaults to the first
model the server lists. Connection failures (refused, reset before an answer) and
429/502/503/504 answers are retried up to `max_retries` times with exponential backoff
and jitter; other 4xx/5xx raise `APIError` at once. A stream is retried until its
response starts; after that, a connection that drops mid-stream is resumed (up to
`max_resumes` times) by asking again with the standard `Last-Event-ID` header: a phalanx
server continues the same generation from the next event, so no token is lost or
repeated (a server without resumable streams makes it an `APIConnectionError`).
`phalanx.server.LocalClient` offers the same methods over a backend in this process,
without HTTP.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, AsyncIterator, Optional, Sequence, Type, TypeVar

import aiohttp
import msgspec

from .errors import APIConnectionError, APIError, APITimeoutError
from .sse import iter_sse_events
from ..openai_types import ChatCompletion, ChatCompletionChunk, Completion, ErrorResponse, ModelList

__all__ = ["AsyncClient"]

T = TypeVar("T")
RETRY_STATUSES = frozenset({429, 502, 503, 504})
_error_decoder = msgspec.json.Decoder(ErrorResponse)


class AsyncClient:
    """HTTP client of the OpenAI routes; an async context manager (or call `close()`)."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, *,
                 model: Optional[str] = None, timeout: float = 600.0,
                 connect_timeout: float = 10.0, max_retries: int = 2,
                 backoff_s: float = 0.25, max_backoff_s: float = 8.0,
                 max_resumes: int = 5) -> None:
        """base_url: `http://host:port` or `.../v1`. timeout: seconds for a whole
        non-streamed request, and the longest wait between two chunks of a stream.
        max_retries: extra attempts after a connection failure or a 429/502/503/504.
        max_resumes: reconnections of one stream after its connection dropped."""
        if min(max_retries, max_resumes, backoff_s) < 0 or timeout <= 0 or connect_timeout <= 0:
            raise ValueError("max_retries, max_resumes, backoff_s must be >= 0 and timeouts > 0")
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.retries = 0  # retries performed so far (all requests)
        self.max_resumes = max_resumes
        self.resumes = 0  # streams resumed after a dropped connection so far
        self._headers = {"Accept": "application/json", "User-Agent": "phalanx-sdk"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=connect_timeout)
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout,
                                                     sock_read=timeout)
        self._session: Optional[aiohttp.ClientSession] = None

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncClient":
        self._get_session()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    # -- the API ---------------------------------------------------------------------
    async def models(self) -> ModelList:
        return await self._call("GET", "/models", None, ModelList)

    async def complete(self, prompt: str | Sequence[int] | Sequence[str], *,
                       model: Optional[str] = None, **params: Any) -> Completion:
        """POST /v1/completions; the whole completion."""
        body = await self._body(model, params, prompt=prompt)
        return await self._call("POST", "/completions", body, Completion)

    def stream(self, prompt: str | Sequence[int] | Sequence[str], *,
               model: Optional[str] = None, **params: Any) -> AsyncIterator[Completion]:
        """POST /v1/completions with `stream: true`; yields each chunk (`chunk.text`).
        Pass `stream_options={"include_usage": True}` for a last, usage-only chunk.
        Breaking out early closes the connection (at once under `contextlib.aclosing`),
        which makes the server abort the request."""
        return self._stream("/completions", Completion, model, params, prompt=prompt)

    async def chat(self, messages: Sequence[dict[str, Any]], *, model: Optional[str] = None,
                   **params: Any) -> ChatCompletion:
        """POST /v1/chat/completions; the whole reply (`reply.text`)."""
        body = await self._body(model, params, messages=list(messages))
        return await self._call("POST", "/chat/completions", body, ChatCompletion)

    def chat_stream(self, messages: Sequence[dict[str, Any]], *, model: Optional[str] = None,
                    **params: Any) -> AsyncIterator[ChatCompletionChunk]:
        """POST /v1/chat/completions with `stream: true`; yields each chunk."""
        return self._stream("/chat/completions", ChatCompletionChunk, model, params,
                            messages=list(messages))

    # -- plumbing --------------------------------------------------------------------
    async def _body(self, model: Optional[str], params: dict[str, Any], **fields: Any) -> dict:
        if model is None:
            model = self.model or await self._default_model()
        return {"model": model, **fields, **params}

    async def _default_model(self) -> str:
        listed = await self.models()
        if not listed.data:
            raise APIError(None, "invalid_request_error", "the server lists no model")
        self.model = listed.data[0].id
        return self.model

    async def _call(self, method: str, path: str, body: Optional[dict], cls: Type[T]) -> T:
        """One JSON request/response, retried on connection failures."""
        async def attempt() -> T:
            async with self._get_session().request(method, self.base_url + path, json=body,
                                                   timeout=self._timeout) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    raise _api_error(resp.status, data, resp.headers)
            try:
                return msgspec.json.decode(data, type=cls)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise APIError(resp.status, "invalid_response",
                               f"unexpected {cls.__name__} body: {e}") from None
        return await self._retrying(attempt)

    async def _stream(self, path: str, cls: Type[T], model: Optional[str],
                      params: dict[str, Any], **fields: Any) -> AsyncIterator[T]:
        body = await self._body(model, params, stream=True, **fields)
        decoder = msgspec.json.Decoder(cls)
        last_id: Optional[str] = None
        for resumed in range(self.max_resumes + 1):
            resp = await self._retrying(lambda: self._open_stream(path, body, last_id))
            try:
                async for event_id, payload in iter_sse_events(resp.content.iter_any()):
                    item = _decode_chunk(decoder, payload, resp.status)
                    last_id = event_id
                    yield item
                return
            except asyncio.TimeoutError as e:
                raise APITimeoutError(f"no chunk within the timeout: {e!r}") from e
            except aiohttp.ClientError as e:
                if last_id is None or resumed == self.max_resumes:
                    raise APIConnectionError(f"stream broken: {e!r}") from e
                self.resumes += 1  # the connection dropped: continue after `last_id`
            finally:
                resp.close()

    async def _open_stream(self, path: str, body: dict,
                           last_id: Optional[str]) -> aiohttp.ClientResponse:
        headers = {"Last-Event-ID": last_id} if last_id is not None else None
        resp = await self._get_session().post(self.base_url + path, json=body,
                                              headers=headers, timeout=self._stream_timeout)
        if resp.status >= 400:
            data = await resp.read()
            resp.release()
            raise _api_error(resp.status, data, resp.headers)
        return resp

    async def _retrying(self, attempt):
        """Run `attempt()`; retry connection failures and RETRY_STATUSES with backoff."""
        for n in range(self.max_retries + 1):
            last = n == self.max_retries
            try:
                return await attempt()
            except asyncio.TimeoutError as e:  # aiohttp's timeouts derive from it
                raise APITimeoutError(f"request timed out: {e!r}") from e
            except aiohttp.ClientConnectionError as e:
                if last:
                    raise APIConnectionError(f"connection failed after {n + 1} attempts: "
                                             f"{e!r}") from e
                delay = self._delay(n, None)
            except _RetryableStatus as e:
                if last:
                    raise e.error from None
                delay = self._delay(n, e.retry_after)
            self.retries += 1
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: Optional[float]) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        base = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
        return base * (0.5 + random.random() / 2)


class _RetryableStatus(Exception):
    """An APIError whose status is worth another attempt."""

    def __init__(self, error: APIError, retry_after: Optional[float]) -> None:
        super().__init__(str(error))
        self.error, self.retry_after = error, retry_after


def _decode_chunk(decoder: msgspec.json.Decoder, payload: bytes, status: int) -> Any:
    """A stream chunk, or the APIError of an in-stream `{"error": ...}` event."""
    try:
        return decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        error = _api_error(status, payload, {})
        if isinstance(error, APIError) and error.type != "http_error":
            raise error from None
        raise APIError(status, "invalid_response",
                       f"unexpected stream event: {payload[:200]!r}") from None


def _api_error(status: int, data: bytes, headers: Any) -> Exception:
    """The typed error of an error body (wrapped for retry when the status allows)."""
    try:
        detail = _error_decoder.decode(data).error
        error = APIError(status, detail.type, detail.message, detail.param, detail.code)
    except (msgspec.DecodeError, msgspec.ValidationError):
        error = APIError(status, "http_error", data[:500].decode("utf-8", "replace"))
    if status in RETRY_STATUSES:
        try:
            retry_after = float(headers.get("Retry-After", ""))
        except ValueError:
            retry_after = None
        return _RetryableStatus(error, retry_after)
    return error
