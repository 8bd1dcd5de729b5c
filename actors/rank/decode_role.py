"""`DecodeRole`: a rank of the decode DP×EP group whose KV cache receives prompts' KV
from prefill groups (ARCHITECTURE §2).

Each rank listens with a gated `KVReceiver` on its own KV pools. For a request, the
caller (1) reserves pages on the DP leader, (2) opens every rank's gate for the
transfer id, (3) has the prefill group stream into those pages, and, once every prefill
rank reports its batches acked (acks follow the writes), (4) admits the request on the
leader with its first token. A transfer that is abandoned has its gates closed before
its pages are given back, so a late write can never land in reused pages.
"""

from __future__ import annotations

from typing import Optional

from ...kv_transfer.transport.staging_memory import message_bytes
from ...kv_transfer.transport import BlockingKVReceiver, KVReceiverProtocol
from .kv_side import TRANSFER_EPOCH, KVSide
from .role import RankRole

__all__ = ["DecodeRole"]


class DecodeRole(RankRole):
    """Every rank receives KV; the DP leader reserves pages and admits. `host`: the
    address this rank's receiver listens on (its node's IP)."""

    name = "decode"

    def __init__(self, host: str) -> None:
        self._host = host
        self._rank = None
        self._receiver: KVReceiverProtocol = None

    def start(self, rank) -> dict:
        s = rank.spec
        self._rank = rank
        kv = KVSide.open(rank.engine, s.tp, s.rank)
        self._receiver = BlockingKVReceiver(
            kv.transport, rank.engine.runner.caches, rank=s.tp_rank, epoch=TRANSFER_EPOCH,
            host=self._host, timeout_s=s.deadline_s, gated=True,
            max_payload_bytes=message_bytes(rank.engine.device.type))
        return {"kv_address": tuple(self._receiver.start()), "kv_layout": kv.layout}

    def open_gate(self, transfer_id: str) -> None:
        self._receiver.expect(transfer_id)

    def close_gate(self, transfer_id: str) -> None:
        self._receiver.release(transfer_id)

    def reserve_many(self, items: list[tuple[str, list[int], Optional[int]]]
                     ) -> list[Optional[tuple[list[int], int]]]:
        """Decode pages for prompts' KV (DP leader), in order and in one turn of the loop:
        per (request_id, prompt, prefix root) the pages and the prompt tokens they already hold (a
        cached prefix: only the rest is streamed), or None when there is no room now;
        after the first None the rest are not tried (requests start in arrival order)."""
        def reserve(engine) -> list:
            out: list = []
            for request_id, prompt_token_ids, root in items:
                room = not out or out[-1] is not None
                out.append(engine.reserve(request_id, prompt_token_ids, root) if room else None)
            return out
        return self._rank.run_on_loop(reserve)

    def unreserve(self, request_id: str) -> None:
        self._rank.run_on_loop(lambda engine: engine.unreserve(request_id))

    def admit_many(self, items: list[tuple[str, list[int], int, object]]) -> None:
        """Continue requests whose prompt KV has landed in their reserved pages, each
        (request_id, prompt, first token, params), in one turn of the loop. The first
        error is raised once every item was tried; the others stay admitted."""
        ids = [item[0] for item in items]
        self._rank.mailbox.claim(ids)

        def admit(engine) -> list:
            failed = []
            for request_id, prompt_token_ids, first_token, params in items:
                try:
                    engine.admit_prefilled(request_id, prompt_token_ids, first_token, params)
                except Exception as e:  # noqa: BLE001 - raised below, after the others
                    failed.append((request_id, e))
            return failed

        try:
            failed = self._rank.run_on_loop(admit)
        except Exception:
            failed = [(rid, None) for rid in ids]
            raise
        finally:
            self._rank.mailbox.release(rid for rid, _ in failed)
        if failed:
            raise failed[0][1]

    def kv_stats(self) -> dict:
        return self._receiver.stats()
