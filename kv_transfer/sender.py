"""Prefill side of the KV transport: `KVSender` (async, on the transport loop; its
synchronous front is `blocking.BlockingKVSender`). Protocol, deadlines and threading model:
`transport`'s docstring."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from ..log import get_logger
from . import messages as m
from .errors import TransferError
from .planner import Copy
from .send_connection import _Batch, _Run, _Sent, _SenderConn
from .spans import SlabSpans
from .staging import _Pools, _Template
from .ucx_runtime import (TAG_CTRL, TAG_DIRECT, TAG_PAYLOAD, TAG_REPLY, Address, _abort,
                          _post_all, _post_send, _reason, _recv_msg, _send_msg, _ucx_buf,
                          ensure_ucx, progress_mode_for)

__all__ = ["Copies", "KVSender"]

log = get_logger(__name__)
# planner copies, a copy table (messages.encode_copies), or template batches
# (copy_table.plan_batches: no per-call table work)
Copies = Union[Sequence[Copy], np.ndarray, m.CopyBatch, Sequence[m.CopyBatch]]
SENDER_TEMPLATES = 1024  # per connection; receivers keep RECEIVER_TEMPLATES >= this
PREPARED = 1024  # prepared batches kept per connection (oldest dropped: sent unprepared)
# A span of the receiver's pools at least this large is received in place, block by
# block; smaller pieces travel together through a staging buffer (one message each
# costs more than the copy it saves).
IN_PLACE_MIN_BYTES = 256 << 10
# A message of this many payload parts has its control message sent before the parts are
# posted: ucxx's progress thread submits posted operations in batches, so a control
# message posted with many rendezvous sends leaves only once all of them are set up
# (~1.5 ms for 96 on an H200 host), and the receiver, which posts its in-place receives
# only after reading it, would wait that long.
FLUSH_CTRL_PARTS = 8


class KVSender:
    """Prefill side: sends this rank's copies to decode ranks, one connection per peer.

    pools: per layer (k, v) of `[num_pages, kv_heads_local, page_size, head_dim]`.
    rank: this prefill TP rank (`Copy.src_rank`). timeout_s: default deadline of one
    `send_layer` (queueing, staging, send and ack). staging_buffers: messages in flight
    per connection. progress_mode: ucxx's, for the process (default
    `progress_mode_for` the pools' device). Async API: use on one loop (module docstring).
    """

    def __init__(self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], *, rank: int,
                 epoch: int, timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                 staging_buffers: int = 3, progress_mode: Optional[str] = None) -> None:
        self._pools = _Pools(pools)
        self.rank, self.epoch = rank, epoch
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._staging_buffers = staging_buffers
        self._progress_mode = progress_mode or progress_mode_for(self._pools.device)
        self._conns: dict[Address, _SenderConn] = {}

    def ready_event(self) -> Any:
        """`ready` for a later `send_layer`: what the calling thread's current stream has
        queued so far (CUDA; None on CPU)."""
        return self._pools.ready_event()

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

    def _batches(self, copies: Copies, conn: _SenderConn) -> list[m.CopyBatch]:
        """`copies` as template batches (validated per template and block by the caller)."""
        if isinstance(copies, m.CopyBatch):
            return [copies]
        if isinstance(copies, np.ndarray):  # pre-encoded (messages.encode_copies)
            return m.templates_of(copies)
        if copies and isinstance(copies[0], m.CopyBatch):
            return list(copies)
        bad = [c for c in copies if c.src_rank != self.rank or c.dst_rank != conn.receiver_rank]
        if bad:
            raise ValueError(f"copy {bad[0]} is not from rank {self.rank} to the peer's "
                             f"rank {conn.receiver_rank}")
        return m.templates_of(m.encode_copies(copies))

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
        runs = found[1] if found is not None else self._runs(conn, request_id, copies)
        if ready is None:
            ready = self._pools.ready_event()
        batch = _Batch(request_id, self.epoch, sum(len(run.nbytes) for run in runs), ready)
        conn.queue.extend((batch, run) for run in runs)
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

    def prepare(self, peer: Address, request_id: str, copies: Copies) -> None:
        """Do ahead what `send_layer` of these copies does before posting: validate them,
        locate their templates in both sides' pools and cut their blocks into messages
        (all remembered per connection), e.g. while the engine computes the layers they
        read; the result is kept for the `send_layer` of the same copies object. Errors
        as `send_layer`'s; optional (send_layer does what was not done)."""
        conn = self._conn(peer, request_id)
        conn.prepared[(request_id, id(copies))] = (copies, self._runs(conn, request_id, copies))
        if len(conn.prepared) > PREPARED:
            conn.prepared.popitem(last=False)

    def _runs(self, conn: _SenderConn, request_id: str, copies: Copies) -> list[_Run]:
        """`copies` as runs of message parts, the in-place ones first (order otherwise
        kept); ValueError for copies that are not this rank's, not the peer's, or out of
        the pools."""
        parts = []  # (template entry, layer, kind, a, b, bytes, direct, pooled)
        for template_table, blocks in self._batches(copies, conn):
            sent = self._template(conn, request_id, template_table)  # validated once
            error = m.check_blocks(blocks, self._pools.num_layers, sent.tmpl.rows)
            if error:
                raise ValueError(error)
            for layer, kind, r0, r1 in blocks.tolist():
                parts.extend((sent, layer, kind, a, b, n, direct, pooled)
                             for a, b, n, direct, pooled in self._pieces(conn, sent, r0, r1))
        parts.sort(key=lambda part: not part[6])
        runs = []
        for (_, direct, pooled), group in itertools.groupby(
                parts, key=lambda part: (id(part[0]), part[6], part[7])):
            group = list(group)
            runs.append(_Run(group[0][0], np.array([g[1:5] for g in group], dtype=np.int32),
                             np.array([g[5] for g in group], dtype=np.int64), direct, pooled))
        return runs

    def _template(self, conn: _SenderConn, request_id: str, table: np.ndarray) -> _Sent:
        """The connection's entry for this request's template (new ones located once)."""
        key = (request_id, table.tobytes())
        found = conn.templates.get(key)
        if found is not None:
            conn.templates.move_to_end(key)
            return found
        tmpl = self._pools.template(table, "src")
        dst = None  # copies outside the receiver's pools go staged: it rejects them
        if conn.dst_shape and not m.check_copies(table, "dst", self._pools.num_layers,
                                                 *conn.dst_shape[:3]):
            dst = SlabSpans(table, "dst", *conn.dst_shape[1:])
        found = _Sent(conn.next_template, tmpl, dst)
        conn.next_template += 1
        conn.templates[key] = found
        if len(conn.templates) > SENDER_TEMPLATES:  # the receiver keeps more: never stale
            _, old = conn.templates.popitem(last=False)
            conn.defined.discard(old.tid)
        return found

    def _pieces(self, conn: _SenderConn, sent: _Sent, r0: int, r1: int
                ) -> list[tuple[int, int, int, bool, bool]]:
        """Rows [r0, r1) of a block cut into message pieces (cut once per range):
        (a, b, payload bytes, direct, pooled); direct for the runs of rows that are large
        spans of the receiver's pools, pooled for those that are spans of ours too."""
        found = sent.cuts.get((r0, r1))
        if found is not None:
            return found
        least = IN_PLACE_MIN_BYTES // (self._pools.row_bytes // self._pools.head_dim)
        runs = sent.dst.split(r0, r1, least) if sent.dst is not None else [(r0, r1, False)]
        found = sent.cuts[(r0, r1)] = [
            (a, b, n, direct, direct and sent.tmpl.span(a, b) is not None)
            for lo, hi, direct in runs
            for (_, _, a, b), n in sent.tmpl.cut((0, 0, lo, hi), conn.capacity)]
        return found

    def _next_message(self, conn: _SenderConn) -> tuple[list[tuple[_Batch, int]], _Sent,
                                                        np.ndarray, int, bool, bool]:
        """The queue's head block and the following ones of the same request, epoch,
        template, directness and pooledness, within the receiver's capacity unless
        pooled (a pooled message needs no buffer on either side): ((batch, its blocks
        here) in order, template, blocks, payload bytes, direct, pooled). A run that
        does not fit whole goes back to the queue's head less what was taken."""
        head_batch, head = conn.queue[0]
        taken, blocks, total, count = [], [], 0, 0
        while conn.queue and count < m.MAX_BLOCKS:
            batch, run = conn.queue[0]
            if ((batch.request_id, batch.epoch) != (head_batch.request_id, head_batch.epoch)
                    or run.sent is not head.sent or (run.direct, run.pooled)
                    != (head.direct, head.pooled)):
                break
            k = len(run.nbytes)
            if not head.pooled:  # pieces are cut to the capacity: the first one fits
                k = max(int(np.searchsorted(np.cumsum(run.nbytes), conn.capacity - total,
                                            side="right")), 0 if count else 1)
            k = min(k, m.MAX_BLOCKS - count)
            if k == 0:
                break
            conn.queue.popleft()
            taken.append((batch, k))
            blocks.append(run.blocks[:k])
            total += int(run.nbytes[:k].sum())
            count += k
            if k < len(run.nbytes):
                conn.queue.appendleft((batch, run.tail(k)))
                break
        return (taken, head.sent, np.concatenate(blocks) if len(blocks) > 1 else blocks[0],
                total, head.direct, head.pooled)

    def _in_place(self, tmpl: _Template, blocks: np.ndarray, direct: bool
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

    async def _pump(self, conn: _SenderConn) -> None:
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
                taken, sent, blocks, nbytes, direct, pooled = self._next_message(conn)
                tmpl = sent.tmpl
                conn.seq += 1
                conn.pending[conn.seq] = taken  # from here on `_break` fails them
                ready = list({id(b): b.ready for b, _ in taken}.values())
                # pooled: the regions are made once the control message is on its way
                payload = (functools.partial(self._in_place, tmpl, blocks, True) if pooled
                           else self._in_place(tmpl, blocks, direct))
                cuts, buf = tmpl.bytes_cum[blocks[:, 3]] - tmpl.bytes_cum[blocks[:, 2]], None
                if payload is None:
                    buf = await conn.free.get()
                    if buf.numel() < conn.capacity:  # sized once: UCX maps each buffer once
                        buf = torch.empty(conn.capacity, dtype=torch.uint8,
                                          device=self._pools.device)
                    ready = [self._pools.gather(tmpl, blocks, buf[:nbytes], ready=ready)]
                    ends = np.cumsum(cuts).tolist() if direct else [nbytes]
                    payload = [buf[a:b] for a, b in zip([0] + ends[:-1], ends)]
                msg = conn.request(taken[0][0], sent, blocks, nbytes, direct, cuts)
                mine = asyncio.get_running_loop().create_future()
                conn.tasks.append(asyncio.create_task(
                    self._post(conn, msg, buf, payload, ready, posted, mine)))
                posted = mine
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, f"send failed: {e!r}")

    async def _post(self, conn: _SenderConn, msg: m.TransferRequest,
                    buf: Optional[torch.Tensor], payload: Union[list, Callable[[], list]],
                    ready: list[Any], previous: Optional[asyncio.Future],
                    posted: asyncio.Future) -> None:
        """Once `msg`'s payload is ready (gathered into `buf`, or its pages written) and
        the message before it is posted: post its control message and payload messages
        (`payload`: their buffers, or what makes them); recycle the staging buffer once
        UCX is done with it (never if a send failed)."""
        try:
            for event in ready:
                await self._pools.wait(event)
            if previous is not None:
                await previous
            tag = TAG_DIRECT if msg.direct else TAG_PAYLOAD
            sends = [_post_send(conn.ep, TAG_CTRL, m.frame(msg))]
            if callable(payload):
                await asyncio.sleep(0)  # the control message reaches UCX first
                payload = payload()
            if len(payload) >= FLUSH_CTRL_PARTS:
                await asyncio.wait(sends)  # its outcome is checked with the others'
            _post_all(conn.ep, True, tag, (_ucx_buf(p) for p in payload), into=sends)
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

    async def _read_acks(self, conn: _SenderConn) -> None:
        try:
            while True:
                ack = await _recv_msg(conn.ep, TAG_REPLY, m.TO_SENDER, None)  # idle: no deadline
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

    def _break(self, conn: _SenderConn, reason: str, *, fault: bool = True) -> None:
        """Mark `conn` broken, fail its queued and unacked batches, abort the endpoint."""
        if conn.broken:
            return
        conn.broken = reason
        if fault:
            log.warning("kv_send_conn_broken", peer=conn.peer, reason=reason)
        batches = [b for b, _ in conn.queue] + [b for t in conn.pending.values() for b, _ in t]
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
