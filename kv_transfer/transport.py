"""UCX (ucxx) transport of KV pages: `KVSender` (one per prefill rank process) streams
batches of `planner.Copy` to `KVReceiver`s (one per decode rank process), raw bytes, no
pickle. Wire format: `messages`.

A batch (one destination; one layer, or a chunk of layers) is queued on the connection
to its peer. The sender's pump cuts or coalesces queued batches of one request into
messages of at most the receiver's capacity, gathers each message's source slabs into
one contiguous staging buffer (an index_select per (layer, kind) run), and posts the
`TransferRequest` then the payload. The receiver keeps `staging_buffers` receives of
both posted ahead (so data flows while it scatters the previous message), scatters the
payload into its pools, then acks. `send_layer` returns once its batch is acked, i.e.
written; batches to one peer land in call order.

Deadlines (ARCHITECTURE §5): every wait runs under `asyncio.wait_for`: `send_layer` until
its ack, the receiver's handshake and a payload once announced, `wait_request` until its
KV landed. A timeout, a rejected batch or a lost peer raises `TransferError(request_id,
epoch, peer)`. A connection that saw a timeout or an error is *broken*: it is aborted
(the peer sees the close), all its pending batches fail at once, and `connect` must be
called again. A dead peer never hangs the other side: its pending operations fail when
UCX reports the closed endpoint, or at the deadline at the latest. Fencing: each message
carries the sender's epoch; the receiver applies only its own epoch's batches and answers
the others with a negative ack (their data is dropped).

Threading model: ucxx keeps one context per process, and its Python futures are bound to
the event loop that first initialised it (`ensure_ucx`). So every sender and receiver of
a process runs on one asyncio loop: either the caller's own loop (call the async API
from it), or a `TransportThread` (a daemon thread running that loop) driven from
synchronous code through `BlockingKVSender` / `BlockingKVReceiver`. Objects here are not
thread-safe: touch them only on their loop. Pool tensors are read (sender) or written
(receiver) on the loop thread; the engine must not write a page while it is being sent
nor read a page before its request is reported landed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from ..log import get_logger
from . import messages as m
from .planner import Copy

__all__ = ["Address", "BlockingKVReceiver", "BlockingKVSender", "KVReceiver", "KVSender",
           "TransferError", "TransportThread", "ensure_ucx", "shutdown_ucx"]

log = get_logger(__name__)
Address = tuple[str, int]
Copies = Union[Sequence[Copy], np.ndarray]
TAG_CTRL, TAG_PAYLOAD, TAG_REPLY = 1, 2, 3
_ABORT_PERIOD_NS = 10**9
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TransferError(RuntimeError):
    """A KV transfer failed: timeout, lost or rejecting peer, broken connection.
    Fields: request_id ('' for a connection-level failure), epoch, peer, detail."""

    def __init__(self, request_id: str, epoch: int, peer: str, detail: str) -> None:
        self.request_id, self.epoch, self.peer, self.detail = request_id, epoch, peer, detail
        super().__init__(f"KV transfer of request {request_id!r} (epoch {epoch}) "
                         f"with {peer}: {detail}")

    def __reduce__(self):  # crosses Ray: rebuild from the fields
        return (TransferError, (self.request_id, self.epoch, self.peer, self.detail))


# ------------------------------------------------------------------ ucxx process state

_ucx_loop: Optional[asyncio.AbstractEventLoop] = None


def ensure_ucx(progress_mode: str = "thread") -> Any:
    """Initialise ucxx on the running loop (once per process) and return the module.

    'thread' modes use a UCX progress thread plus Python futures (idle waits cost no
    CPU); ucxx's default without futures busy-polls a core per waiting coroutine.
    RuntimeError if ucxx was initialised by us on another loop."""
    global _ucx_loop
    import ucxx

    loop = asyncio.get_running_loop()
    if _ucx_loop is None:
        try:
            ucxx.init(progress_mode=progress_mode,
                      enable_python_future=progress_mode.startswith("thread"))
        except RuntimeError:  # initialised elsewhere: trust its loop binding
            pass
        _ucx_loop = loop
    elif _ucx_loop is not loop:
        raise RuntimeError("ucxx is bound to another event loop of this process; run "
                           "every sender/receiver on one loop (see TransportThread)")
    return ucxx


def shutdown_ucx() -> None:
    """Stop ucxx's notifier thread (a non-daemon thread: without this the process may
    not exit) and reset ucxx. Call after closing every sender and receiver."""
    global _ucx_loop
    import ucxx

    ucxx.stop_notifier_thread()
    try:
        ucxx.reset()
    except Exception as e:  # objects still alive somewhere: leave the context be
        log.debug("ucxx_reset_skipped", error=repr(e))
    _ucx_loop = None


def _ucx_buf(t: torch.Tensor) -> Any:
    return t.numpy() if t.device.type == "cpu" else t


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # an aborted connection fails posted operations nobody awaits


def _post_send(ep: Any, tag: int, buf: Any) -> asyncio.Task:
    """Start a send: tasks start in creation order, so sends post in call order."""
    task = asyncio.ensure_future(ep.send(buf, tag=tag))
    task.add_done_callback(_retrieved)
    return task


def _post_recv(ep: Any, tag: int, buf: Any) -> asyncio.Task:
    task = asyncio.ensure_future(ep.recv(buf, tag=tag))
    task.add_done_callback(_retrieved)
    return task


async def _send_msg(ep: Any, tag: int, msg: Any, timeout: float) -> None:
    await asyncio.wait_for(ep.send(m.frame(msg), tag=tag), timeout)


async def _recv_msg(ep: Any, tag: int, decoder: Any, timeout: Optional[float]) -> Any:
    buf = bytearray(m.MAX_REPLY_BYTES)
    await asyncio.wait_for(ep.recv(buf, tag=tag), timeout)
    return m.unframe(buf, decoder)


def _abort(ep: Any) -> None:
    try:
        ep.abort(period=_ABORT_PERIOD_NS)
    except Exception as e:  # already closed or failed
        log.debug("ucx_abort_failed", error=repr(e))


def _reason(e: BaseException) -> str:
    return "timeout" if isinstance(e, asyncio.TimeoutError) else repr(e)


# ------------------------------------------------------------------ pools

class _Pools:
    """Per-layer (K, V) pools `[num_pages, heads, page_size, head_dim]`, one dtype and
    device; gathers and scatters copy tables one (layer, kind, granule) run at a time."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pools:
            raise ValueError("pools must hold one (k, v) pair per layer")
        first = pools[0][0]
        if first.dim() != 4:
            raise ValueError(f"pools must be [pages, heads, page_size, head_dim], "
                             f"got {tuple(first.shape)}")
        for layer, pair in enumerate(pools):
            for t in pair:
                if (t.shape != first.shape or t.dtype != first.dtype
                        or t.device != first.device or not t.is_contiguous()):
                    raise ValueError(f"layer {layer}: pools must be contiguous and share "
                                     f"shape {tuple(first.shape)}, dtype and device")
        self.num_layers = len(pools)
        self.num_pages, self.heads, self.page_size, self.head_dim = first.shape
        self.dtype, self.device = first.dtype, first.device
        self.row_bytes = self.head_dim * first.element_size()
        self.pools = [tuple(pair) for pair in pools]
        self._index: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def check(self, table: np.ndarray, side: str) -> str:
        return m.check_copies(table, side, self.num_layers, self.num_pages, self.heads,
                              self.page_size)

    def copy_nbytes(self, table: np.ndarray) -> np.ndarray:
        return m.copy_nbytes(table, self.head_dim, self.row_bytes // self.head_dim)

    def nbytes(self, table: np.ndarray) -> int:
        return m.payload_nbytes(table, self.head_dim, self.row_bytes // self.head_dim)

    def _rows_of(self, table: np.ndarray, side: str, granule: int) -> torch.Tensor:
        """Row index of a run, cached by its geometry (every layer and kind repeats it)."""
        cols = list(m.SIDE_COLUMNS[side]) + [m.F_NUM_HEADS, m.F_NUM_TOKENS]
        key = (side, granule, np.ascontiguousarray(table[:, cols]).tobytes())
        idx = self._index.get(key)
        if idx is None:
            rows = m.copy_rows(table, side, self.heads, self.page_size, granule)
            idx = torch.from_numpy(rows).to(self.device)
            self._index[key] = idx
            if len(self._index) > 64:
                self._index.popitem(last=False)
        else:
            self._index.move_to_end(key)
        return idx

    def _runs(self, table: np.ndarray, side: str, buf: torch.Tensor):
        """(pool rows, index, payload rows) per run; `buf` holds exactly the payload."""
        flat, pos = buf.view(self.dtype), 0
        for layer, kind, g, a, b in m.segments(table, side, self.page_size):
            idx = self._rows_of(table[a:b], side, g)
            width = g * self.head_dim
            end = pos + idx.numel() * width
            yield (layer, self.pools[layer][kind].view(-1, width), idx,
                   flat[pos:end].view(-1, width))
            pos = end

    def gather(self, table: np.ndarray, out: torch.Tensor) -> None:
        """Source slabs of `table` into the uint8 buffer `out`, in payload order; done
        (device synchronised) on return, since UCX then reads `out` directly."""
        for _, pool, idx, rows in self._runs(table, "src", out):
            torch.index_select(pool, 0, idx, out=rows)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, table: np.ndarray, payload: torch.Tensor) -> dict[int, int]:
        """Payload into the destination slots of `table`; token slots written per layer.
        On CPU through numpy (row assignment runs ~7x faster than torch's index_copy_)."""
        landed: dict[int, int] = defaultdict(int)
        as_int = _INT_OF_SIZE[self.row_bytes // self.head_dim]
        for layer, pool, idx, rows in self._runs(table, "dst", payload):
            if pool.device.type == "cpu":
                pool.view(as_int).numpy()[idx.numpy()] = rows.view(as_int).numpy()
            else:
                pool.index_copy_(0, idx, rows)
            landed[layer] += rows.numel() // self.head_dim
        self._sync()  # written before it is reported landed and the buffer is reused
        return landed


# ------------------------------------------------------------------ sender

class _Batch:
    """One `send_layer` call: done when every part of it is acked."""

    __slots__ = ("request_id", "epoch", "future", "parts_left")

    def __init__(self, request_id: str, epoch: int, parts: int) -> None:
        self.request_id, self.epoch, self.parts_left = request_id, epoch, parts
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


class _SenderConn:
    def __init__(self, peer: str, ep: Any, hello: m.HelloAck, staging: int) -> None:
        self.peer, self.ep, self.receiver_rank = peer, ep, hello.receiver_rank
        self.capacity = hello.max_payload_bytes
        self.free: asyncio.Queue[torch.Tensor] = asyncio.Queue()  # staging buffers
        for _ in range(max(1, staging)):
            self.free.put_nowait(torch.empty(0, dtype=torch.uint8))
        self.seq = 0
        self.queue: deque[tuple[_Batch, np.ndarray, int]] = deque()  # (batch, part, bytes)
        self.wake = asyncio.Event()
        self.pending: dict[int, list[_Batch]] = {}  # seq -> batches with a part in it
        self.broken = ""
        self.tasks: list[asyncio.Task] = []


class KVSender:
    """Prefill side: sends this rank's copies to decode ranks, one connection per peer.

    pools: per layer (k, v) of `[num_pages, kv_heads_local, page_size, head_dim]`.
    rank: this prefill TP rank (`Copy.src_rank`). timeout_s: default deadline of one
    `send_layer` (queueing, staging, send and ack). staging_buffers: messages in flight
    per connection. Async API: use on one loop (module docstring).
    """

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                 epoch: int, timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                 staging_buffers: int = 3, progress_mode: str = "thread") -> None:
        self._pools = _Pools(pools)
        self.rank, self.epoch = rank, epoch
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._staging_buffers, self._progress_mode = staging_buffers, progress_mode
        self._conns: dict[Address, _SenderConn] = {}

    def set_epoch(self, epoch: int) -> None:
        """Stamp later batches with `epoch` (batches already submitted keep theirs)."""
        self.epoch = epoch

    async def connect(self, peer: Address) -> int:
        """Connect (or reconnect a broken connection) to the receiver at `peer` and
        handshake; returns the receiver's rank. TransferError on failure or rejection."""
        ucxx = ensure_ucx(self._progress_mode)
        old = self._conns.get(peer)
        if old is not None and not old.broken:
            return old.receiver_rank
        name, deadline, ep = f"{peer[0]}:{peer[1]}", time.monotonic() + self.connect_timeout_s, None
        left = lambda: max(deadline - time.monotonic(), 0.0)  # noqa: E731
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(
                peer[0], peer[1], connect_timeout=self.connect_timeout_s), left())
            await _send_msg(ep, TAG_CTRL, m.Hello(
                m.PROTOCOL_VERSION, self.epoch, self.rank,
                str(self._pools.dtype).removeprefix("torch."), self._pools.head_dim), left())
            hello = await _recv_msg(ep, TAG_REPLY, m.TO_SENDER, left())
        except Exception as e:
            if ep is not None:
                _abort(ep)
            raise TransferError("", self.epoch, name, f"connect failed: {_reason(e)}") from e
        if not isinstance(hello, m.HelloAck) or not hello.ok:
            _abort(ep)
            raise TransferError("", self.epoch, name, f"rejected: {getattr(hello, 'error', hello)}")
        conn = _SenderConn(name, ep, hello, self._staging_buffers)
        conn.tasks = [asyncio.create_task(self._read_acks(conn)),
                      asyncio.create_task(self._pump(conn))]
        self._conns[peer] = conn
        return conn.receiver_rank

    def _conn(self, peer: Address, request_id: str) -> _SenderConn:
        conn = self._conns.get(peer)
        if conn is None or conn.broken:
            detail = conn.broken if conn else "not connected"
            raise TransferError(request_id, self.epoch, f"{peer[0]}:{peer[1]}", detail)
        return conn

    def _table(self, copies: Copies, conn: _SenderConn) -> np.ndarray:
        if isinstance(copies, np.ndarray):  # pre-encoded (messages.encode_copies)
            table = copies
        else:
            bad = [c for c in copies if c.src_rank != self.rank or c.dst_rank != conn.receiver_rank]
            if bad:
                raise ValueError(f"copy {bad[0]} is not from rank {self.rank} to the peer's "
                                 f"rank {conn.receiver_rank}")
            table = m.encode_copies(copies)
        error = self._pools.check(table, "src")
        if error:
            raise ValueError(error)
        return table

    async def send_layer(self, peer: Address, request_id: str, copies: Copies, *,
                         timeout_s: Optional[float] = None) -> m.TransferAck:
        """Send one batch of copies (one destination; a layer or a chunk of layers) to
        `peer`; return the ack of its last message once the receiver has written it.

        ValueError for copies that are not this rank's, not the peer's, or out of the
        pools; TransferError on timeout, rejection (e.g. stale epoch) or a lost peer."""
        conn = self._conn(peer, request_id)
        table = self._table(copies, conn)
        parts = m.split_table(table, self._pools.copy_nbytes(table), conn.capacity)
        batch = _Batch(request_id, self.epoch, len(parts))
        conn.queue.extend((batch, part, nbytes) for part, nbytes in parts)
        conn.wake.set()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            ack = await asyncio.wait_for(batch.future, timeout)
        except asyncio.TimeoutError:
            self._break(conn, f"no ack within {timeout} s")
            raise TransferError(request_id, batch.epoch, conn.peer, "timeout") from None
        if not ack.ok:
            raise TransferError(request_id, batch.epoch, conn.peer, f"rejected: {ack.error}")
        return ack

    def _next_message(self, conn: _SenderConn) -> tuple[list[_Batch], np.ndarray, int]:
        """The queue's head part and the following ones of the same request and epoch,
        within the receiver's capacity: (their batches, copy table, payload bytes)."""
        batch, part, total = conn.queue.popleft()
        batches, tables = [batch], [part]
        while conn.queue:
            nxt, part, nbytes = conn.queue[0]
            if ((nxt.request_id, nxt.epoch) != (batch.request_id, batch.epoch)
                    or total + nbytes > conn.capacity
                    or sum(len(t) for t in tables) + len(part) > m.MAX_COPIES):
                break
            conn.queue.popleft()
            batches.append(nxt)
            tables.append(part)
            total += nbytes
        return batches, tables[0] if len(tables) == 1 else np.concatenate(tables), total

    async def _pump(self, conn: _SenderConn) -> None:
        """Gather and post queued parts in order. Its waits are bounded by the batches'
        own deadlines: one that expires breaks the connection, which cancels the pump."""
        try:
            while True:
                while not conn.queue:
                    conn.wake.clear()
                    await conn.wake.wait()
                batches, table, nbytes = self._next_message(conn)
                conn.seq += 1
                conn.pending[conn.seq] = batches  # from here on `_break` fails them
                buf = await conn.free.get()
                if buf.numel() < nbytes:
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=self._pools.device)
                self._pools.gather(table, buf[:nbytes])
                layers = table[:, m.F_LAYER]
                msg = m.TransferRequest(batches[0].request_id, batches[0].epoch, conn.seq,
                                        int(layers.min()), int(layers.max()) + 1,
                                        m.table_bytes(table), nbytes)
                sends = [_post_send(conn.ep, TAG_CTRL, m.frame(msg)),
                         _post_send(conn.ep, TAG_PAYLOAD, _ucx_buf(buf[:nbytes]))]
                asyncio.create_task(self._sent(conn, sends, buf))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"send failed: {e!r}")

    async def _sent(self, conn: _SenderConn, sends: list[asyncio.Task],
                    buf: torch.Tensor) -> None:
        """Recycle the staging buffer once UCX is done with it (never if a send failed)."""
        results = await asyncio.gather(*sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._break(conn, f"send failed: {errors[0]!r}")
        else:
            conn.free.put_nowait(buf)

    async def _read_acks(self, conn: _SenderConn) -> None:
        try:
            while True:
                ack = await _recv_msg(conn.ep, TAG_REPLY, m.TO_SENDER, None)  # idle: no deadline
                if not isinstance(ack, m.TransferAck):
                    raise ValueError(f"unexpected {type(ack).__name__}")
                batches = conn.pending.pop(ack.seq, None)
                if not batches or (ack.request_id, ack.epoch) != (batches[0].request_id,
                                                                  batches[0].epoch):
                    log.warning("kv_ack_dropped", peer=conn.peer, seq=ack.seq,
                                request_id=ack.request_id, epoch=ack.epoch)
                    continue
                for batch in batches:
                    batch.parts_left -= 1
                    if (batch.parts_left == 0 or not ack.ok) and not batch.future.done():
                        batch.future.set_result(ack)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"connection lost: {e!r}")

    def _break(self, conn: _SenderConn, reason: str, *, fault: bool = True) -> None:
        """Mark `conn` broken, fail its queued and unacked batches, abort the endpoint."""
        if conn.broken:
            return
        conn.broken = reason
        if fault:
            log.warning("kv_send_conn_broken", peer=conn.peer, reason=reason)
        batches = [b for b, _, _ in conn.queue] + [b for bs in conn.pending.values() for b in bs]
        conn.queue.clear()
        conn.pending.clear()
        for batch in batches:
            if not batch.future.done():
                batch.future.set_exception(TransferError(batch.request_id, batch.epoch,
                                                         conn.peer, reason))
                batch.future.exception()  # marks it retrieved: its waiter re-raises it
        for task in conn.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        _abort(conn.ep)

    async def close(self) -> None:
        for conn in self._conns.values():
            self._break(conn, "sender closed", fault=False)
        self._conns.clear()
        await asyncio.sleep(0)


