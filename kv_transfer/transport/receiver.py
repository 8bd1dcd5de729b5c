"""Decode side of the KV transport: `KVReceiver` (async, on the transport loop; its
synchronous front is `blocking.BlockingKVReceiver`). Protocol, deadlines and threading model:
`transport`'s docstring."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ...log import get_logger
from ..planning import messages as m
from .errors import TransferError
from ..planning.packed_table import unpack_table
from .direct_landing import DirectLanding
from .receive_connection import ReceiveConnection
from .staging import KVPools, PoolTemplate
from .staging_memory import STAGING_BUFFERS
from .ucx_runtime import (TAG_CTRL, TAG_PAYLOAD, TAG_REPLY, Address, abort_endpoint, post_all,
                          failure_reason, ucx_buffer, ensure_ucx, progress_mode_for)

__all__ = ["KVReceiver"]

log = get_logger(__name__)


RECEIVER_TEMPLATES = 4096  # per connection, LRU: more than a sender ever assumes known


class KVReceiver(DirectLanding):
    """Decode side: listens on (host, port) (0: any free port) and writes incoming
    batches into its pools (per layer (k, v) of `[num_pages, kv_heads_local, page_size,
    head_dim]`). `wait_request` reports when a request's KV has landed. Per connection it
    keeps `staging_buffers` receives of up to `max_payload_bytes` posted, from its first
    staged message on (the buffers are made then: a connection that only carries direct
    messages holds none). direct: tell senders the pools' shape, so that blocks that are
    spans of them are received in place (no staging buffer, no scatter).

    on_landed(request_id, layers, epoch): called on the loop after a message is written,
    before its ack is sent. gated: accept only request ids announced with `expect` (and
    not yet `release`d), so a late write of an abandoned transfer can never land in pages
    that were given back; others get a negative ack. An announced direct message's
    receives are posted when it is read (before its payload is sent); its deadline
    runs from its `Posted`, which must come (or a `Withdrawn`) within the
    announcement's `announce_ms` plus `timeout_s`. `stats`: counters (connections
    accepted and lost, messages and bytes written, of which received in place, messages
    announced and withdrawn, templates defined ahead, messages dropped for their epoch or
    rejected, staging buffer bytes made). progress_mode:
    ucxx's, for the process (default `progress_mode_for` the pools' device). Async API:
    use on one loop (module docstring)."""

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                 epoch: int, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 10.0, staging_buffers: int = STAGING_BUFFERS,
                 max_payload_bytes: int = 32 << 20, progress_mode: Optional[str] = None,
                 on_landed: Optional[Callable[[str, range, int], None]] = None,
                 gated: bool = False, direct: bool = True) -> None:
        self._pools = KVPools(pools)
        self._expected: Optional[set[str]] = set() if gated else None
        self.rank, self.epoch, self.host, self._port = rank, epoch, host, port
        self.timeout_s, self.max_payload_bytes = timeout_s, max_payload_bytes
        self._staging_buffers = max(1, staging_buffers)
        self._progress_mode = progress_mode or progress_mode_for(self._pools.device)
        self.on_landed, self.direct = on_landed, direct
        self._inflight: dict[str, set[asyncio.Future]] = defaultdict(set)  # in-place receives
        self._listener: Any = None
        self._conns: set[ReceiveConnection] = set()
        self._rows: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._failed: dict[str, tuple[str, str]] = {}
        self._wakeup = asyncio.Event()
        self.stats = {"connections": 0, "messages": 0, "bytes": 0, "direct": 0,
                      "announced": 0, "withdrawn": 0, "defined_ahead": 0, "dropped_epoch": 0,
                      "rejected": 0, "conn_lost": 0, "staging_bytes": 0}

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

    def expect(self, request_id: str) -> None:
        """Open the gate for `request_id` (gated receivers)."""
        if self._expected is not None:
            self._expected.add(request_id)

    async def release(self, request_id: str) -> None:
        """Forget a request's landing state (after it is admitted or aborted) and close
        its gate: later messages for it are refused. Returns once no copy or in-place
        receive into its pages is running (the caller may give them back): in-place
        receives end by completing, or fail at their deadline, which breaks their
        connection."""
        if self._expected is not None:
            self._expected.discard(request_id)
        inflight = self._inflight.pop(request_id, ())
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
        self._pools.sync()
        self._rows.pop(request_id, None)
        for conn in self._conns:
            for tid in [t for t, (rid, _) in conn.templates.items() if rid == request_id]:
                del conn.templates[tid]
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
        conn = ReceiveConnection(ep)
        self._conns.add(conn)
        self.stats["connections"] += 1
        conn.tasks.append(asyncio.current_task())
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, failure_reason(e))

    async def _serve(self, conn: ReceiveConnection) -> None:
        """Handshake, then land messages in order through ring slots whose control and
        payload receives stay posted ahead."""
        await conn.handshake(
            (m.PROTOCOL_VERSION, self.epoch, str(self._pools.dtype).removeprefix("torch."),
             self._pools.head_dim),
            lambda error: m.HelloAck(self.epoch, self.rank, not error, self.max_payload_bytes,
                                     error, self._pools.shape if self.direct else ()),
            self.timeout_s)
        ctrl: deque[tuple[bytearray, asyncio.Future]] = deque()
        for _ in range(self._staging_buffers):
            buf = bytearray(m.MAX_CTRL_BYTES)
            ctrl.append((buf, post_all(conn.ep, False, TAG_CTRL, [buf])[0]))
        staged: asyncio.Queue = asyncio.Queue()  # posted staging receives, in posting order
        previous: Optional[asyncio.Task] = None
        while True:
            buf, task = ctrl.popleft()
            await task  # idle: no deadline
            msg = m.unframe(buf, m.TO_RECEIVER)  # decoded into copies: repost at once
            ctrl.append((buf, post_all(conn.ep, False, TAG_CTRL, [buf])[0]))
            if isinstance(msg, (m.Posted, m.Withdrawn)):
                self._verdict(conn, msg)
                continue
            if isinstance(msg, m.DefineTemplate):
                self._define(conn, msg)
                continue
            if not isinstance(msg, m.TransferRequest):
                raise ValueError(f"unexpected {type(msg).__name__}")
            if msg.epoch == self.epoch:
                conn.requests.add(msg.request_id)
            if msg.direct:
                verdict = None
                if msg.announce_ms > 0:  # landed and acked outside the order of the others
                    verdict = conn.verdicts[msg.seq] = asyncio.get_running_loop().create_future()
                    self.stats["announced"] += 1
                error, landed, done = self._land_in_place(conn, msg, verdict)
                if verdict is not None:  # kept by the connection until it ends
                    finish = asyncio.create_task(self._finish(conn, msg, error, landed, done,
                                                              None, verdict))
                    conn.tasks.append(finish)
                    finish.add_done_callback(conn.tasks.remove)
                    continue
            else:  # UCX fills staging receives in posting order, so take them in that order
                if conn.staging is None:  # first staged message: the payload waits in UCX
                    self._make_staging(conn, staged)
                payload, payload_task = await staged.get()
                await asyncio.wait_for(payload_task, self.timeout_s)
                error, landed, scattered = self._apply(msg, payload, conn.templates)
                done = asyncio.ensure_future(self._pools.wait(scattered))
                # reposted once copied out, not after the messages before it finish: the
                # queue keeps posting order, which is the order UCX fills them in
                done.add_done_callback(functools.partial(self._repost, conn, staged, payload))
            previous = asyncio.create_task(
                self._finish(conn, msg, error, landed, done, previous))
            if not msg.direct:  # a loop turn: the copy's wait starts (its buffer is then
                await asyncio.sleep(0)  # reposted when copied out, not after the next ones)

    def _make_staging(self, conn: ReceiveConnection, staged: asyncio.Queue) -> None:
        """Make the connection's staging buffers and post a receive into each."""
        conn.staging = [torch.empty(self.max_payload_bytes, dtype=torch.uint8,
                                    device=self._pools.device)
                        for _ in range(self._staging_buffers)]
        for staging in conn.staging:
            self._post_staging(conn, staged, staging)
        self.stats["staging_bytes"] += self._staging_buffers * self.max_payload_bytes

    def _post_staging(self, conn: ReceiveConnection, staged: asyncio.Queue, buf: torch.Tensor) -> None:
        staged.put_nowait((buf, post_all(conn.ep, False, TAG_PAYLOAD, [ucx_buffer(buf)])[0]))

    def _repost(self, conn: ReceiveConnection, staged: asyncio.Queue, buf: torch.Tensor,
                copied: asyncio.Future) -> None:
        """Done callback of a payload's copy into the pools: post `buf` again (unless the
        copy failed, which `_finish` reports, or the connection broke)."""
        if not copied.cancelled() and copied.exception() is None and not conn.broken:
            try:
                self._post_staging(conn, staged, buf)
            except Exception as e:  # the endpoint failed meanwhile
                self._break(conn, f"staging receive failed: {failure_reason(e)}")

    async def _finish(self, conn: ReceiveConnection, msg: m.TransferRequest, error: str,
                      landed: Optional[tuple[dict, dict]], done: Optional[asyncio.Future],
                      previous: Optional[asyncio.Task],
                      verdict: Optional[asyncio.Future] = None) -> None:
        """After message `msg`'s payload is in its pages (`done`: the scatter or the
        in-place receives) and the message before it finished: count its slots landed,
        acknowledge it. An announced message that was withdrawn (`verdict` False) is
        neither counted nor acknowledged."""
        try:
            if done is not None:
                await done
            if previous is not None:
                await previous
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"copy failed: {failure_reason(e)}")
            return
        if conn.broken:
            return
        if verdict is not None and not verdict.result():
            self.stats["withdrawn"] += 1
            return
        if landed is not None:
            rows, by_layer = landed
            for layer, slots in by_layer.items():
                rows[layer] += slots
            self.stats["messages"] += 1
            self.stats["bytes"] += msg.payload_bytes
            if self.on_landed is not None:
                self.on_landed(msg.request_id, range(msg.layer_start, msg.layer_stop), msg.epoch)
            self._notify()
        # The ack is posted, not awaited: waiting for its completion would add a
        # notifier round trip to every message (the sender's deadline covers it).
        try:
            ack = post_all(conn.ep, True, TAG_REPLY, [m.frame(m.TransferAck(
                msg.request_id, msg.epoch, msg.seq, msg.layer_start, msg.layer_stop,
                not error, error[:1000]))])[0]
        except Exception as e:  # the endpoint failed meanwhile
            self._break(conn, f"ack send failed: {failure_reason(e)}")
            return
        ack.add_done_callback(lambda done, conn=conn: self._ack_done(conn, done))

    def _ack_done(self, conn: ReceiveConnection, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is not None:
            self._break(conn, f"ack send failed: {failure_reason(done.exception())}")

    def _apply(self, msg: m.TransferRequest, buf: torch.Tensor,
               templates: "OrderedDict[int, tuple[str, PoolTemplate]]"
               ) -> tuple[str, Optional[tuple[dict, dict]], Any]:
        """Queue one message's payload (at the start of `buf`) into the pools: ('', (the
        request's landed rows, slots per layer), copy event), or (why it was dropped,
        None, None). A template defined by the message is kept (if valid) even when the
        message itself is dropped, since later messages may name it. The request's rows
        are taken now: if it is released before the copy completes, the count goes to
        the forgotten entry."""
        try:
            tmpl = self._template(msg, templates)
            blocks = m.decode_blocks(msg.blocks)
        except ValueError as e:
            self.stats["rejected"] += 1
            return str(e), None, None
        refusal = self._refusal(msg)
        if refusal:
            return refusal, None, None
        error = m.check_blocks(blocks, self._pools.num_layers, tmpl.rows)
        if not error and tmpl.nbytes(blocks) != msg.payload_bytes:
            error = f"payload of {msg.payload_bytes} bytes does not match the blocks"
        if error:
            self.stats["rejected"] += 1
            return error, None, None
        by_layer, scattered = self._pools.scatter(tmpl, blocks, buf[:msg.payload_bytes])
        return "", (self._rows[msg.request_id], by_layer), scattered

    def _refusal(self, msg: m.TransferRequest) -> str:
        """Why a well-formed message is not written: another epoch, or a request the
        gate is closed to ('' if it is written)."""
        if msg.epoch != self.epoch:
            self.stats["dropped_epoch"] += 1
            return f"stale epoch {msg.epoch}: receiver is at epoch {self.epoch}"
        if self._expected is not None and msg.request_id not in self._expected:
            self.stats["rejected"] += 1
            return f"request {msg.request_id!r} is not expected here"
        return ""

    def _template(self, msg: m.TransferRequest, templates) -> PoolTemplate:
        """The message's template: defined by it (validated for the dst side) or known
        (ValueError naming why a template defined ahead was invalid)."""
        if msg.template_table:
            table = unpack_table(msg.template_table, len(m.COPY_FIELDS), m.MAX_TEMPLATE_ROWS)
            tmpl = self._pools.template(table, "dst")
            _remember(templates, msg.template, (msg.request_id, tmpl))
            return tmpl
        found = templates.get(msg.template)
        if found is None or found[0] != msg.request_id:
            raise ValueError(f"unknown template {msg.template} for request {msg.request_id!r}")
        templates.move_to_end(msg.template)
        if isinstance(found[1], str):
            raise ValueError(found[1])
        return found[1]

    def _define(self, conn: ReceiveConnection, msg: m.DefineTemplate) -> None:
        """A template sent ahead: located (and its scatter index built) now; an invalid
        one is remembered by why, which the messages naming it are refused with."""
        try:
            tmpl = self._pools.template(
                unpack_table(msg.table, len(m.COPY_FIELDS), m.MAX_TEMPLATE_ROWS), "dst")
            self._pools.prebuild(tmpl)
            entry: tuple = (msg.request_id, tmpl)
        except ValueError as e:
            entry = (msg.request_id, f"template {msg.template}: {e}")
        _remember(conn.templates, msg.template, entry)
        self.stats["defined_ahead"] += 1

    def _break(self, conn: ReceiveConnection, reason: str, *, fault: bool = True) -> None:
        if conn.broken:
            return
        conn.broken = reason
        if fault:
            self.stats["conn_lost"] += 1
            log.warning("kv_recv_conn_broken", peer=conn.peer, reason=reason)
        for request_id in conn.requests:
            self._failed.setdefault(request_id, (conn.peer, f"connection lost: {reason}"))
        for verdict in conn.verdicts.values():  # their receives fail with the endpoint
            verdict.cancel()
        conn.verdicts.clear()
        for task in conn.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        abort_endpoint(conn.ep)
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


def _remember(templates: OrderedDict, tid: int, entry: tuple) -> None:
    """Keep a connection's template entry, the least recently used dropped past
    `RECEIVER_TEMPLATES`."""
    templates[tid] = entry
    templates.move_to_end(tid)
    if len(templates) > RECEIVER_TEMPLATES:
        templates.popitem(last=False)
