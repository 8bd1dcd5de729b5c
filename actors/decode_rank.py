"""Decode role: a rank of the decode DP×EP group whose KV cache receives prompts'
KV from prefill groups (ARCHITECTURE §2).

Each rank listens with a gated `KVReceiver` on its own KV pools. For a request, the
caller (1) reserves pages on the DP leader, (2) opens every rank's gate for the
transfer id, (3) has the prefill group stream into those pages, and, once every prefill
rank reports its batches acked (acks follow the writes), (4) admits the request on the
leader with its first token. A transfer that is abandoned has its gates closed before
its pages are given back, so a late write can never land in reused pages.
"""

from __future__ import annotations

from typing import Optional

import ray

from ..kv_transfer.staging_memory import message_bytes
from ..kv_transfer.transport import BlockingKVReceiver
from .kv_rank import TRANSFER_EPOCH, KVRank


class DecodeRank(KVRank):
    """`RankActor` with a KV receiver; the DP leader reserves pages and admits."""

    def __init__(self, spec=None) -> None:
        super().__init__(spec)
        self._receiver = None

    def start(self) -> dict:
        info = super().start()
        s = self.spec
        self._receiver = BlockingKVReceiver(
            self._transport, self.engine.runner.caches, rank=s.tp_rank, epoch=TRANSFER_EPOCH,
            host=ray.util.get_node_ip_address(), timeout_s=s.deadline_s, gated=True,
            max_payload_bytes=message_bytes(self.engine.device.type))
        info["kv_address"] = tuple(self._receiver.start())
        info["kv_layout"] = self.layout
        return info

    def validate(self, prompt_token_ids: list[int], params) -> None:
        """ValueError naming what is wrong with a request (before any work)."""
        self.engine._validate_prompt(prompt_token_ids, params)

    def open_gate(self, transfer_id: str) -> None:
        self._receiver.expect(transfer_id)

    def close_gate(self, transfer_id: str) -> None:
        self._receiver.release(transfer_id)

    def reserve(self, request_id: str, prompt_token_ids: list[int]
                ) -> Optional[tuple[list[int], int]]:
        """Decode pages for a prompt's KV (DP leader) and the prompt tokens they already
        hold (a cached prefix: only the rest is streamed); None when there is no room now."""
        return self.run_on_loop(lambda engine: engine.reserve(request_id, prompt_token_ids))

    def unreserve(self, request_id: str) -> None:
        self.run_on_loop(lambda engine: engine.unreserve(request_id))

    def admit(self, request_id: str, prompt_token_ids: list[int], first_token: int, params) -> None:
        """Continue a request whose prompt KV has landed in its reserved pages."""
        with self._lock:
            self._raise_if_failed()
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._live.add(request_id)
        try:
            self.run_on_loop(lambda engine: engine.admit_prefilled(
                request_id, prompt_token_ids, first_token, params))
        except Exception:
            with self._lock:
                self._live.discard(request_id)
            raise

    def kv_stats(self) -> dict:
        return self._receiver.stats()


RemoteDecodeRank = ray.remote(DecodeRank)
