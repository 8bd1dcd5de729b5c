"""Prefill side of the KV transport: `KVSender` (async, on the transport loop; its
synchronous front is `blocking.BlockingKVSender`). Protocol, deadlines and threading model:
`transport`'s docstring."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from ...config import KV_IN_PLACE_MIN_BYTES
from ...log import get_logger
from ..planning import messages as m
from .errors import TransferError
from .part_cutter import Copies, PartCutter
from .send_connection import AnnouncedMessage, SendBatch, PreparedBatch, SendConnection
from .staging import KVPools, PoolTemplate
from .staging_memory import STAGING_BUFFERS
from .ucx_runtime import (TAG_CTRL, TAG_PAYLOAD, TAG_REPLY, Address, abort_endpoint, post_all,
                          failure_reason, recv_msg, send_msg, ucx_buffer, direct_tag,
                          ensure_ucx, progress_mode_for)

__all__ = ["Copies", "KVSender"]

log = get_logger(__name__)
PREPARED = 1024  # prepared batches kept per connection (oldest withdrawn: sent unprepared)
# A message of this many payload parts has its control message sent before the parts are
# posted: ucxx's progress thread submits posted operations in batches, so a control
# message posted with many rendezvous sends leaves only once all of them are set up
# (~1.5 ms for 96 on an H200 host), and the receiver, which posts its in-place receives
# only after reading it, would wait that long. (Announced messages are read long before.)
FLUSH_CTRL_PARTS = 8
ACKS_AHEAD = 4  # ack receives a connection keeps posted


class KVSender:
    """Prefill side: sends this rank's copies to decode ranks, one connection per peer.

    pools: per layer (k, v) of `[num_pages, kv_heads_local, page_size, head_dim]`.
    rank: this prefill TP rank (`Copy.src_rank`). timeout_s: default deadline of one
    `send_layer` (queueing, staging, send and ack). staging_buffers: messages in flight
    per connection. progress_mode: ucxx's, for the process (default
    `progress_mode_for` the pools' device). announce: `prepare` sends the control
    messages of in-place parts ahead (see `prepare`). in_place_min_bytes: the smallest
    span of the receiver's pools moved in place (`part_cutter`). Async API: use on one
    loop (module docstring).
    """

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                 epoch: int, timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                 staging_buffers: int = STAGING_BUFFERS, progress_mode: Optional[str] = None,
                 announce: bool = True, in_place_min_bytes: int = KV_IN_PLACE_MIN_BYTES
                 ) -> None:
        self._pools = KVPools(pools)
        self._cutter = PartCutter(self._pools, rank, in_place_min_bytes)
        self.rank, self.epoch, self.announce = rank, epoch, announce
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._staging_buffers = staging_buffers
        self._progress_mode = progress_mode or progress_mode_for(self._pools.device)
        self._conns: dict[Address, SendConnection] = {}

    def ready_event(self) -> Any:
        """`ready` for a later `send_layer`: what the calling thread's current stream has
        queued so far (CUDA; None on CPU)."""
        return self._pools.ready_event()

    def set_epoch(self, epoch: int) -> None:
        """Stamp later batches with `epoch` (batches already submitted keep theirs);
        prepared batches of other epochs are withdrawn (sent afresh if sent)."""
        self.epoch = epoch
        for conn in self._conns.values():
            for key in [k for k, p in conn.prepared.items() if p.epoch != epoch]:
                conn.withdraw(conn.prepared.pop(key))

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
            await send_msg(ep, TAG_CTRL, m.Hello(
                m.PROTOCOL_VERSION, self.epoch, self.rank,
                str(self._pools.dtype).removeprefix("torch."), self._pools.head_dim), left())
            hello = await recv_msg(ep, TAG_REPLY, m.TO_SENDER, left())
        except Exception as e:
            if ep is not None:
                abort_endpoint(ep)
            raise TransferError("", self.epoch, name, f"connect failed: {failure_reason(e)}") from e
        if not isinstance(hello, m.HelloAck) or not hello.ok:
            abort_endpoint(ep)
            raise TransferError("", self.epoch, name, f"rejected: {getattr(hello, 'error', hello)}")
        conn = SendConnection(name, ep, hello, self._staging_buffers,
                           lambda why: self._break(conn, why))
        conn.tasks = [asyncio.create_task(self._read_acks(conn)),
                      asyncio.create_task(self._pump(conn))]
        self._conns[peer] = conn
        return conn.receiver_rank

    def _conn(self, peer: Address, request_id: str) -> SendConnection:
        conn = self._conns.get(peer)
        if conn is None or conn.broken:
            detail = conn.broken if conn else "not connected"
            raise TransferError(request_id, self.epoch, f"{peer[0]}:{peer[1]}", detail)
        return conn

    async def send_layer(self, peer: Address, request_id: str, copies: Copies, *,
                         timeout_s: Optional[float] = None, ready: Any = None
                         ) -> m.TransferAck:
        """Send one batch of copies (one destination; a layer or a chunk of layers) to
        `peer`; return the ack of its last message once the receiver has written it.
        ready: on CUDA, the event after which the copies' pages hold their values
        (default: recorded now on this thread's current stream).

        ValueError for copies that are not this rank's, not the peer's, or out of the
        pools; TransferError on timeout, rejection (e.g. stale epoch) or a lost peer."""
        conn = self._conn(peer, request_id)
        found = conn.prepared.pop((request_id, id(copies)), None)
        if found is not None and found.epoch != self.epoch:
            conn.withdraw(found)
            found = None
        if found is None:
            found = PreparedBatch(copies, self._cutter.runs(conn, request_id, copies), [], 0, None)
        elif found.timer is not None:
            found.timer.cancel()
        if ready is None:
            ready = self._pools.ready_event()
        batch = SendBatch(request_id, self.epoch, sum(len(a.blocks) for a in found.announced)
                       + sum(len(run.nbytes) for run in found.runs), ready)
        conn.queue.extend((batch, ann) for ann in found.announced)
        conn.queue.extend((batch, run) for run in found.runs)
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

    def prepare(self, peer: Address, request_id: str, copies: Copies, *,
                wait_s: Optional[float] = None) -> None:
        """Do ahead what `send_layer` of these copies does before posting, e.g. while the
        engine computes the layers they read: validate them, locate their templates in
        both sides' pools, cut their blocks into messages, build the gathers' indexes,
        and (`announce`) send the control messages of the parts received in place, so
        that the receiver posts their receives before the pages are computed, and the
        templates of the staged parts, so that it locates them meanwhile. The result is
        kept for the `send_layer` of the same copies object; one not sent within `wait_s`
        (default `timeout_s`), or evicted by later ones, or `withdraw`n, is withdrawn
        from the receiver (a later `send_layer` sends it unannounced). Errors as
        `send_layer`'s; optional (send_layer does what was not done)."""
        conn = self._conn(peer, request_id)
        key, wait = (request_id, id(copies)), self.timeout_s if wait_s is None else wait_s
        runs = self._cutter.runs(conn, request_id, copies)
        for run in runs:
            if not run.pooled:  # gathered: its index is built now, not at the first gather
                self._pools.prebuild(run.sent.tmpl)
        old = conn.prepared.pop(key, None)
        if old is not None:
            conn.withdraw(old)
        announced = []
        if self.announce:
            conn.define(request_id, self.epoch, runs)
            announced = conn.announce(request_id, self.epoch, runs, wait)
        if announced:
            runs = [run for run in runs if not (run.direct and run.pooled)]
        timer = (asyncio.get_running_loop().call_later(wait, self._expire, conn, key)
                 if announced else None)
        conn.prepared[key] = PreparedBatch(copies, runs, announced, self.epoch, timer)
        if len(conn.prepared) > PREPARED:
            conn.withdraw(conn.prepared.popitem(last=False)[1])

    def withdraw(self, request_id: str) -> int:
        """Withdraw every prepared, unsent batch of `request_id` (e.g. its request was
        aborted): the receivers' receives for it end without a write. Returns how many."""
        count = 0
        for conn in self._conns.values():
            for key in [k for k in conn.prepared if k[0] == request_id]:
                conn.withdraw(conn.prepared.pop(key))
                count += 1
        return count

    def _expire(self, conn: SendConnection, key: tuple[str, int]) -> None:
        found = conn.prepared.pop(key, None)
        if found is not None:
            log.info("kv_prepared_expired", peer=conn.peer, request_id=key[0],
                     messages=len(found.announced))
            conn.withdraw(found)

    def _in_place(self, tmpl: PoolTemplate, blocks: np.ndarray, direct: bool
                  ) -> Optional[list[torch.Tensor]]:
        """The message's payload read straight from the pools, one region per transport
        message (per block when direct, else the whole payload), or None when it must be
        gathered: a direct message whose blocks are all spans of this rank's pools, or a
        one-block message that is one."""
        if not direct and len(blocks) != 1:
            return None
        regions = []
        for layer, kind, r0, r1 in blocks.tolist():
            span = tmpl.span(r0, r1)
            if span is None:
                return None
            regions.append(self._pools.region(layer, kind, span))
        return regions

    async def _pump(self, conn: SendConnection) -> None:
        """Gather and post queued parts in order. A message's gather is queued here and
        its sends posted by `_post` once it is complete, so the next message is gathered
        while this one waits. Its waits are bounded by the batches' own deadlines: one
        that expires breaks the connection, which cancels the pump."""
        posted: Optional[asyncio.Future] = None  # the previous message's sends are posted
        try:
            while True:
                while not conn.queue:
                    conn.wake.clear()
                    await conn.wake.wait()
                if isinstance(conn.queue[0][1], AnnouncedMessage):
                    post = self._announced(conn)
                else:
                    post = await self._message(conn)
                mine = asyncio.get_running_loop().create_future()
                conn.tasks.append(asyncio.create_task(post(previous=posted, posted=mine)))
                posted = mine
                await asyncio.sleep(0)  # the post starts waiting for its gather now, not
                # after the next gathers (a free staging buffer never makes the pump yield)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"send failed: {e!r}")

    def _announced(self, conn: SendConnection) -> Callable:
        """The queue's head, an announced message: its `_post` (a `Posted`, then its
        payload from the pools)."""
        batch, ann = conn.queue.popleft()
        conn.pending[ann.seq] = [(batch, len(ann.blocks))]
        return functools.partial(
            self._post, conn, m.Posted(ann.request_id, ann.epoch, ann.seq), None,
            functools.partial(self._in_place, ann.sent.tmpl, ann.blocks, True),
            [batch.ready], direct_tag(ann.seq))

    async def _message(self, conn: SendConnection) -> Callable:
        """The next message cut from the queue's head: its `_post`, its payload
        gathered into a staging buffer unless it is read from the pools."""
        taken, sent, blocks, nbytes, direct, pooled = conn.next_message()
        tmpl = sent.tmpl
        seq = conn.seq = conn.seq + 1  # this message's: `announce` may take more meanwhile
        conn.pending[seq] = taken  # from here on `_break` fails them
        ready = list({id(b): b.ready for b, _ in taken}.values())
        # pooled: the regions are made once the control message is on its way
        payload = (functools.partial(self._in_place, tmpl, blocks, True) if pooled
                   else self._in_place(tmpl, blocks, direct))
        cuts, buf = tmpl.block_bytes(blocks), None
        if payload is None:
            buf = await conn.free.get()
            if buf.numel() < conn.capacity:  # sized once: UCX maps each buffer once
                buf = torch.empty(conn.capacity, dtype=torch.uint8,
                                  device=self._pools.device)
            ready = [self._pools.gather(tmpl, blocks, buf[:nbytes], ready=ready)]
            ends = np.cumsum(cuts).tolist() if direct else [nbytes]
            payload = [buf[a:b] for a, b in zip([0] + ends[:-1], ends)]
        batch = taken[0][0]
        msg = conn.request(seq, batch.request_id, batch.epoch, sent, blocks, nbytes, direct, cuts)
        return functools.partial(self._post, conn, msg, buf, payload, ready,
                                 direct_tag(seq) if direct else TAG_PAYLOAD)

    async def _post(self, conn: SendConnection, msg: Union[m.TransferRequest, m.Posted],
                    buf: Optional[torch.Tensor], payload: Union[list, Callable[[], list]],
                    ready: list[Any], tag: int, *, previous: Optional[asyncio.Future],
                    posted: asyncio.Future) -> None:
        """Once `msg`'s payload is ready (gathered into `buf`, or its pages written) and
        the message before it is posted: post its control message (a `Posted` for an
        announced one) and payload messages on `tag` (`payload`: their buffers, or what
        makes them); recycle the staging buffer once UCX is done with it (never if a
        send failed)."""
        try:
            for event in ready:
                await self._pools.wait(event)
            if previous is not None:
                await previous
            ahead = isinstance(msg, m.TransferRequest)  # the receiver posts after reading it
            sends = post_all(conn.ep, True, TAG_CTRL, [m.frame(msg)])
            if callable(payload):
                payload = payload()
            if ahead and len(payload) >= FLUSH_CTRL_PARTS:
                await asyncio.wait(sends)  # its outcome is checked with the others'
            post_all(conn.ep, True, tag, (ucx_buffer(p) for p in payload), into=sends)
            posted.set_result(None)
            results = await asyncio.gather(*sends, return_exceptions=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"send failed: {e!r}")
            return
        finally:
            if not posted.done():
                posted.cancel()  # the messages after this one are never posted
            task = asyncio.current_task()
            if task in conn.tasks:
                conn.tasks.remove(task)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._break(conn, f"send failed: {errors[0]!r}")
        elif buf is not None:
            conn.free.put_nowait(buf)

    async def _read_acks(self, conn: SendConnection) -> None:
        """Take the connection's acks, with `ACKS_AHEAD` receives kept posted."""
        try:
            posted: deque[tuple[bytearray, asyncio.Future]] = deque()
            for _ in range(ACKS_AHEAD):
                buf = bytearray(m.MAX_REPLY_BYTES)
                posted.append((buf, post_all(conn.ep, False, TAG_REPLY, [buf])[0]))
            while True:
                buf, received = posted.popleft()
                await received  # idle: no deadline
                ack = m.unframe(buf, m.TO_SENDER)  # decoded: repost at once
                posted.append((buf, post_all(conn.ep, False, TAG_REPLY, [buf])[0]))
                if not isinstance(ack, m.TransferAck):
                    raise ValueError(f"unexpected {type(ack).__name__}")
                taken = conn.pending.pop(ack.seq, None)
                if not taken or (ack.request_id, ack.epoch) != (taken[0][0].request_id,
                                                                taken[0][0].epoch):
                    log.warning("kv_ack_dropped", peer=conn.peer, seq=ack.seq,
                                request_id=ack.request_id, epoch=ack.epoch)
                    continue
                for batch, parts in taken:
                    batch.parts_left -= parts
                    if (batch.parts_left == 0 or not ack.ok) and not batch.future.done():
                        batch.future.set_result(ack)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"connection lost: {e!r}")

    def _break(self, conn: SendConnection, reason: str, *, fault: bool = True) -> None:
        """Mark `conn` broken, fail its queued and unacked batches, abort the endpoint."""
        if conn.broken:
            return
        conn.broken = reason
        if fault:
            log.warning("kv_send_conn_broken", peer=conn.peer, reason=reason)
        batches = [b for b, _ in conn.queue] + [b for t in conn.pending.values() for b, _ in t]
        conn.queue.clear()
        conn.pending.clear()
        for prepared in conn.prepared.values():
            if prepared.timer is not None:
                prepared.timer.cancel()
        conn.prepared.clear()
        for batch in batches:
            if not batch.future.done():
                batch.future.set_exception(TransferError(batch.request_id, batch.epoch,
                                                         conn.peer, reason))
                batch.future.exception()  # marks it retrieved: its waiter re-raises it
        for task in conn.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        abort_endpoint(conn.ep)

    async def close(self) -> None:
        for conn in self._conns.values():
            self._break(conn, "sender closed", fault=False)
        self._conns.clear()
        await asyncio.sleep(0)
