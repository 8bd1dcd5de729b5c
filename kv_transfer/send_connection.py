"""State of one `KVSender` connection: its batches (`_Batch`), the templates it has
located and defined (`_Sent`), runs of message parts (`_Run`) and the queue its pump
sends from (`_SenderConn`)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Any, Optional

import numpy as np
import torch

from . import messages as m
from .packed_table import pack_table
from .spans import SlabSpans
from .staging import _Template


class _Batch:
    """One `send_layer` call: done when every part of it is acked."""

    __slots__ = ("request_id", "epoch", "future", "parts_left", "ready")

    def __init__(self, request_id: str, epoch: int, parts: int, ready: Any) -> None:
        self.request_id, self.epoch, self.parts_left = request_id, epoch, parts
        self.ready = ready  # CUDA event the gather waits for (None on CPU)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


class _Sent:
    """A template as one connection knows it: its id, its location in this rank's pools,
    its spans in the receiver's (None: the receiver takes no direct payloads) and, per
    row range [r0, r1), how a block of it is cut into message pieces (layer-free)."""

    __slots__ = ("tid", "tmpl", "dst", "cuts")

    def __init__(self, tid: int, tmpl: _Template, dst: Optional[SlabSpans]) -> None:
        self.tid, self.tmpl, self.dst = tid, tmpl, dst
        # (r0, r1) -> [(a, b, payload bytes, direct, pooled)]
        self.cuts: dict[tuple[int, int], list[tuple[int, int, int, bool, bool]]] = {}


class _Run:
    """Consecutive message parts of one template, directness and pooledness: blocks
    `[n, 4]` int32 (layer, kind, r0, r1) and their payload bytes `[n]` int64."""

    __slots__ = ("sent", "blocks", "nbytes", "direct", "pooled")

    def __init__(self, sent: _Sent, blocks: np.ndarray, nbytes: np.ndarray, direct: bool,
                 pooled: bool) -> None:
        self.sent, self.blocks, self.nbytes = sent, blocks, nbytes
        self.direct, self.pooled = direct, pooled

    def tail(self, k: int) -> "_Run":
        return _Run(self.sent, self.blocks[k:], self.nbytes[k:], self.direct, self.pooled)


class _SenderConn:
    """One connection to a receiver: its endpoint, what the receiver told (rank, capacity,
    pool shape), the queue and the staging buffers; it numbers and builds the control
    messages."""

    def __init__(self, peer: str, ep: Any, hello: m.HelloAck, staging: int) -> None:
        self.peer, self.ep, self.receiver_rank = peer, ep, hello.receiver_rank
        self.capacity = hello.max_payload_bytes
        self.dst_shape = tuple(hello.pool_shape)  # () : the receiver takes no direct payloads
        self.free: asyncio.Queue[torch.Tensor] = asyncio.Queue()  # staging buffers
        for _ in range(max(1, staging)):
            self.free.put_nowait(torch.empty(0, dtype=torch.uint8))
        self.seq = 0
        # (batch, run of its parts); pooled runs: direct parts that are spans of this
        # rank's pools too (sent from them)
        self.queue: deque[tuple[_Batch, _Run]] = deque()
        self.templates: OrderedDict[tuple[str, bytes], _Sent] = OrderedDict()  # (request, table)
        self.defined: set[int] = set()  # template ids whose table the receiver was sent
        # (request, id(copies)) -> (copies, their runs): `prepare`d, taken by the send
        # (the entry holds the copies, so their id names them while it is here)
        self.prepared: OrderedDict[tuple[str, int], tuple[Any, list]] = OrderedDict()
        self.next_template = 0
        self.wake = asyncio.Event()
        self.pending: dict[int, list[tuple[_Batch, int]]] = {}  # seq -> (batch, its parts in it)
        self.broken = ""
        self.tasks: list[asyncio.Task] = []

    def request(self, batch: _Batch, sent: _Sent, blocks: np.ndarray, nbytes: int,
                direct: bool, cuts: np.ndarray) -> m.TransferRequest:
        """The control message of a message's blocks: a direct one says where each block
        lands (no template); a staged one names its template (defined with its first
        message on the connection)."""
        layers = blocks[:, 0]
        head = (batch.request_id, batch.epoch, self.seq, int(layers.min()), int(layers.max()) + 1)
        if direct:
            starts = sent.dst.start[blocks[:, 2]]  # a span starts where its first row does
            return m.TransferRequest(*head, -1, b"", m.encode_blocks(blocks), nbytes, True,
                                     cuts.astype("<i8").tobytes(),
                                     starts.astype("<i8").tobytes())
        definition = b"" if sent.tid in self.defined else pack_table(sent.tmpl.table)
        self.defined.add(sent.tid)
        return m.TransferRequest(*head, sent.tid, definition, m.encode_blocks(blocks), nbytes)
