"""Errors the SDK raises: every one is an `APIError`."""

from __future__ import annotations

from typing import Optional

__all__ = ["APIError", "APIConnectionError", "APITimeoutError"]


class APIError(Exception):
    """The server answered with an OpenAI error body (`status` is the HTTP status; an
    error event inside a stream keeps the stream's status, 200)."""

    def __init__(self, status: Optional[int], type: str, message: str,
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(f"{status} {type}: {message}" + (f" (param={param})" if param else ""))
        self.status, self.type, self.message, self.param, self.code = status, type, message, param, code


class APIConnectionError(APIError):
    """No answer: the connection failed on every attempt (status None)."""

    def __init__(self, message: str, type: str = "connection_error") -> None:
        super().__init__(None, type, message)


class APITimeoutError(APIConnectionError):
    """The request (or, streaming, the wait for the next chunk) ran past the timeout."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "timeout")
