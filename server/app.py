"""The aiohttp application: routes, API-key check, body cap, errors, metrics, logging.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE),
`GET /v1/models`, `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`
(tokenizer_routes.py), `GET /version`, `GET|HEAD /health`, `GET /metrics` (Prometheus
text). With an API key, every route but `/health` and `/version` needs `Authorization:
Bearer <key>` (401 otherwise). Every error, including aiohttp's own (unknown route 404,
wrong method 405, body over the cap 413), is answered in the OpenAI shape (errors.py).
Each request has an id, the client's `X-Request-Id` when it sends one (kept as given:
up to 128 visible ASCII characters), else one of ours (a generation's: its completion
id); it is the response's `X-Request-Id` and is logged with route, status and duration.
Cross-origin access: cors.py (off unless `allowed_origins`).
"""

from __future__ import annotations

import hmac
import re
import time
import uuid
from typing import Awaitable, Callable, Optional, Sequence

import msgspec
from aiohttp import web

from ..version import __version__
from ..log import get_logger
from ..openai_types import Model, ModelList, Version
from .backend import ServingBackend
from .cors import CorsPolicy
from .errors import SERVER_ERROR, OpenAIError, from_http_exception, too_large
from .handlers import GenerationHandlers
from .metrics import CONTENT_TYPE, ServerMetrics
from .request_keys import ARRIVAL, CLIENT_ID, REQUEST_ID
from .responses import ResponsesRoute
from .tokenizer_routes import TokenizerRoutes

log = get_logger("phalanx.server")