# ------------------------------------------------------------------ receiver

class _RecvConn:
    def __init__(self, ep: Any) -> None:
        self.ep, self.peer = ep, "unknown sender"
        self.requests: set[str] = set()
        self.broken = ""
        self.tasks: list[asyncio.Task] = []


class KVReceiver:
    """Decode side: listens on (host, port) (0: any free port) and writes incoming
    batches into its pools (per layer (k, v) of `[num_pages, kv_heads_local, page_size,
    head_dim]`). `wait_request` reports when a request's KV has landed. Per connection it
    keeps `staging_buffers` receives of up to `max_payload_bytes` posted.

    on_landed(request_id, layers, epoch): called on the loop after a message is written,
    before its ack is sent. `stats`: counters (connections accepted and lost, messages
    and bytes written, messages dropped for their epoch or rejected). Async API: use on
    one loop (module docstring)."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                 epoch: int, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 10.0, staging_buffers: int = 3,
                 max_payload_bytes: int = 32 << 20, progress_mode: str = "thread",
                 on_landed: Optional[Callable[[str, range, int], None]] = None) -> None:
        self._pools = _Pools(pools)
        self.rank, self.epoch, self.host, self._port = rank, epoch, host, port
        self.timeout_s, self.max_payload_bytes = timeout_s, max_payload_bytes
        self._staging_buffers, self._progress_mode = max(1, staging_buffers), progress_mode
        self.on_landed = on_landed
        self._listener: Any = None
        self._conns: set[_RecvConn] = set()
        self._rows: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._failed: dict[str, tuple[str, str]] = {}
        self._wakeup = asyncio.Event()
        self.stats = {"connections": 0, "messages": 0, "bytes": 0, "dropped_epoch": 0,
                      "rejected": 0, "conn_lost": 0}

    @property
    def address(self) -> Address:
        return (self.host, self._port)

    async def start(self) -> Address:
        """Start listening; returns the (host, port) senders connect to."""
        ucxx = ensure_ucx(self._progress_mode)
        self._listener = ucxx.create_listener(self._on_connect, self._port,
                                              connect_timeout=self.timeout_s)
        self._port = self._listener.port
        return self.address

    def set_epoch(self, epoch: int) -> None:
        """Enter `epoch`: later messages of other epochs are dropped; waits fail."""
        self.epoch = epoch
        self._notify()

    def release(self, request_id: str) -> None:
        """Forget a request's landing state (after it is admitted or aborted)."""
        self._rows.pop(request_id, None)
        self._failed.pop(request_id, None)

    def landed(self, request_id: str) -> dict[int, int]:
        """Token slots (heads x tokens, K and V) written so far, per layer."""
        return dict(self._rows.get(request_id, {}))

    def _notify(self) -> None:
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    async def wait_request(self, request_id: str, num_tokens: int, *,
                           layers: Optional[range] = None,
                           timeout_s: Optional[float] = None) -> None:
        """Return once tokens [0, num_tokens) of `layers` (default all) have landed, K and
        V of every local head. TransferError at the deadline, when a connection that
        carried part of it breaks, on an epoch change, or if more than that landed."""
        layers = range(self._pools.num_layers) if layers is None else layers
        need, epoch = 2 * self._pools.heads * num_tokens, self.epoch
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            got = self._rows.get(request_id, {})
            done = sum(got.get(layer, 0) == need for layer in layers)
            if any(got.get(layer, 0) > need for layer in layers):
                raise TransferError(request_id, epoch, "receiver", "more KV than expected")
            if done == len(layers):
                return
            if request_id in self._failed:
                raise TransferError(request_id, epoch, *self._failed[request_id])
            if self.epoch != epoch:
                raise TransferError(request_id, epoch, "receiver", f"epoch is now {self.epoch}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(request_id, epoch, "unknown sender",
                                    f"timeout: {done}/{len(layers)} layers landed")
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _on_connect(self, ep: Any) -> None:
        conn = _RecvConn(ep)
        self._conns.add(conn)
        self.stats["connections"] += 1
        conn.tasks.append(asyncio.current_task())
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, _reason(e))

    def _check_hello(self, hello: Any) -> str:
        if not isinstance(hello, m.Hello):
            return f"expected Hello, got {type(hello).__name__}"
        mine = (m.PROTOCOL_VERSION, self.epoch, str(self._pools.dtype).removeprefix("torch."),
                self._pools.head_dim)
        theirs = (hello.version, hello.epoch, hello.dtype, hello.head_dim)
        return "" if mine == theirs else f"(version, epoch, dtype, head_dim) {theirs} != {mine}"

    async def _serve(self, conn: _RecvConn) -> None:
        """Handshake, then land messages in order through ring slots whose control and
        payload receives stay posted ahead."""
        hello = await _recv_msg(conn.ep, TAG_CTRL, m.TO_RECEIVER, self.timeout_s)
        conn.peer = f"sender rank {getattr(hello, 'sender_rank', '?')}"
        error = self._check_hello(hello)
        await _send_msg(conn.ep, TAG_REPLY, m.HelloAck(
            self.epoch, self.rank, not error, self.max_payload_bytes, error), self.timeout_s)
        if error:  # let the sender read the refusal and hang up first
            try:
                await asyncio.wait_for(_post_recv(conn.ep, TAG_CTRL, bytearray(8)),
                                       self.timeout_s)
            except Exception:  # the hang-up (or our deadline)
                pass
            raise ValueError(f"refused: {error}")
        slots = [(bytearray(m.MAX_CTRL_BYTES),
                  torch.empty(self.max_payload_bytes, dtype=torch.uint8, device=self._pools.device))
                 for _ in range(self._staging_buffers)]
        posted = [self._post(conn, slot) for slot in slots]
        n = 0
        while True:
            k = n % len(slots)
            ctrl_task, payload_task = posted[k]
            await ctrl_task  # idle: no deadline
            msg = m.unframe(slots[k][0], m.TO_RECEIVER)
            if not isinstance(msg, m.TransferRequest):
                raise ValueError(f"unexpected {type(msg).__name__}")
            if msg.epoch == self.epoch:
                conn.requests.add(msg.request_id)
            await asyncio.wait_for(payload_task, self.timeout_s)
            error = self._apply(msg, slots[k][1])
            posted[k] = self._post(conn, slots[k])
            await _send_msg(conn.ep, TAG_REPLY, m.TransferAck(
                msg.request_id, msg.epoch, msg.seq, msg.layer_start, msg.layer_stop,
                not error, error[:1000]), self.timeout_s)
            n += 1

    def _post(self, conn: _RecvConn, slot: tuple) -> tuple[asyncio.Task, asyncio.Task]:
        return (_post_recv(conn.ep, TAG_CTRL, slot[0]),
                _post_recv(conn.ep, TAG_PAYLOAD, _ucx_buf(slot[1])))

    def _apply(self, msg: m.TransferRequest, buf: torch.Tensor) -> str:
        """Write one message's payload (at the start of `buf`) into the pools; '' or why
        it was dropped."""
        if msg.epoch != self.epoch:
            self.stats["dropped_epoch"] += 1
            return f"stale epoch {msg.epoch}: receiver is at epoch {self.epoch}"
        try:
            table = m.decode_copies(msg.copies)
            error = self._pools.check(table, "dst")
            if not error and self._pools.nbytes(table) != msg.payload_bytes:
                error = f"payload of {msg.payload_bytes} bytes does not match the copies"
        except ValueError as e:
            error = str(e)
        if error:
            self.stats["rejected"] += 1
            return error
        for layer, slots in self._pools.scatter(table, buf[:msg.payload_bytes]).items():
            self._rows[msg.request_id][layer] += slots
        self.stats["messages"] += 1
        self.stats["bytes"] += msg.payload_bytes
        if self.on_landed is not None:
            self.on_landed(msg.request_id, range(msg.layer_start, msg.layer_stop), msg.epoch)
        self._notify()
        return ""

    def _break(self, conn: _RecvConn, reason: str, *, fault: bool = True) -> None:
        if conn.broken:
            return
        conn.broken = reason
        if fault:
            self.stats["conn_lost"] += 1
            log.warning("kv_recv_conn_broken", peer=conn.peer, reason=reason)
        for request_id in conn.requests:
            self._failed.setdefault(request_id, (conn.peer, f"connection lost: {reason}"))
        for task in conn.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        _abort(conn.ep)
        self._conns.discard(conn)
        self._notify()

    async def close(self) -> None:
        tasks = [t for conn in self._conns for t in conn.tasks]
        for conn in list(self._conns):
            self._break(conn, "receiver closed", fault=False)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None


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


