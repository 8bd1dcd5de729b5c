"""`phalanx serve`: build the backend, serve HTTP until Ctrl-C / SIGTERM, shut down.

Progress lines go to stderr (`phalanx: ...`); once the server listens, one ready line
goes to stdout: `phalanx: serving MODEL at http://HOST:PORT (OpenAI base URL
http://HOST:PORT/v1)` — with the port actually bound, so `--port 0` is usable.

Shutdown on SIGINT or SIGTERM: the HTTP server stops accepting and cancels its handlers
(aborting their requests), the backend stops (rank actors killed), and Ray is shut
down if this process started or joined it; exit code 0. A second signal during the
shutdown interrupts it. Interrupted while loading: everything built so far is torn
down, exit code 130.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Callable

from .app import METRICS_KEY, create_app
from .backend import ServingBackend
from .cors import parse_origins
from .gc_freeze import freeze_start_up_heap
from .serve_checks import check_serve_args
from .launch import build_backend, layout_kwargs
from .runner import start_server
from .serve_report import ACCESS_FORMAT, access_logger, report_throughput

__all__ = ["run_serve", "EXIT_INTERRUPTED"]

EXIT_INTERRUPTED = 130
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _say(line: str) -> None:
    print(f"phalanx: {line}", file=sys.stderr, flush=True)


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def run_serve(args: argparse.Namespace) -> int:
    """The `serve` subcommand (arguments: cli.py's `serve` parser)."""
    started = time.monotonic()
    check_serve_args(args)  # ValueError naming the flag, before anything loads
    args.allowed_origins = parse_origins(args.allowed_origins)
    was_connected = _ray_connected()
    # While loading, both signals interrupt (even if the shell started us with SIGINT
    # ignored, as it does for background jobs): serving handles both the same way.
    previous = {sig: signal.signal(sig, _interrupt) for sig in _SIGNALS}
    backend = None
    try:
        backend = build_backend(
            args.model, model_name=args.served_model_name, routing_policy=args.routing_policy,
            router_hold=args.router_hold, progress=_say, tp=args.tp, dp=args.dp, **layout_kwargs(args),
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            page_size=args.page_size, num_pages=args.num_pages, max_model_len=args.max_model_len,
            device=args.device, seed=args.seed, collective_timeout_s=args.collective_timeout,
            max_recoveries=args.max_recoveries, recovery_window_s=args.recovery_window,
            replace_timeout_s=args.replace_timeout,
            ep_exchange=args.ep_exchange, quantization=args.quantization,
            load_format=args.load_format, ray_address=args.address,
            cuda_graph_max_prefill=args.cuda_graph_max_prefill, dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant)
        _restore(previous)
        _say(_capacity_line(_first_stats(backend), time.monotonic() - started))
        heap = freeze_start_up_heap()
        _say(f"froze {heap.objects:,} start-up objects out of the garbage collector's reach "
             f"(a full collection: {heap.full_collection_ms:.0f} ms before, "
             f"{heap.after_ms:.1f} ms after)")
        asyncio.run(_serve(backend, args))
        return 0
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    finally:
        _restore(previous)
        if backend is not None:  # idempotent: closed already unless interrupted early
            asyncio.run(backend.close())
        if not was_connected and _ray_connected():
            import ray
            ray.shutdown()
        _say("stopped")


async def _serve(backend: ServingBackend, args: argparse.Namespace) -> None:
    """Serve until a signal; the backend is closed whatever happens."""
    try:
        stop = _stop_event(asyncio.get_running_loop())
        app = create_app(backend, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                         served_model_name=args.served_model_name,
                         allowed_origins=args.allowed_origins,
                         stream_resume_s=args.stream_resume,
                         metrics_without_key=args.metrics_without_key)
        quiet = args.quiet
        server = await start_server(app, args.host, args.port,
                                    access_log=None if quiet else access_logger(),
                                    access_log_format=ACCESS_FORMAT)
        reporter = None if quiet else asyncio.ensure_future(
            report_throughput(app[METRICS_KEY], backend.stats, _say))
        try:
            name = args.served_model_name or backend.model_name
            print(f"phalanx: serving {name} at {server.url} (OpenAI base URL {server.url}/v1)",
                  flush=True)
            await stop.wait()
            _say("shutting down")
        finally:
            if reporter is not None:
                reporter.cancel()
            await server.close()
    finally:
        await backend.close()


def _first_stats(backend: ServingBackend, wait_s: float = 3.0) -> dict:
    """The backend's stats once they report the KV capacity (a cluster's driver
    refreshes them every half second), or what they hold after `wait_s`."""
    end = time.monotonic() + wait_s
    while True:
        stats = backend.stats()
        if stats.get("kv_capacity_tokens") or time.monotonic() > end:
            return stats
        time.sleep(0.1)


def _capacity_line(stats: dict, seconds: float) -> str:
    """The line before the ready line: KV capacity and how long start-up took."""
    tokens = int(stats.get("kv_capacity_tokens", 0))
    kv = f"KV cache holds {tokens:,} tokens" if tokens else "KV cache size not reported"
    return f"{kv}; started in {seconds:.1f} s"


def _stop_event(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """Set by the first SIGINT/SIGTERM; the handlers are then removed, so a second
    signal interrupts the shutdown the ordinary way."""
    stop = asyncio.Event()

    def on_signal() -> None:
        stop.set()
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)

    handler: Callable[[], None] = on_signal
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, handler)
    return stop
