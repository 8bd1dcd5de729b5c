"""The OpenAI app over a backend, served in a background thread for one test module."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from phalanx.server import BackgroundServer, create_app


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
