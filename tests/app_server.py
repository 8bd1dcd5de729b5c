"""The OpenAI app over a backend, served in a background thread for one test module."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from openai import AsyncOpenAI

from phalanx.server import BackgroundServer, EngineBackend, create_app


@contextmanager
def serving(backend, **app_kwargs) -> Iterator[BackgroundServer]:
    """`create_app(backend, **app_kwargs)` on a free local port; on exit the backend is
    closed (on the server's loop) and the server stopped."""
    srv = BackgroundServer(lambda: create_app(backend, **app_kwargs)).start()
    try:
        yield srv
    finally:
        srv.run(backend.close())
        srv.stop()


@contextmanager
def served_engine(model_dir: str, model_name: str, **engine_kwargs) -> Iterator[BackgroundServer]:
    """An `EngineBackend` over `model_dir` served with stream resumption off: the server
    of a module that checks answers, not reconnects."""
    backend = EngineBackend.from_model_dir(model_dir, model_name=model_name, **engine_kwargs)
    with serving(backend, stream_resume_s=0) as srv:
        yield srv


def openai_client(server: BackgroundServer, api_key: str = "none", **kwargs) -> AsyncOpenAI:
    """The official client on `server`'s /v1 without retries: a test sees the first answer."""
    return AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, **kwargs)
