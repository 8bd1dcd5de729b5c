"""Direct messages of `KVReceiver` (`DirectLanding`, mixed into it; its state and the
rest of the protocol live there): a direct message's blocks are received straight into
the pool spans they name, or into scratch space when it is refused; an announced one
waits for its `Posted` or `Withdrawn`."""

from __future__ import annotations

import asyncio
import functools
from collections import defaultdict
from typing import Any, Optional

import torch

from ..planning import messages as m
from .receive_connection import ReceiveConnection
from ..planning.spans import direct_spans
from .ucx_runtime import post_all, failure_reason, settle_landing, ucx_buffer, direct_tag


class DirectLanding:
    """`KVReceiver`'s methods for direct messages."""

    @staticmethod
    def _verdict(conn: ReceiveConnection, msg: Any) -> None:
        """An announced message is posted or withdrawn. ValueError (the connection ends)
        for one that was not announced or already has its verdict."""
        verdict = conn.verdicts.pop(msg.seq, None)
        if verdict is None or verdict.done():
            raise ValueError(f"{type(msg).__name__} for message {msg.seq}, which is not "
                             f"an announced message waiting for it")
        verdict.set_result(isinstance(msg, m.Posted))

    def _land_in_place(self, conn: ReceiveConnection, msg: m.TransferRequest,
                       verdict: Optional[asyncio.Future]
                       ) -> tuple[str, Optional[tuple[dict, dict]], asyncio.Future]:
        """Post the in-place receives of a direct message: ('', (the request's landed
        rows, slots per layer), their completion). A direct message that cannot be
        written (blocks outside the pools or its layers, spans that are not whole token
        slots, another epoch, a closed gate) is received into scratch space by its
        declared block sizes: (why, None, their completion). Undeclared or inconsistent
        sizes leave the payload unknown: ValueError, the connection ends. `verdict`:
        an announced message's `Posted` (True) or `Withdrawn` (False), to come."""
        sizes = m.direct_sizes(msg, self.max_payload_bytes)
        p, error, spans, tag = self._pools, "", [], direct_tag(msg.seq)
        try:
            spans = direct_spans(m.decode_blocks(msg.blocks), msg.dst_starts, sizes,
                                 range(msg.layer_start, msg.layer_stop), p.num_layers,
                                 p.num_pages * p.heads * p.page_size * p.head_dim,
                                 p.head_dim, p.row_bytes // p.head_dim)
        except ValueError as e:
            error = str(e)
        if error:
            self.stats["rejected"] += 1
        refusal = error or self._refusal(msg)
        if refusal:
            return refusal, None, self._drain(conn, msg, tag, sizes, verdict)
        # Registered before posting: a `release` waits for every receive posted here;
        # the rows are taken now (as in `_apply`).
        rows, recvs = self._rows[msg.request_id], []
        landing = asyncio.get_running_loop().create_future()
        inflight = self._inflight[msg.request_id]
        inflight.add(landing)
        landing.add_done_callback(inflight.discard)
        try:
            post_all(conn.ep, False, tag, (
                ucx_buffer(self._pools.region(layer, kind, span)) for layer, kind, span in spans),
                into=recvs)
        finally:  # also when cut short: the posted ones are waited for (or fail)
            done = asyncio.ensure_future(self._received(conn, recvs, msg, verdict))
            done.add_done_callback(functools.partial(settle_landing, landing))
        self.stats["direct"] += 1
        landed: dict[int, int] = defaultdict(int)
        for layer, _, (a, b) in spans:
            landed[layer] += (b - a) // self._pools.head_dim
        return "", (rows, landed), done

    async def _received(self, conn: ReceiveConnection, recvs: list[asyncio.Future],
                        msg: m.TransferRequest, verdict: Optional[asyncio.Future]) -> None:
        """Until every receive of direct message `msg` completed, within `timeout_s` (of
        its `Posted` or `Withdrawn` if announced, which must come within its
        `announce_ms` plus `timeout_s`); at a deadline or on an error the connection is
        broken first (its endpoint aborted: nothing more lands)."""
        try:
            if verdict is not None:
                await asyncio.wait_for(verdict, msg.announce_ms / 1e3 + self.timeout_s)
            await asyncio.wait_for(asyncio.gather(*recvs), self.timeout_s)
        except BaseException as e:
            self._break(conn, f"in-place receive failed: {failure_reason(e)}")
            raise

    def _drain(self, conn: ReceiveConnection, msg: m.TransferRequest, tag: int, sizes: list[int],
               verdict: Optional[asyncio.Future]) -> asyncio.Future:
        """Receive a refused direct message's payload into scratch space (never the pools;
        each block fits `max_payload_bytes`, written over one another): the receives'
        completion, under `_received`'s deadlines."""
        if conn.scratch is None:
            conn.scratch = torch.empty(self.max_payload_bytes, dtype=torch.uint8,
                                       device=self._pools.device)
        recvs = post_all(conn.ep, False, tag, (ucx_buffer(conn.scratch[:n]) for n in sizes))
        return asyncio.ensure_future(self._received(conn, recvs, msg, verdict))
