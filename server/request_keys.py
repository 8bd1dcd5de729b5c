"""Typed keys of the per-request storage the middleware fills and handlers read."""

from __future__ import annotations

from aiohttp import web

__all__ = ["REQUEST_ID", "CLIENT_ID", "ARRIVAL"]

_RequestKey = getattr(web, "RequestKey", None)  # aiohttp >= 3.12; plain strings before

REQUEST_ID = _RequestKey("request_id", str) if _RequestKey else "phalanx.request_id"
ARRIVAL = _RequestKey("arrival", float) if _RequestKey else "phalanx.arrival"
# Whether REQUEST_ID came from the client's `X-Request-Id` (kept, not replaced by the
# completion's id).
CLIENT_ID = _RequestKey("client_request_id", bool) if _RequestKey else "phalanx.client_request_id"
