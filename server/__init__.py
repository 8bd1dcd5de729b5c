"""The OpenAI-compatible HTTP server (aiohttp) and the backend contract it serves.

    from phalanx.server import EngineBackend, create_app, serve
    backend = EngineBackend.from_model_dir(None)          # the tiny default model
    await serve(create_app(backend, api_key="secret"), port=8000)

The server only talks to a `ServingBackend` (backend.py): `EngineBackend` runs one
engine in-process; `ClusterBackend` routes over a multi-rank group (colocated or
disaggregated) through the prefix-aware router. `build_backend` picks one from layout
keywords (what `phalanx serve` does); `start_local` serves it to a `LocalClient`, the
SDK's methods in this process without HTTP.
"""

from .app import DEFAULT_MAX_BODY_BYTES, create_app
from .backend import ServingBackend, TokenDelta
from .cluster_backend import ClusterBackend
from .engine_backend import EngineBackend
from .errors import OpenAIError
from .launch import build_backend
from .local_client import LocalClient, start_local
from .runner import BackgroundServer, RunningServer, serve, start_server

__all__ = ["ServingBackend", "TokenDelta", "EngineBackend", "ClusterBackend", "build_backend",
           "LocalClient", "start_local",
           "create_app", "serve",
           "start_server", "RunningServer", "BackgroundServer", "OpenAIError",
           "DEFAULT_MAX_BODY_BYTES"]
