"""Synchronous fronts of the KV transport for callers outside its event loop (the
engine's threads): `BlockingKVSender` and `BlockingKVReceiver` live on a
`TransportThread`'s loop and forward each call there with a bounded wait. Protocol,
deadlines and threading model: `transport`'s docstring."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..planning import messages as m
from .receiver import KVReceiver
from .part_cutter import Copies
from .sender import KVSender
from .ucx_runtime import BLOCKING_MARGIN_S, Address, TransportThread, on_loop

__all__ = ["BlockingKVReceiver", "BlockingKVSender"]


class BlockingKVSender:
    """`KVSender` for synchronous callers (e.g. the engine thread), living on `thread`'s
    loop; keyword arguments as `KVSender`'s. `submit_layer` returns a concurrent Future at
    once (stream layer l while computing layer l+1); `send_layer_sync` waits for the ack.
    Errors as `KVSender`'s, raised by the Future or the call."""

    def __init__(self, thread: TransportThread, pools: Sequence[tuple[torch.Tensor, ...]],
                 **kwargs: Any) -> None:
        self.thread = thread
        self.sender: KVSender = thread.call(on_loop(KVSender, pools, **kwargs), BLOCKING_MARGIN_S)

    def connect(self, peer: Address) -> int:
        return self.thread.call(self.sender.connect(peer),
                                self.sender.connect_timeout_s + BLOCKING_MARGIN_S)

    def submit_layer(self, peer: Address, request_id: str, copies: Copies, *,
                     timeout_s: Optional[float] = None) -> concurrent.futures.Future:
        """The pages are read after what this thread's current stream has queued so far."""
        ready = self.sender.ready_event()
        return self.thread.submit(self.sender.send_layer(peer, request_id, copies,
                                                         timeout_s=timeout_s, ready=ready))

    def prepare(self, batches: Sequence[tuple[Address, str, Copies]]
                ) -> concurrent.futures.Future:
        """`KVSender.prepare` of each (peer, request_id, copies), queued on the loop as
        one call (returns at once: it runs there before the sends submitted after it).
        Every batch is tried; the Future raises the first error."""
        return self.thread.submit(on_loop(_prepare_all, self.sender, batches))

    def withdraw(self, request_id: str) -> int:
        """`KVSender.withdraw`: how many prepared batches were withdrawn."""
        return self.thread.call(on_loop(self.sender.withdraw, request_id), BLOCKING_MARGIN_S)

    def send_layer_sync(self, peer: Address, request_id: str, copies: Copies, *,
                        timeout_s: Optional[float] = None) -> m.TransferAck:
        bound = (self.sender.timeout_s if timeout_s is None else timeout_s) + BLOCKING_MARGIN_S
        return self.submit_layer(peer, request_id, copies, timeout_s=timeout_s).result(bound)

    def set_epoch(self, epoch: int) -> None:
        self.thread.call(on_loop(self.sender.set_epoch, epoch), BLOCKING_MARGIN_S)

    def close(self) -> None:
        self.thread.call(self.sender.close(), BLOCKING_MARGIN_S)


def _prepare_all(sender: KVSender, batches: Sequence[tuple[Address, str, Copies]]) -> None:
    errors = []
    for peer, request_id, copies in batches:
        try:
            sender.prepare(peer, request_id, copies)
        except Exception as e:  # that batch is sent unprepared (and fails there)
            errors.append(e)
    if errors:
        raise errors[0]


class BlockingKVReceiver:
    """`KVReceiver` for synchronous callers, living on `thread`'s loop; keyword arguments
    as `KVReceiver`'s (`on_landed` runs on that loop's thread)."""

    def __init__(self, thread: TransportThread, pools: Sequence[tuple[torch.Tensor, ...]],
                 **kwargs: Any) -> None:
        self.thread = thread
        self.receiver: KVReceiver = thread.call(on_loop(KVReceiver, pools, **kwargs),
                                                BLOCKING_MARGIN_S)

    def start(self) -> Address:
        return self.thread.call(self.receiver.start(), BLOCKING_MARGIN_S)

    def wait_request_sync(self, request_id: str, num_tokens: int, *,
                          layers: Optional[range] = None,
                          timeout_s: Optional[float] = None) -> None:
        bound = (self.receiver.timeout_s if timeout_s is None else timeout_s) + BLOCKING_MARGIN_S
        self.thread.call(self.receiver.wait_request(request_id, num_tokens, layers=layers,
                                                    timeout_s=timeout_s), bound)

    def set_epoch(self, epoch: int) -> None:
        self.thread.call(on_loop(self.receiver.set_epoch, epoch), BLOCKING_MARGIN_S)

    def expect(self, request_id: str) -> None:
        self.thread.call(on_loop(self.receiver.expect, request_id), BLOCKING_MARGIN_S)

    def release(self, request_id: str) -> None:
        self.thread.call(self.receiver.release(request_id), self.receiver.timeout_s + BLOCKING_MARGIN_S)

    def landed(self, request_id: str) -> dict[int, int]:
        return self.thread.call(on_loop(self.receiver.landed, request_id), BLOCKING_MARGIN_S)

    def stats(self) -> dict[str, int]:
        return self.thread.call(on_loop(dict, self.receiver.stats), BLOCKING_MARGIN_S)

    def close(self) -> None:
        self.thread.call(self.receiver.close(), BLOCKING_MARGIN_S)