_MARGIN_S = 5.0  # outer bound of blocking calls on top of the transport's own deadlines


async def _on_loop(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


class BlockingKVSender:
    """`KVSender` for synchronous callers (e.g. the engine thread), living on `thread`'s
    loop; keyword arguments as `KVSender`'s. `submit_layer` returns a concurrent Future at
    once (stream layer l while computing layer l+1); `send_layer_sync` waits for the ack.
    Errors as `KVSender`'s, raised by the Future or the call."""

    def __init__(self, thread: TransportThread, pools: Sequence[tuple[torch.Tensor, ...]],
                 **kwargs: Any) -> None:
        self.thread = thread
        self.sender: KVSender = thread.call(_on_loop(KVSender, pools, **kwargs), _MARGIN_S)

    def connect(self, peer: Address) -> int:
        return self.thread.call(self.sender.connect(peer),
                                self.sender.connect_timeout_s + _MARGIN_S)

    def submit_layer(self, peer: Address, request_id: str, copies: Copies, *,
                     timeout_s: Optional[float] = None) -> concurrent.futures.Future:
        return self.thread.submit(self.sender.send_layer(peer, request_id, copies,
                                                         timeout_s=timeout_s))

    def send_layer_sync(self, peer: Address, request_id: str, copies: Copies, *,
                        timeout_s: Optional[float] = None) -> m.TransferAck:
        bound = (self.sender.timeout_s if timeout_s is None else timeout_s) + _MARGIN_S
        return self.submit_layer(peer, request_id, copies, timeout_s=timeout_s).result(bound)

    def set_epoch(self, epoch: int) -> None:
        self.thread.call(_on_loop(self.sender.set_epoch, epoch), _MARGIN_S)

    def close(self) -> None:
        self.thread.call(self.sender.close(), _MARGIN_S)


class BlockingKVReceiver:
    """`KVReceiver` for synchronous callers, living on `thread`'s loop; keyword arguments
    as `KVReceiver`'s (`on_landed` runs on that loop's thread)."""

    def __init__(self, thread: TransportThread, pools: Sequence[tuple[torch.Tensor, ...]],
                 **kwargs: Any) -> None:
        self.thread = thread
        self.receiver: KVReceiver = thread.call(_on_loop(KVReceiver, pools, **kwargs),
                                                _MARGIN_S)

    def start(self) -> Address:
        return self.thread.call(self.receiver.start(), _MARGIN_S)

    def wait_request_sync(self, request_id: str, num_tokens: int, *,
                          layers: Optional[range] = None,
                          timeout_s: Optional[float] = None) -> None:
        bound = (self.receiver.timeout_s if timeout_s is None else timeout_s) + _MARGIN_S
        self.thread.call(self.receiver.wait_request(request_id, num_tokens, layers=layers,
                                                    timeout_s=timeout_s), bound)

    def set_epoch(self, epoch: int) -> None:
        self.thread.call(_on_loop(self.receiver.set_epoch, epoch), _MARGIN_S)

    def release(self, request_id: str) -> None:
        self.thread.call(_on_loop(self.receiver.release, request_id), _MARGIN_S)

    def landed(self, request_id: str) -> dict[int, int]:
        return self.thread.call(_on_loop(self.receiver.landed, request_id), _MARGIN_S)

    def stats(self) -> dict[str, int]:
        return self.thread.call(_on_loop(dict, self.receiver.stats), _MARGIN_S)

    def close(self) -> None:
        self.thread.call(self.receiver.close(), _MARGIN_S)
