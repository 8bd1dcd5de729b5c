"""`PartCutter`: a batch of copies for one connection cut into runs of message parts
(`send_connection.PartRun`), the in-place ones first; what `KVSender.prepare` does ahead and
`send_layer` otherwise. Templates are located once per connection and request, and each
block's cut is kept on its template."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Union

import numpy as np

from ..planning import messages as m
from ..planning.planner import Copy
from .send_connection import PartRun, SentTemplate, SendConnection
from ..planning.spans import SlabSpans
from .staging import KVPools

__all__ = ["Copies", "PartCutter"]

# planner copies, a copy table (messages.encode_copies), or template batches
# (copy_table.plan_batches: no per-call table work)
Copies = Union[Sequence[Copy], np.ndarray, m.CopyBatch, Sequence[m.CopyBatch]]
SENDER_TEMPLATES = 1024  # per connection; receivers keep RECEIVER_TEMPLATES >= this


class PartCutter:
    """Cuts the copies of prefill rank `rank` (its `pools`) into runs of message parts. A
    span of the receiver's pools of at least `in_place_min_bytes` is received in place,
    block by block; smaller pieces travel together through a staging buffer (one message
    each would cost more than the copy it saves)."""

    def __init__(self, pools: KVPools, rank: int, in_place_min_bytes: int) -> None:
        self._pools, self.rank, self.in_place_min_bytes = pools, rank, in_place_min_bytes

    def runs(self, conn: SendConnection, request_id: str, copies: Copies) -> list[PartRun]:
        """`copies` as runs of message parts, the in-place ones first (order otherwise
        kept); ValueError for copies that are not this rank's, not the peer's, or out of
        the pools."""
        parts = []  # (template entry, layer, kind, a, b, bytes, direct, pooled)
        for template_table, blocks in self._batches(copies, conn):
            sent = self._template(conn, request_id, template_table)  # validated once
            error = m.check_blocks(blocks, self._pools.num_layers, sent.tmpl.rows)
            if error:
                raise ValueError(error)
            for layer, kind, r0, r1 in blocks.tolist():
                parts.extend((sent, layer, kind, a, b, n, direct, pooled)
                             for a, b, n, direct, pooled in self._pieces(conn, sent, r0, r1))
        parts.sort(key=lambda part: not part[6])
        runs = []
        for (_, direct, pooled), group in itertools.groupby(
                parts, key=lambda part: (id(part[0]), part[6], part[7])):
            group = list(group)
            runs.append(PartRun(group[0][0], np.array([g[1:5] for g in group], dtype=np.int32),
                             np.array([g[5] for g in group], dtype=np.int64), direct, pooled))
        return runs

    def _batches(self, copies: Copies, conn: SendConnection) -> list[m.CopyBatch]:
        """`copies` as template batches (validated per template and block by the caller)."""
        if isinstance(copies, m.CopyBatch):
            return [copies]
        if isinstance(copies, np.ndarray):  # pre-encoded (messages.encode_copies)
            return m.templates_of(copies)
        if copies and isinstance(copies[0], m.CopyBatch):
            return list(copies)
        bad = [c for c in copies if c.src_rank != self.rank or c.dst_rank != conn.receiver_rank]
        if bad:
            raise ValueError(f"copy {bad[0]} is not from rank {self.rank} to the peer's "
                             f"rank {conn.receiver_rank}")
        return m.templates_of(m.encode_copies(copies))

    def _template(self, conn: SendConnection, request_id: str, table: np.ndarray) -> SentTemplate:
        """The connection's entry for this request's template (new ones located once)."""
        key = (request_id, table.tobytes())
        found = conn.templates.get(key)
        if found is not None:
            conn.templates.move_to_end(key)
            return found
        tmpl = self._pools.template(table, "src")
        dst = None  # copies outside the receiver's pools go staged: it rejects them
        if conn.dst_shape and not m.check_copies(table, "dst", self._pools.num_layers,
                                                 *conn.dst_shape[:3]):
            dst = SlabSpans(table, "dst", *conn.dst_shape[1:])
        found = SentTemplate(conn.next_template, tmpl, dst)
        conn.next_template += 1
        conn.templates[key] = found
        if len(conn.templates) > SENDER_TEMPLATES:  # the receiver keeps more: never stale
            _, old = conn.templates.popitem(last=False)
            conn.defined.discard(old.tid)
        return found

    def _pieces(self, conn: SendConnection, sent: SentTemplate, r0: int, r1: int
                ) -> list[tuple[int, int, int, bool, bool]]:
        """Rows [r0, r1) of a block cut into message pieces (cut once per range):
        (a, b, payload bytes, direct, pooled); direct for the runs of rows that are large
        spans of the receiver's pools, pooled for those that are spans of ours too."""
        found = sent.cuts.get((r0, r1))
        if found is not None:
            return found
        least = self.in_place_min_bytes // (self._pools.row_bytes // self._pools.head_dim)
        runs = sent.dst.split(r0, r1, least) if sent.dst is not None else [(r0, r1, False)]
        found = sent.cuts[(r0, r1)] = [
            (a, b, n, direct, direct and sent.tmpl.span(a, b) is not None)
            for lo, hi, direct in runs
            for (_, _, a, b), n in sent.tmpl.cut((0, 0, lo, hi), conn.capacity)]
        return found
