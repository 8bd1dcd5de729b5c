"""State of one `KVSender` connection: its batches (`SendBatch`), the templates it has
located and defined (`SentTemplate`), runs of message parts (`PartRun`), prepared batches
(`PreparedBatch`) and their announced messages (`AnnouncedMessage`), and the queue its pump sends
from (`SendConnection`, which also numbers, builds, announces and withdraws messages)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Optional, Union

import numpy as np
import torch

from ..planning import messages as m
from ..planning.packed_table import pack_table
from ..planning.spans import SlabSpans
from .staging import PoolTemplate
from .ucx_runtime import TAG_CTRL, post_all, direct_tag

_EMPTY = np.empty(0, dtype=np.uint8)  # a withdrawn block: completes its receive, writes nothing


class SendBatch:
    """One `send_layer` call: done when every part of it is acked."""

    __slots__ = ("request_id", "epoch", "future", "parts_left", "ready")

    def __init__(self, request_id: str, epoch: int, parts: int, ready: Any) -> None:
        self.request_id, self.epoch, self.parts_left = request_id, epoch, parts
        self.ready = ready  # CUDA event the gather waits for (None on CPU)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


class SentTemplate:
    """A template as one connection knows it: its id, its location in this rank's pools,
    its spans in the receiver's (None: the receiver takes no direct payloads) and, per
    row range [r0, r1), how a block of it is cut into message pieces (layer-free)."""

    __slots__ = ("tid", "tmpl", "dst", "cuts")

    def __init__(self, tid: int, tmpl: PoolTemplate, dst: Optional[SlabSpans]) -> None:
        self.tid, self.tmpl, self.dst = tid, tmpl, dst
        # (r0, r1) -> [(a, b, payload bytes, direct, pooled)]
        self.cuts: dict[tuple[int, int], list[tuple[int, int, int, bool, bool]]] = {}


class PartRun:
    """Consecutive message parts of one template, directness and pooledness: blocks
    `[n, 4]` int32 (layer, kind, r0, r1) and their payload bytes `[n]` int64."""

    __slots__ = ("sent", "blocks", "nbytes", "direct", "pooled")

    def __init__(self, sent: SentTemplate, blocks: np.ndarray, nbytes: np.ndarray, direct: bool,
                 pooled: bool) -> None:
        self.sent, self.blocks, self.nbytes = sent, blocks, nbytes
        self.direct, self.pooled = direct, pooled

    def tail(self, k: int) -> "PartRun":
        return PartRun(self.sent, self.blocks[k:], self.nbytes[k:], self.direct, self.pooled)


class AnnouncedMessage:
    """A direct message from this rank's pools whose `TransferRequest` went ahead of its
    payload (`seq`, of `request_id` at `epoch`; its template, blocks `[n, 4]` and their
    payload bytes `[n]`). The queue sends it whole; it is never merged with others."""

    __slots__ = ("seq", "request_id", "epoch", "sent", "blocks", "cuts")

    def __init__(self, seq: int, request_id: str, epoch: int, sent: SentTemplate,
                 blocks: np.ndarray, cuts: np.ndarray) -> None:
        self.seq, self.request_id, self.epoch = seq, request_id, epoch
        self.sent, self.blocks, self.cuts = sent, blocks, cuts


class PreparedBatch:
    """A `prepare`d batch: its copies (their id names it while this holds them), the runs
    of its parts not announced, its announced messages, the epoch they carry, and the
    timer that withdraws them if the batch is not sent in time."""

    __slots__ = ("copies", "runs", "announced", "epoch", "timer")

    def __init__(self, copies: Any, runs: list[PartRun], announced: list[AnnouncedMessage],
                 epoch: int, timer: Optional[asyncio.TimerHandle]) -> None:
        self.copies, self.runs, self.announced = copies, runs, announced
        self.epoch, self.timer = epoch, timer


class SendConnection:
    """One connection to a receiver: its endpoint, what the receiver told (rank, capacity,
    pool shape), the queue and the staging buffers; it numbers and builds the control
    messages."""

    def __init__(self, peer: str, ep: Any, hello: m.HelloAck, staging: int,
                 fail: Callable[[str], None]) -> None:
        self.peer, self.ep, self.receiver_rank = peer, ep, hello.receiver_rank
        self.fail = fail  # breaks the connection, with why
        self.capacity = hello.max_payload_bytes
        self.dst_shape = tuple(hello.pool_shape)  # () : the receiver takes no direct payloads
        self.free: asyncio.Queue[torch.Tensor] = asyncio.Queue()  # staging buffers
        for _ in range(max(1, staging)):
            self.free.put_nowait(torch.empty(0, dtype=torch.uint8))
        self.seq = 0
        # (batch, run of its parts or an announced message); pooled runs: direct parts
        # that are spans of this rank's pools too (sent from them)
        self.queue: deque[tuple[SendBatch, Union[PartRun, AnnouncedMessage]]] = deque()
        self.templates: OrderedDict[tuple[str, bytes], SentTemplate] = OrderedDict()  # (request, table)
        self.defined: set[int] = set()  # template ids whose table the receiver was sent
        # (request, id(copies)) -> its `prepare`d batch, taken by the send
        self.prepared: OrderedDict[tuple[str, int], PreparedBatch] = OrderedDict()
        self.next_template = 0
        self.wake = asyncio.Event()
        self.pending: dict[int, list[tuple[SendBatch, int]]] = {}  # seq -> (batch, its parts in it)
        self.broken = ""
        self.tasks: list[asyncio.Task] = []

    def request(self, seq: int, request_id: str, epoch: int, sent: SentTemplate, blocks: np.ndarray,
                nbytes: int, direct: bool, cuts: np.ndarray, announce_ms: int = 0
                ) -> m.TransferRequest:
        """The control message of message `seq`'s blocks (the seq the caller took: the
        connection's counter may have moved on since, e.g. by an announcement while the
        caller waited for a staging buffer): a direct one says where each block lands
        (no template); a staged one names its template (defined with its first message
        on the connection)."""
        layers = blocks[:, 0]
        head = (request_id, epoch, seq, int(layers.min()), int(layers.max()) + 1)
        if direct:
            starts = sent.dst.start[blocks[:, 2]]  # a span starts where its first row does
            return m.TransferRequest(*head, -1, b"", m.encode_blocks(blocks), nbytes, True,
                                     cuts.astype("<i8").tobytes(),
                                     starts.astype("<i8").tobytes(), announce_ms)
        definition = b"" if sent.tid in self.defined else pack_table(sent.tmpl.table)
        self.defined.add(sent.tid)
        return m.TransferRequest(*head, sent.tid, definition, m.encode_blocks(blocks), nbytes)

    def announce(self, request_id: str, epoch: int, runs: list[PartRun], wait_s: float
                 ) -> list[AnnouncedMessage]:
        """Send ahead the control messages of `runs`' direct parts that are spans of this
        rank's pools (up to `MAX_BLOCKS` blocks each), promising each one's `Posted` or
        `Withdrawn` within `wait_s`: the announced messages, in order."""
        out = []
        for run in runs:
            if not (run.direct and run.pooled):
                continue
            for i in range(0, len(run.nbytes), m.MAX_BLOCKS):
                blocks, cuts = run.blocks[i:i + m.MAX_BLOCKS], run.nbytes[i:i + m.MAX_BLOCKS]
                self.seq += 1
                msg = self.request(self.seq, request_id, epoch, run.sent, blocks,
                                   int(cuts.sum()), True, cuts, max(1, round(wait_s * 1e3)))
                self._ctrl(msg)
                out.append(AnnouncedMessage(self.seq, request_id, epoch, run.sent, blocks, cuts))
        return out

    def define(self, request_id: str, epoch: int, runs: list[PartRun]) -> None:
        """Send ahead the definitions of the templates that `runs`' staged parts name and
        the receiver does not know yet (it locates them while the pages are computed)."""
        for run in runs:
            if not run.direct and run.sent.tid not in self.defined:
                self._ctrl(m.DefineTemplate(request_id, epoch, run.sent.tid,
                                            pack_table(run.sent.tmpl.table)))
                self.defined.add(run.sent.tid)

    def withdraw(self, prepared: PreparedBatch) -> None:
        """Withdraw a prepared batch's announced messages: a `Withdrawn` each, then one
        empty message per block on its tag (the receiver's posted receives complete and
        nothing is written). Its timer is stopped."""
        if prepared.timer is not None:
            prepared.timer.cancel()
        for ann in prepared.announced if not self.broken else ():
            self._ctrl(m.Withdrawn(ann.request_id, ann.epoch, ann.seq))
            for send in post_all(self.ep, True, direct_tag(ann.seq),
                                  [_EMPTY] * len(ann.blocks)):
                send.add_done_callback(self._check)
        prepared.announced = []

    def _ctrl(self, msg: Any) -> None:
        """Post a control message (straight: control messages reach UCX in call order);
        its failure breaks the connection."""
        try:
            post_all(self.ep, True, TAG_CTRL, [m.frame(msg)])[0].add_done_callback(self._check)
        except Exception as e:  # the endpoint failed meanwhile
            self.fail(f"send failed: {e!r}")

    def _check(self, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is not None:
            self.fail(f"send failed: {done.exception()!r}")

    def next_message(self) -> tuple[list[tuple[SendBatch, int]], SentTemplate, np.ndarray, int,
                                    bool, bool]:
        """The queue's head block and the following ones of the same request, epoch,
        template, directness and pooledness, within the receiver's capacity unless
        pooled (a pooled message needs no buffer on either side): ((batch, its blocks
        here) in order, template, blocks, payload bytes, direct, pooled). A run that
        does not fit whole goes back to the queue's head less what was taken. The head
        must be a run (announced messages are taken by the pump as they are)."""
        head_batch, head = self.queue[0]
        taken, blocks, total, count = [], [], 0, 0
        while self.queue and count < m.MAX_BLOCKS:
            batch, run = self.queue[0]
            if (isinstance(run, AnnouncedMessage)
                    or (batch.request_id, batch.epoch) != (head_batch.request_id,
                                                           head_batch.epoch)
                    or run.sent is not head.sent or (run.direct, run.pooled)
                    != (head.direct, head.pooled)):
                break
            k = len(run.nbytes)
            if not head.pooled:  # pieces are cut to the capacity: the first one fits
                k = max(int(np.searchsorted(np.cumsum(run.nbytes), self.capacity - total,
                                            side="right")), 0 if count else 1)
            k = min(k, m.MAX_BLOCKS - count)
            if k == 0:
                break
            self.queue.popleft()
            taken.append((batch, k))
            blocks.append(run.blocks[:k])
            total += int(run.nbytes[:k].sum())
            count += k
            if k < len(run.nbytes):
                self.queue.appendleft((batch, run.tail(k)))
                break
        return (taken, head.sent, np.concatenate(blocks) if len(blocks) > 1 else blocks[0],
                total, head.direct, head.pooled)
