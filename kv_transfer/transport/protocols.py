"""What the prefill and decode roles need of the KV transport (the part vLLM's KV
connector plays): a sender that streams a request's pages layer by layer while the
engine computes, and a gated receiver that lets only expected transfers land.

Implemented by `blocking.BlockingKVSender` / `blocking.BlockingKVReceiver` (UCX through
ucxx, on a `TransportThread`); the roles (`actors/rank/prefill_role.py`,
`actors/rank/decode_role.py`) hold them only through these protocols.

Contract:
- Addresses are `(host, port)`; a transfer id names one request's attempt (a retried
  request gets a new one, so a late write of an old attempt is never accepted).
- Every call and every returned future ends within the transport's deadline: a lost peer
  or a timeout raises `errors.TransferError`, never hangs.
- The sender reads a page only after what the calling thread's current stream has queued
  (so a layer is sent once computed); the receiver writes a page only for a transfer id it
  `expect`s, and `release` closes the gate before the pages are given back.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .part_cutter import Copies
from .ucx_runtime import Address

__all__ = ["KVReceiverProtocol", "KVSenderProtocol"]


@runtime_checkable
class KVSenderProtocol(Protocol):
    def connect(self, peer: Address) -> int:
        """Open (or reuse) the connection to a receiver; its TP rank."""

    def prepare(self, batches: Sequence[tuple[Address, str, Copies]]
                ) -> concurrent.futures.Future:
        """Locate and cut each (peer, transfer id, copies) ahead of its send, announcing
        pool-to-pool parts so the receiver posts its receives early; returns at once."""

    def submit_layer(self, peer: Address, request_id: str, copies: Copies
                     ) -> concurrent.futures.Future:
        """Send one layer's copies of a transfer; the future ends when they are acked."""

    def withdraw(self, request_id: str) -> int:
        """Drop what was prepared or announced for a transfer; how many batches."""


@runtime_checkable
class KVReceiverProtocol(Protocol):
    def start(self) -> Address:
        """Listen; the address senders connect to."""

    def expect(self, request_id: str) -> None:
        """Open the gate for a transfer id: its writes may land from now on."""

    def release(self, request_id: str) -> None:
        """Close the gate for a transfer id (before its pages are reused)."""

    def stats(self) -> dict[str, int]:
        """Counters of what landed and what was refused."""