__all__ = ["create_app", "BACKEND_KEY", "METRICS_KEY", "DEFAULT_MAX_BODY_BYTES"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
BACKEND_KEY: web.AppKey[ServingBackend] = web.AppKey("backend", ServingBackend)
METRICS_KEY: web.AppKey[ServerMetrics] = web.AppKey("metrics", ServerMetrics)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_UNAUTHENTICATED = frozenset({"/health", "/version"})
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII, no spaces


def create_app(backend: ServingBackend, *, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               served_model_name: Optional[str] = None,
               allowed_origins: Sequence[str] = (),
               shutdown_grace_s: float = 3.0,
               stream_resume_s: float = 10.0,
               metrics_without_key: bool = False) -> web.Application:
    """An OpenAI-compatible app over `backend`.

    api_key: when set, required as a Bearer token on every route but /health, /version
        (and /metrics with `metrics_without_key`: Prometheus scrapers and load generators
        that read it without the key, as vLLM leaves it open).
    max_body_bytes: request bodies above this are answered 413.
    served_model_name: the model id clients must send (default `backend.model_name`).
    allowed_origins: origins (or "*") whose browser pages may call the API (cors.py).
    shutdown_grace_s: at shutdown, how long requests in flight may still run before each
        is ended with a 503 (a stream: an error event and `[DONE]`; drain.py).
    stream_resume_s: how long a stream whose connection dropped keeps generating for a
        client that resumes it with `Last-Event-ID` (resumable.py); 0: aborted at once.
    The app does not own the backend: closing it is the caller's job.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    model_name = served_model_name or backend.model_name
    metrics = ServerMetrics(model_name)
    cors = CorsPolicy(allowed_origins) if allowed_origins else None
    app = web.Application(client_max_size=max_body_bytes, middlewares=[
        _error_middleware(metrics, max_body_bytes),
        *([cors.middleware] if cors else []),
        _auth_middleware(api_key, _UNAUTHENTICATED | ({"/metrics"} if metrics_without_key
                                                      else set()))])
    if cors:
        cors.install(app)
    app[BACKEND_KEY] = backend
    app[METRICS_KEY] = metrics
    gen = GenerationHandlers(backend, metrics, model_name, resume_grace_s=stream_resume_s)

    async def close_handlers(app: web.Application) -> None:
        gen.close()

    async def drain(app: web.Application) -> None:
        cut = await gen.drain.drain(shutdown_grace_s)
        await gen.streams.close()  # streams nobody follows any more
        if cut:
            log.info("shutdown_cut_requests", requests=cut, grace_s=shutdown_grace_s)

    app.on_shutdown.append(drain)
    app.on_cleanup.append(close_handlers)
    app.router.add_post("/v1/completions", gen.completions)
    app.router.add_post("/v1/chat/completions", gen.chat)
    app.router.add_post("/v1/responses", ResponsesRoute(gen).create)
    tokens = TokenizerRoutes(gen)
    app.router.add_post("/tokenize", tokens.tokenize)
    app.router.add_post("/detokenize", tokens.detokenize)
    _add_info_routes(app, backend, gen, metrics, model_name)
    return app


def _add_info_routes(app: web.Application, backend: ServingBackend, gen: GenerationHandlers,
                     metrics: ServerMetrics, model_name: str) -> None:
    """`/v1/models`, `/v1/models/{id}`, `/version`, `/health`, `/metrics`."""
    card = Model(model_name, "model", int(time.time()), "phalanx", backend.max_model_len)

    async def models(request: web.Request) -> web.Response:
        return _json(ModelList("list", [card]))

    async def model(request: web.Request) -> web.Response:
        gen.check_model(request.match_info["id"])
        return _json(card)

    async def version(request: web.Request) -> web.Response:
        return _json(Version(__version__))

    async def health(request: web.Request) -> web.Response:
        if backend.healthy():
            return _json({"status": "ok"})
        raise OpenAIError(503, "The backend is not serving.", type=SERVER_ERROR,
                          code="unhealthy")

    async def prometheus(request: web.Request) -> web.Response:
        body = metrics.render(backend.stats())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/v1/models", models, allow_head=False)
    app.router.add_get("/v1/models/{id:.+}", model, allow_head=False)
    app.router.add_get("/version", version, allow_head=False)
    app.router.add_get("/health", health)  # HEAD too: load balancers probe with it
    app.router.add_get("/metrics", prometheus, allow_head=False)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj),
                        content_type="application/json")


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _error_middleware(metrics: ServerMetrics, max_body_bytes: int):
    """Outermost: request id, body cap, errors in the OpenAI shape, metrics, logging."""

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        request[ARRIVAL] = start = time.monotonic()
        given = request.headers.get("X-Request-Id")
        request[CLIENT_ID] = given is not None and _CLIENT_ID.fullmatch(given) is not None
        request[REQUEST_ID] = given if request[CLIENT_ID] else f"req-{uuid.uuid4().hex}"
        status = 500
        try:
            if given is not None and not request[CLIENT_ID]:
                response = _rejected(request, OpenAIError(
                    400, "X-Request-Id must be 1 to 128 visible ASCII characters.",
                    param="X-Request-Id", code="invalid_value"))
            else:
                response = await _handle(request, handler, max_body_bytes)
            status = response.status
            if not response.prepared:
                response.headers.setdefault("X-Request-Id", request[REQUEST_ID])
            return response
        except BaseException:  # cancelled: the client went away mid-request
            status = 499
            raise
        finally:
            route = _route_label(request)
            metrics.count_request(route, status)
            log.info("http_request", request_id=request[REQUEST_ID], method=request.method,
                     route=route, status=status, duration_s=round(time.monotonic() - start, 6))

    return middleware


async def _handle(request: web.Request, handler: _Handler,
                  max_body_bytes: int) -> web.StreamResponse:
    try:
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise too_large(max_body_bytes)
        return await handler(request)
    except OpenAIError as e:
        return _rejected(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _rejected(request, from_http_exception(e, request, max_body_bytes))
    except Exception as e:  # noqa: BLE001 - never leak a traceback to the client
        log.error("handler_failed", request_id=request.get(REQUEST_ID), error=repr(e),
                  exc_info=True)
        return OpenAIError(500, "The server had an error while processing your request.",
                           type=SERVER_ERROR).response()


def _rejected(request: web.Request, e: OpenAIError) -> web.Response:
    log.info("request_rejected", request_id=request.get(REQUEST_ID), status=e.status,
             code=e.code, param=e.param, message=e.message)
    return e.response()


def _auth_middleware(api_key: Optional[str], open_paths: frozenset[str]):
    """401 unless `Authorization: Bearer <api_key>` (every route but `open_paths`)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if expected is not None and request.path not in open_paths:
            given = request.headers.get("Authorization", "")
            if not given:
                raise OpenAIError(401, "Missing API key: send `Authorization: Bearer <key>`.",
                                  code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(given.encode("utf-8", "replace"), expected):
                raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware
