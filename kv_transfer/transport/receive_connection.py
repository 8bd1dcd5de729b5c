"""State of one `KVReceiver` connection (`ReceiveConnection`): its endpoint, the templates its
sender defined, the requests it carried, its staging buffers and its scratch space for
refused payloads; and its handshake."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from ..planning import messages as m
from .staging import PoolTemplate
from .ucx_runtime import TAG_CTRL, TAG_REPLY, post_recv, recv_msg, send_msg


class ReceiveConnection:
    def __init__(self, ep: Any) -> None:
        self.ep, self.peer = ep, "unknown sender"
        # template id -> (request id, template, or why the one defined ahead is invalid);
        # LRU, dropped with their request
        self.templates: OrderedDict[int, tuple[str, Union[PoolTemplate, str]]] = OrderedDict()
        self.requests: set[str] = set()
        # seq -> announced direct message's verdict: True when posted, False withdrawn
        self.verdicts: dict[int, asyncio.Future] = {}
        self.scratch: Optional[torch.Tensor] = None  # drains refused direct payloads
        # made when the first staged message arrives (a connection that only carries
        # direct messages holds none)
        self.staging: Optional[list[torch.Tensor]] = None
        self.broken = ""
        self.tasks: list[asyncio.Task] = []

    async def handshake(self, mine: tuple, ack: Callable[[str], m.HelloAck],
                        timeout_s: float) -> None:
        """Read the sender's `Hello` and answer `ack(why it is refused, '' if not)`: its
        (version, epoch, dtype, head_dim) must equal `mine`. A refusal waits for the
        sender to read it and hang up (or `timeout_s`), then raises ValueError."""
        hello = await recv_msg(self.ep, TAG_CTRL, m.TO_RECEIVER, timeout_s)
        self.peer = f"sender rank {getattr(hello, 'sender_rank', '?')}"
        if not isinstance(hello, m.Hello):
            error = f"expected Hello, got {type(hello).__name__}"
        else:
            theirs = (hello.version, hello.epoch, hello.dtype, hello.head_dim)
            error = ("" if mine == theirs
                     else f"(version, epoch, dtype, head_dim) {theirs} != {mine}")
        await send_msg(self.ep, TAG_REPLY, ack(error), timeout_s)
        if error:
            try:
                await asyncio.wait_for(post_recv(self.ep, TAG_CTRL, bytearray(8)), timeout_s)
            except Exception:  # the hang-up (or our deadline)
                pass
            raise ValueError(f"refused: {error}")
