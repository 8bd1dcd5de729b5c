"""ucxx process state and helpers of the KV transport (see `transport`'s docstring for the
threading model): `ensure_ucx` / `shutdown_ucx` bind ucxx to one event loop per process,
`TransportThread` runs that loop for synchronous callers, and small wrappers post sends
and receives, frame control messages and abort endpoints."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Optional

import torch

from ...log import get_logger
from ..planning import messages as m

__all__ = ["Address", "TAG_CTRL", "TAG_DIRECT", "TAG_PAYLOAD", "TAG_REPLY",
           "TransportThread", "direct_tag", "ensure_ucx", "progress_mode_for", "shutdown_ucx"]

log = get_logger(__name__)
Address = tuple[str, int]
# one tag per message kind: UCX matches the messages of one tag in posting order
TAG_CTRL, TAG_PAYLOAD, TAG_REPLY, TAG_DIRECT = 1, 2, 3, 4


def direct_tag(seq: int) -> int:
    """The tag of direct message `seq`'s payload: its own, so its receives match its
    sends whatever order the messages of a connection are sent in (announced ones go
    when their pages are computed)."""
    return TAG_DIRECT | (seq << 3)
_ABORT_PERIOD_NS = 10**9

_ucx_loop: Optional[asyncio.AbstractEventLoop] = None
_ucx_futures = False  # ucxx was initialised (by us) with Python futures


def progress_mode_for(device: torch.device) -> str:
    """The transport's default ucxx progress mode for pools on `device`. CUDA:
    'thread-polling' (UCX's progress thread spins on a core of its own, without the
    GIL): in 'thread' mode receive completions of cuda_ipc copies arrive in ~1.1 ms
    bunches (its epoll waits up to 1 ms; a finished copy has no file descriptor to wake
    it, it seems). 2xH200, 96 pool spans of 32k tokens: 0.86-0.91 of one message's rate
    in 'thread', 0.98-1.02 polling; the whole prepared request 0.76-0.79 vs 0.92-0.94
    (bench/NOTES.md v8). CPU: 'thread' (no core spent waiting)."""
    return "thread-polling" if device.type == "cuda" else "thread"


def ensure_ucx(progress_mode: str = "thread") -> Any:
    """Initialise ucxx on the running loop (once per process) and return the module.

    'thread' modes use a UCX progress thread plus Python futures (idle waits cost no
    CPU); ucxx's default without futures busy-polls a core per waiting coroutine.
    RuntimeError if ucxx was initialised by us on another loop."""
    global _ucx_loop, _ucx_futures
    import ucxx

    loop = asyncio.get_running_loop()
    if _ucx_loop is None:
        futures = progress_mode.startswith("thread")
        try:
            ucxx.init(progress_mode=progress_mode, enable_python_future=futures)
            _ucx_futures = futures
        except RuntimeError:  # initialised elsewhere: trust its loop binding
            _ucx_futures = False  # its futures setting unknown: the task path
        _ucx_loop = loop
    elif _ucx_loop is not loop:
        raise RuntimeError("ucxx is bound to another event loop of this process; run "
                           "every sender/receiver on one loop (see TransportThread)")
    return ucxx


def shutdown_ucx() -> None:
    """Stop ucxx's notifier thread (a non-daemon thread: without this the process may
    not exit) and reset ucxx. Call after closing every sender and receiver."""
    global _ucx_loop, _ucx_futures
    import ucxx

    ucxx.stop_notifier_thread()
    try:
        ucxx.reset()
    except Exception as e:  # objects still alive somewhere: leave the context be
        log.debug("ucxx_reset_skipped", error=repr(e))
    _ucx_loop, _ucx_futures = None, False


def ucx_buffer(t: Any) -> Any:
    """A buffer UCX takes: CPU tensors as numpy views; CUDA tensors and buffers as they are."""
    return t.numpy() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # an aborted connection fails posted operations nobody awaits


def settle_landing(landing: asyncio.Future, done: asyncio.Future) -> None:
    """Done callback: `done`'s outcome is seen (its waiter, if any, re-raises it) and
    `landing` ends."""
    if not done.cancelled():
        done.exception()
    if not landing.done():
        landing.set_result(None)


def _post_send(ep: Any, tag: int, buf: Any) -> asyncio.Task:
    """Start a send: tasks start in creation order, so sends post in call order."""
    task = asyncio.ensure_future(ep.send(buf, tag=tag))
    task.add_done_callback(_retrieved)
    return task


def post_recv(ep: Any, tag: int, buf: Any) -> asyncio.Task:
    task = asyncio.ensure_future(ep.recv(buf, tag=tag))
    task.add_done_callback(_retrieved)
    return task


def post_all(ep: Any, send: bool, tag: int, bufs: Iterable[Any],
              into: Optional[list] = None) -> list[asyncio.Future]:
    """Post one send (`send`) or receive per buffer of `bufs`, in order; their futures
    are appended to `into` as they are posted (a new list by default) and returned. A
    future is done when UCX completes its operation; a failed one holds the error (marked
    retrieved: its waiter re-raises it).

    Posted straight on the endpoint's ucxx request API (as `Endpoint.send/recv` do
    inside): an operation reaches UCX when this returns, without a coroutine and a task
    per operation that starts only once the loop turns (host buffers, one process on
    an H200 host: ~6 us per receive against ~14 us). Where this ucxx lacks the internals
    used, or runs without Python futures, it falls back to such tasks."""
    out: list = [] if into is None else into
    if not _posts_straight(ep):
        post = _post_send if send else post_recv
        out.extend(post(ep, tag, buf) for buf in bufs)
        return out
    array, make_tag, mask_full, hash64 = _request_api()
    if ep.closed:
        raise ConnectionError("endpoint closed")
    ep._ep.raise_on_error()  # a failed endpoint raises its error, as ucxx's own posts do
    utag = make_tag(hash64(ep._tags["msg_send" if send else "msg_recv"], hash(tag)))
    refill = _futures_refill()
    for i, buf in enumerate(bufs):
        if refill is not None and i % _REFILL_EVERY == 0:
            refill()
        arr = array(buf)
        req = ep._ep.tag_send(arr, utag) if send else ep._ep.tag_recv(arr, utag, mask_full)
        fut = req.future  # a request nobody references is cancelled: its future's
        fut.add_done_callback(functools.partial(_released, (req, arr)))  # callback holds it
        out.append(fut)
    return out


def _released(keep: tuple, fut: asyncio.Future) -> None:
    """Done callback of a `post_all` operation: marks its error retrieved; until now
    `keep` (its request and buffer) stayed referenced."""
    if not fut.cancelled():
        fut.exception()


# Each request takes a future from ucxx's pool (100, refilled below 50 by the notifier
# thread's rounds, or inline with a "No Futures available" warning once empty): a burst
# of posts refills it every this many, which never lets it run dry.
_REFILL_EVERY = 40


def _futures_refill() -> Optional[Callable[[], None]]:
    """ucxx's worker's futures-pool refill (a no-op while 50 or more are left), or None."""
    try:
        import ucxx.core
        return ucxx.core._get_ctx().worker.populate_python_futures_pool
    except AttributeError:
        return None


def _posts_straight(ep: Any) -> bool:
    """Whether `post_all` posts on `ep` straight through ucxx's request API."""
    return (_ucx_futures and _request_api() is not None
            and all(hasattr(ep, a) for a in ("_ep", "_tags", "closed")))


