"""State of one `KVSender` connection: its batches (`_Batch`), the templates it has
located and defined (`_Sent`) and the queue its pump sends from (`_SenderConn`)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Any, Optional

import torch

from . import messages as m
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


class _SenderConn:
    def __init__(self, peer: str, ep: Any, hello: m.HelloAck, staging: int) -> None:
        self.peer, self.ep, self.receiver_rank = peer, ep, hello.receiver_rank
        self.capacity = hello.max_payload_bytes
        self.dst_shape = tuple(hello.pool_shape)  # () : the receiver takes no direct payloads
        self.free: asyncio.Queue[torch.Tensor] = asyncio.Queue()  # staging buffers
        for _ in range(max(1, staging)):
            self.free.put_nowait(torch.empty(0, dtype=torch.uint8))
        self.seq = 0
        # (batch, template, block (layer, kind, r0, r1), payload bytes, direct, pooled);
        # pooled: a direct part that is a span of this rank's pools too (sent from them)
        self.queue: deque[tuple[_Batch, _Sent, tuple, int, bool, bool]] = deque()
        self.templates: OrderedDict[tuple[str, bytes], _Sent] = OrderedDict()  # (request, table)
        self.defined: set[int] = set()  # template ids whose table the receiver was sent
        # (request, id(copies)) -> (copies, their parts): `prepare`d, taken by the send
        # (the entry holds the copies, so their id names them while it is here)
        self.prepared: OrderedDict[tuple[str, int], tuple[Any, list]] = OrderedDict()
        self.next_template = 0
        self.wake = asyncio.Event()
        self.pending: dict[int, list[_Batch]] = {}  # seq -> batches with a part in it
        self.broken = ""
        self.tasks: list[asyncio.Task] = []
