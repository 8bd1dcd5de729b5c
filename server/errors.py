"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`.

Status conventions (those of the OpenAI API):
  400 invalid_request_error: malformed JSON, wrong types, out-of-range or unsupported
      values, unknown fields, prompts that do not fit the context. Wrong JSON types are
      400 too (OpenAI answers them 400, not 422); `param` names the offending field.
  401 invalid_request_error / invalid_api_key: missing or wrong API key.
  404 invalid_request_error: unknown route, or `model_not_found`.
  405 invalid_request_error / method_not_allowed.
  413 invalid_request_error / request_too_large: body over the server's cap.
  500 server_error; 503 server_error (backend down or request aborted by shutdown).
"""

from __future__ import annotations

from typing import Optional

import msgspec
from aiohttp import web

from ..openai_types import ErrorDetail, ErrorResponse

__all__ = ["OpenAIError", "error_response", "from_http_exception"]

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """Raise anywhere in a handler; the app's middleware answers it as JSON."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST,
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorResponse(ErrorDetail(
            self.message, self.type, self.param, self.code)))

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body(),
                            content_type="application/json", headers=self.headers)


def error_response(status: int, message: str, *, type: str = INVALID_REQUEST,
                   param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
    return OpenAIError(status, message, type=type, param=param, code=code).response()


def from_http_exception(exc: web.HTTPException, request: web.Request,
                        max_body_bytes: int) -> OpenAIError:
    """aiohttp's own 4xx/5xx (no route, wrong method, body too large) in our shape."""
    status = exc.status
    if status == 404:
        return OpenAIError(404, f"Unknown route: {request.method} {request.path}",
                           code="not_found")
    if status == 405:
        allow = exc.headers.get("Allow", "")
        return OpenAIError(405, f"Method {request.method} not allowed on {request.path}"
                           + (f" (allowed: {allow})" if allow else ""),
                           code="method_not_allowed", headers={"Allow": allow} if allow else None)
    if status == 413:
        return too_large(max_body_bytes)
    kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    return OpenAIError(status, exc.reason or exc.text or "error", type=kind)


def too_large(max_body_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"Request body exceeds the limit of {max_body_bytes} bytes",
                       code="request_too_large")
