"""Cross-origin access for browser clients (`phalanx serve --allowed-origins`).

Off unless origins are given: a browser page of another origin then gets no
`Access-Control-Allow-Origin` and cannot read any answer. With origins (exact
`scheme://host[:port]` strings, or `*` for any):
- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is answered
  here, before the API-key check (browsers send no credentials on a preflight): 204 with
  the allowed methods and headers for an allowed origin, 403 for another;
- every answer to an allowed origin (JSON and SSE alike, set as the headers go out)
  carries `Access-Control-Allow-Origin` (the origin itself, or `*`), `Vary: Origin` and
  exposes `X-Request-Id`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from aiohttp import web

from .errors import OpenAIError

__all__ = ["CorsPolicy", "parse_origins"]

ALLOW_METHODS = "GET, POST, HEAD, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id, Last-Event-ID"
MAX_AGE_S = "600"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: comma-separated origins or `*` (ValueError naming a bad one:
    an origin is `scheme://host[:port]`, no path)."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        if o == "*":
            continue
        parts = urlsplit(o)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path \
                or parts.query or parts.fragment:
            raise ValueError(f"--allowed-origins: {o!r} is not an origin "
                             "(scheme://host[:port], or *)")
    return origins


class CorsPolicy:
    """The allowed origins; `middleware` answers preflights, `on_prepare` labels answers."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins

    def install(self, app: web.Application) -> None:
        app.on_response_prepare.append(self.on_prepare)

    @property
    def middleware(self):
        @web.middleware
        async def preflight(request: web.Request, handler: _Handler) -> web.StreamResponse:
            origin = request.headers.get("Origin")
            if request.method != "OPTIONS" or origin is None \
                    or "Access-Control-Request-Method" not in request.headers:
                return await handler(request)
            if not self.allows(origin):
                raise OpenAIError(403, f"Origin {origin!r} is not allowed by this server's "
                                  "--allowed-origins.", code="cors_origin_not_allowed")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": ALLOW_HEADERS,
                "Access-Control-Max-Age": MAX_AGE_S})
        return preflight

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if self.any else origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id"
        if not self.any:
            response.headers.add("Vary", "Origin")
