"""`SendConnection.next_message`: how the queued runs of message parts become messages.

Pure queue logic (no UCX, no pools): the messages, in order, carry every queued block
once and in queue order; each holds blocks of one request, epoch, template, directness
and pooledness; a staged or direct-but-not-pooled message stays within the receiver's
capacity (its first piece always fits: pieces are cut to it), every message within
`MAX_BLOCKS`; and a message ends only where the next block could not join it."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.kv_transfer.planning import messages as m
from phalanx.kv_transfer.transport.send_connection import SendBatch, PartRun, SendConnection

CAPACITY = 100


@st.composite
def _queues(draw):
    """Runs of 1-6 pieces (sizes 1..CAPACITY) over 2 templates, 2 requests, any flags."""
    runs = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 6))
        direct = draw(st.booleans())
        runs.append((draw(st.integers(0, 1)), draw(st.integers(0, 1)),
                     draw(st.lists(st.integers(1, CAPACITY), min_size=n, max_size=n)),
                     direct, direct and draw(st.booleans())))
    return runs, draw(st.integers(2, 7))


@settings(max_examples=200, deadline=None)
@given(_queues())
def test_messages_take_every_block_once_in_order_within_their_limits(case):
    spec, max_blocks = case

    async def run():
        sents = [object(), object()]
        batches = [SendBatch(f"r{i}", 1, 0, None) for i in range(2)]
        conn = SimpleNamespace(queue=deque(), capacity=CAPACITY)
        order, serial = [], 0
        for req, tmpl, sizes, direct, pooled in spec:
            rows = np.arange(serial, serial + len(sizes), dtype=np.int32)
            serial += len(sizes)
            blocks = np.stack([np.zeros_like(rows), np.zeros_like(rows), rows, rows + 1], 1)
            conn.queue.append((batches[req], PartRun(sents[tmpl], blocks, np.array(sizes), direct,
                                                  pooled)))
            order += [(req, tmpl, direct, pooled, size) for size in sizes]
        saved, m.MAX_BLOCKS = m.MAX_BLOCKS, max_blocks
        try:
            messages = []
            while conn.queue:
                messages.append(SendConnection.next_message(conn))
        finally:
            m.MAX_BLOCKS = saved
        return sents, batches, order, messages

    sents, batches, order, messages = asyncio.run(run())
    got, pos = [], 0
    for taken, sent, blocks, total, direct, pooled in messages:
        assert sum(k for _, k in taken) == len(blocks) <= max_blocks
        keys = {(order[int(r)][0], order[int(r)][1], order[int(r)][2], order[int(r)][3])
                for r in blocks[:, 2]}
        assert len(keys) == 1  # one request, template, directness, pooledness
        req, tmpl, d, p = keys.pop()
        assert (sents[tmpl], d, p) == (sent, direct, pooled)
        assert all(b is batches[req] for b, _ in taken)
        assert total == sum(order[int(r)][4] for r in blocks[:, 2])
        assert pooled or total <= CAPACITY
        got += blocks[:, 2].tolist()
        pos += len(blocks)
        if pos < len(order):  # it ended where the next block could not join it
            nxt = order[pos]
            assert (nxt[:4] != (req, tmpl, d, p) or len(blocks) == max_blocks
                    or (not pooled and total + nxt[4] > CAPACITY))
    assert got == list(range(len(order)))


def test_a_message_keeps_its_seq_while_it_waits_for_a_staging_buffer():
    """A staged message takes its seq, then may wait for a free staging buffer; an
    announcement meanwhile (a `prepare` on the same connection) takes the next seqs. The
    message's control request, its pending entry and its tag keep the seq it took (once
    they read the connection's counter after the wait: its ack then matched another
    message, was dropped, and the batch waited out its deadline)."""
    from kv_cases import case_batches, side_pools

    from phalanx.kv_transfer.transport.sender import KVSender
    from phalanx.kv_transfer.transport.ucx_runtime import TAG_PAYLOAD

    async def run():
        tx = KVSender(side_pools("tp2_to_tp1", "src", 0, "noise"), rank=0, epoch=1)
        hello = m.HelloAck(1, 0, True, 1 << 20, "", ())  # takes nothing in place: staged
        conn = SendConnection("peer", None, hello, staging=1, fail=lambda why: None)
        copies = case_batches("tp2_to_tp1")[(0, 0)]
        runs = tx._cutter.runs(conn, "r", copies)
        batch = SendBatch("r", 1, sum(len(r.nbytes) for r in runs), None)
        conn.queue.extend((batch, run) for run in runs)
        only = await conn.free.get()  # the one staging buffer is busy
        waiting = asyncio.create_task(tx._message(conn))
        await asyncio.sleep(0)
        took = conn.seq
        assert took in conn.pending and not waiting.done()
        conn.seq += 3  # an announcement of three messages meanwhile
        conn.free.put_nowait(only)
        post = await waiting
        msg, tag = post.args[1], post.args[5]
        assert msg.seq == took and conn.pending[took][0][0] is batch, (msg.seq, took)
        assert tag == TAG_PAYLOAD

    asyncio.run(run())
