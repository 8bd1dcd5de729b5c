"""State of one `KVReceiver` connection (`_RecvConn`): its endpoint, the templates its
sender defined, the requests it carried, its staging buffers and its scratch space for
refused payloads."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Optional

import torch

from .staging import _Template


class _RecvConn:
    def __init__(self, ep: Any) -> None:
        self.ep, self.peer = ep, "unknown sender"
        # template id -> (request id, template); LRU, dropped with their request
        self.templates: OrderedDict[int, tuple[str, _Template]] = OrderedDict()
        self.requests: set[str] = set()
        self.scratch: Optional[torch.Tensor] = None  # drains refused direct payloads
        # made when the first staged message arrives (a connection that only carries
        # direct messages holds none)
        self.staging: Optional[list[torch.Tensor]] = None
        self.broken = ""
        self.tasks: list[asyncio.Task] = []