@functools.lru_cache(maxsize=1)
def _request_api() -> Optional[tuple]:
    """ucxx internals of `post_all` (what its `Endpoint.send/recv` use), or None:
    (Array, tag type, full tag mask, hash64bits)."""
    try:
        from ucxx._lib.arr import Array
        from ucxx._lib.libucxx import UCXXTag, UCXXTagMaskFull
        from ucxx._lib_async.utils import hash64bits
    except ImportError:
        return None
    return Array, UCXXTag, UCXXTagMaskFull, hash64bits


async def send_msg(ep: Any, tag: int, msg: Any, timeout: float) -> None:
    await asyncio.wait_for(ep.send(m.frame(msg), tag=tag), timeout)


async def recv_msg(ep: Any, tag: int, decoder: Any, timeout: Optional[float]) -> Any:
    buf = bytearray(m.MAX_REPLY_BYTES)
    await asyncio.wait_for(ep.recv(buf, tag=tag), timeout)
    return m.unframe(buf, decoder)


def abort_endpoint(ep: Any) -> None:
    try:
        ep.abort(period=_ABORT_PERIOD_NS)
    except Exception as e:  # already closed or failed
        log.debug("ucx_abort_failed", error=repr(e))


def failure_reason(e: BaseException) -> str:
    return "timeout" if isinstance(e, asyncio.TimeoutError) else repr(e)


# ------------------------------------------------------------------ synchronous use

class TransportThread:
    """A daemon thread running the process's transport event loop. `submit` schedules a
    coroutine on it from any thread (a concurrent Future); `call` waits for the result
    (TimeoutError after `timeout_s`, the coroutine is then cancelled). `stop` shuts ucxx
    down (`shutdown_ucx`) and ends the thread; close senders and receivers first."""

    def __init__(self, name: str = "phalanx-kv-transport") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout_s: float) -> Any:
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"transport call did not finish within {timeout_s} s") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        async def _down() -> None:
            shutdown_ucx()

        if self._thread.is_alive():
            try:
                self.call(_down(), timeout_s)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout_s)


BLOCKING_MARGIN_S = 5.0  # outer bound of blocking calls on top of the transport's own deadlines


async def on_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)

