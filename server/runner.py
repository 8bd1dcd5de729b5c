"""Running an app: bind, report the port, shut down cleanly.

`start_server` binds (127.0.0.1 by default; port 0 picks a free port) and returns a
`RunningServer` with the bound port; `serve` runs until cancelled (the CLI's Ctrl-C);
`BackgroundServer` runs one on its own thread and event loop (tests, notebooks, a
Python-started cluster). Handlers are cancelled when their client disconnects
(`handler_cancellation=True`), which aborts the client's backend requests.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from ..log import get_logger

log = get_logger("phalanx.server")

__all__ = ["RunningServer", "start_server", "serve", "BackgroundServer"]

DEFAULT_HOST = "127.0.0.1"


@dataclass(slots=True)
class RunningServer:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:8000` (the OpenAI base_url adds `/v1`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop accepting, cancel in-flight handlers (aborting their requests), clean up."""
        await self.runner.cleanup()


async def start_server(app: web.Application, host: str = DEFAULT_HOST, port: int = 0, *,
                       shutdown_timeout: float = 5.0, access_log: Optional[Any] = None,
                       access_log_format: Optional[str] = None) -> RunningServer:
    """Bind `app` on host:port (0: a free port) and start serving; returns at once.
    `access_log`: a `logging.Logger` for one line per request (None: none)."""
    extra = {"access_log_format": access_log_format} if access_log_format else {}
    runner = web.AppRunner(app, handler_cancellation=True, access_log=access_log,
                           shutdown_timeout=shutdown_timeout, **extra)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    log.info("server_listening", host=host, port=bound)
    return RunningServer(runner, host, bound)


async def serve(app: web.Application, host: str = DEFAULT_HOST, port: int = 8000, *,
                on_ready: Optional[Callable[[RunningServer], Awaitable[None] | None]] = None
                ) -> None:
    """Serve until cancelled, then shut down cleanly. `on_ready(server)` is called once
    bound (e.g. to print the URL with the port actually bound)."""
    server = await start_server(app, host, port)
    try:
        if on_ready is not None:
            result = on_ready(server)
            if asyncio.iscoroutine(result):
                await result
        await asyncio.Event().wait()
    finally:
        await server.close()


class BackgroundServer:
    """An app served from a daemon thread with its own event loop.

    `start()` returns once bound (`.port`, `.url` then valid); `stop()` shuts the server
    down and ends the thread. `run(coro)` runs a coroutine on the server's loop (e.g. to
    close a backend that belongs to it). Usable as a context manager."""

    def __init__(self, app_factory: Callable[[], web.Application], host: str = DEFAULT_HOST,
                 port: int = 0) -> None:
        """`app_factory` is called on the server's thread (aiohttp apps bind to a loop)."""
        self._factory, self._host, self._port = app_factory, host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="phalanx-http",
                                        daemon=True)
        self._server: Optional[RunningServer] = None

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.port

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return self._server.url

    def run(self, coro: Awaitable, timeout: Optional[float] = None):
        """Run `coro` on the server's loop from another thread; returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> "BackgroundServer":
        self._thread.start()

        async def _start() -> RunningServer:
            return await start_server(self._factory(), self._host, self._port)

        self._server = self.run(_start())
        return self

    def stop(self) -> None:
        if self._server is not None:
            self.run(self._server.close())
            self._server = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
