"""The KV transport's pieces driven in-process, without a peer: the wire format, gather and
scatter against the plan, the receiver's refusals, in-place receives through a fake
endpoint, and how device regions reach ucxx. Cases: `kv_cases`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_cases import LAYERS, case_layouts, case_plan, side_pools, zero_pools

from phalanx.kv_transfer.planning.packed_table import pack_table


def test_wire_format_round_trips_and_validates():
    """Framed msgspec messages round-trip; copy tables encode compactly and cut into
    templates + blocks that replay to the same table; out-of-range copies are named."""
    from phalanx.kv_transfer.planning import messages as m
    req = m.TransferRequest("r", 3, 7, 0, 2, 5, b"\x01\x02", b"", 10)
    buf = bytearray(m.frame(req)) + bytearray(100)  # a fixed receive buffer, partly used
    assert m.unframe(buf, m.TO_RECEIVER) == req
    with pytest.raises(ValueError):
        m.unframe(bytearray(16), m.TO_RECEIVER)
    plan = case_plan("tp2_to_tp1")
    table = m.encode_copies(plan.copies)
    assert table.shape == (len(plan), 10) and table.dtype == np.int32
    pair = m.encode_copies([c for c in plan if c.src_rank == 0])
    parts = m.templates_of(pair)
    assert len(parts) == 1, "every (layer, kind) of a plan repeats one template"
    replay = []
    for template, blocks in m.templates_of(table):
        for layer, kind, r0, r1 in blocks.tolist():
            rows = template[r0:r1].copy()
            rows[:, m.F_LAYER], rows[:, m.F_KIND] = layer, kind
            replay.append((layer, kind, rows))
    assert np.array_equal(np.concatenate([r for _, _, r in replay]), table)
    blocks = parts[0][1]
    assert np.array_equal(m.decode_blocks(m.encode_blocks(blocks)), blocks)
    assert m.check_blocks(blocks, LAYERS, len(parts[0][0])) == ""
    assert "out of range" in m.check_blocks(blocks + [[0, 0, 0, 1]], LAYERS, len(parts[0][0]))
    bad = table.copy()
    bad[3, m.F_DST_PAGE] = 10**6
    assert "dst page" in m.check_copies(bad, "dst", LAYERS, 20, 4, 8)
    assert m.check_copies(table, "dst", LAYERS, 20, 4, 8) == ""


def _one_allocation(pools: list) -> list:
    """The same pools as views of one `[layers, 2, ...]` tensor (the engine's layout)."""
    buf = torch.stack([torch.stack(pair) for pair in pools])
    return [(buf[i, 0], buf[i, 1]) for i in range(len(pools))]


@pytest.mark.parametrize("one_allocation", [False, True], ids=["per_pool", "one_allocation"])
@pytest.mark.parametrize("case", ["tp2_to_tp1", "tp1_to_tp2", "tp4_kv2_to_tp1"])
def test_gather_scatter_match_the_plan_in_process(case, one_allocation):
    """The transport's gather (every src rank) + scatter equal the plan applied slab by
    slab, whatever granule each side picks (partial pages, different page sizes), also
    when blocks are cut at row boundaries to fit small messages; with pools allocated
    one by one (a copy per granule run) and as one allocation (a copy per message)."""
    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.transport import KVPools
    plan = case_plan(case)
    shape = _one_allocation if one_allocation else (lambda pools: pools)
    for d in range(case_layouts(case)[1].tp):
        dst = KVPools(shape(zero_pools(case, d)))
        assert (dst._flat is not None) == one_allocation
        for s in range(case_layouts(case)[0].tp):
            table = m.encode_copies([c for c in plan if (c.src_rank, c.dst_rank) == (s, d)])
            src = KVPools(shape(side_pools(case, "src", s, "noise")))
            for template, blocks in m.templates_of(table):
                tx, rx = src.template(template, "src"), dst.template(template, "dst")
                pieces = [p for b in blocks.tolist() for p, _ in tx.cut(b, 700)]
                cut = np.array(pieces, dtype=np.int32)
                buf = torch.empty(tx.nbytes(cut), dtype=torch.uint8)
                assert src.gather(tx, cut, buf) is None  # CPU: done on return
                landed, done = dst.scatter(rx, cut, buf)
                assert done is None and sum(landed.values()) == rx.slots_cum[-1] * len(blocks)
        want = side_pools(case, "dst", d, "zero")
        assert all(torch.equal(want[l][k], dst.pools[l][k]) for l in range(LAYERS)
                   for k in range(2))


def test_receiver_rejects_bad_batches_without_writing():
    """An out-of-range template, a malformed packed template, a payload size that
    disagrees with the blocks, an unknown template, another epoch, or a template defined
    ahead that was out of range: the batch is dropped with a reason and the pools stay
    untouched (a good template defined ahead is used)."""
    import asyncio
    from collections import OrderedDict
    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.transport.receive_connection import ReceiveConnection
    from phalanx.kv_transfer.transport import KVReceiver

    async def run():
        pools = zero_pools("tp1_to_tp1", 0)
        rx = KVReceiver(pools, rank=0, epoch=2)
        ((template, blocks),) = m.templates_of(
            m.encode_copies(case_plan("tp1_to_tp1").for_layer(0).copies))
        n = m.payload_nbytes(template, 8, 4) * len(blocks)
        payload = torch.ones(n, dtype=torch.uint8)
        bad = template.copy()
        bad[0, m.F_DST_HEAD] = 3
        raw, tb = m.encode_blocks(blocks), pack_table(template)
        known: OrderedDict = OrderedDict()
        errors = [rx._apply(m.TransferRequest("r", 2, 1, 0, 1, 0, pack_table(bad), raw, n),
                            payload, OrderedDict()),
                  rx._apply(m.TransferRequest("r", 2, 1, 0, 1, 0, tb[:-8], raw, n),
                            payload, OrderedDict()),
                  rx._apply(m.TransferRequest("r", 2, 2, 0, 1, 1, tb, raw, n - 4), payload, known),
                  rx._apply(m.TransferRequest("r", 2, 3, 0, 1, 7, b"", raw, n), payload, known),
                  rx._apply(m.TransferRequest("r", 1, 4, 0, 1, 1, b"", raw, n), payload, known)]
        conn = ReceiveConnection(None)  # templates defined ahead: a bad one, then a good one
        rx._define(conn, m.DefineTemplate("r", 2, 8, pack_table(bad)))
        rx._define(conn, m.DefineTemplate("r", 2, 9, tb))
        errors.append(rx._apply(m.TransferRequest("r", 2, 5, 0, 1, 8, b"", raw, n), payload,
                                conn.templates))
        assert all(landed is None and event is None for _, landed, event in errors)
        untouched = all(not t.any() for pair in pools for t in pair)
        good = rx._apply(m.TransferRequest("r", 2, 6, 0, 1, 9, b"", raw, n), payload,
                         conn.templates)
        return [e for e, _, _ in errors], rx.stats, good[0], untouched

    errors, stats, good, untouched = asyncio.run(run())
    assert "dst head range" in errors[0] and "packed table" in errors[1]
    assert "does not match" in errors[2]
    assert "unknown template 7" in errors[3] and "stale epoch 1" in errors[4]
    assert errors[5].startswith("template 8: ") and "dst head range" in errors[5]
    assert good == "" and stats["defined_ahead"] == 2
    assert stats["rejected"] == 5 and stats["dropped_epoch"] == 1 and untouched

class _FakeEndpoint:
    """Records posted receives; `deliver` fills them in posting order (as UCX matches)."""

    def __init__(self) -> None:
        self.posted: list = []  # (tag, buffer, future)

    async def recv(self, buf, tag):
        import asyncio
        fut = asyncio.get_running_loop().create_future()
        self.posted.append((tag, buf, fut))
        await fut

    def deliver(self, value: int) -> int:
        n = 0
        for _, buf, fut in self.posted:
            if not fut.done():
                np.asarray(buf)[...] = value
                fut.set_result(None)
                n += 1
        return n

    def abort(self, period=0) -> None:
        pass


def test_in_place_receives_land_and_release_waits_for_them():
    """A direct message is received into the pool spans its blocks say (nothing else is
    written; no template is needed); `release` of its request, even one called while
    the receives are still being posted, returns only once they all completed. A direct message of another epoch, or one whose blocks do not
    land inside the pools, is received into scratch space by its declared block sizes:
    the pools stay as they were and the connection goes on."""
    import asyncio
    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.transport.receive_connection import ReceiveConnection
    from phalanx.kv_transfer.transport.receiver import KVReceiver
    from phalanx.kv_transfer.transport.ucx_runtime import direct_tag

    case = "tp1_to_tp1_runs"
    ((template, blocks),) = m.templates_of(m.encode_copies(case_plan(case).copies))

    async def run():
        pools = zero_pools(case, 0)
        rx = KVReceiver(pools, rank=0, epoch=1, gated=True)
        rx.expect("r")
        tmpl = rx._pools.template(template, "dst")
        whole = [(layer, kind, r0, b) for layer, kind, r0, r1 in blocks.tolist()
                 for a, b, direct in tmpl.spans.split(r0, r1, 1) if direct and a == r0]
        direct = np.array(whole, dtype=np.int32)
        n = tmpl.nbytes(direct)
        sizes = tmpl.block_bytes(direct).astype("<i8").tobytes()
        starts = tmpl.spans.start[direct[:, 2]].astype("<i8")
        conn = ReceiveConnection(_FakeEndpoint())
        msg = m.TransferRequest("r", 1, 1, 0, LAYERS, -1, b"", m.encode_blocks(direct),
                                n, True, sizes, starts.tobytes())
        error, landed, done = rx._land_in_place(conn, msg, None)
        releasing = asyncio.ensure_future(rx.release("r"))  # the receives are being posted
        while len(conn.ep.posted) < len(direct):
            await asyncio.sleep(0.001)
        assert error == "" and len(conn.ep.posted) == len(direct) >= 4
        assert all(tag == direct_tag(1) for tag, _, _ in conn.ep.posted)
        await asyncio.sleep(0.05)
        held = not releasing.done()
        assert conn.ep.deliver(0x3F) == len(direct)
        await asyncio.wait_for(releasing, 5)
        await done
        written = sum(int((t.view(torch.uint8) == 0x3F).sum()) for pair in pools for t in pair)
        rx.expect("r")
        before = [t.clone() for pair in pools for t in pair]
        refusals = []
        outside = starts.copy()
        p = rx._pools
        outside[-1] = p.num_pages * p.heads * p.page_size * p.head_dim  # just past the pool
        for seq, (epoch, at) in enumerate([(7, starts), (1, outside)], start=2):
            refused = m.TransferRequest("r", epoch, seq, 0, LAYERS, -1, b"",
                                        m.encode_blocks(direct), n, True, sizes, at.tobytes())
            why, nothing, drained = rx._land_in_place(conn, refused, None)
            while not drained.done():
                conn.ep.deliver(0x55)
                await asyncio.sleep(0.001)
            assert len(conn.ep.posted) == seq * len(direct)
            assert all(tag == direct_tag(seq) for tag, _, _ in conn.ep.posted[-len(direct):])
            refusals.append((why, nothing, drained.exception()))
        after = [t for pair in pools for t in pair]
        return (held, written, n, dict(landed[1]) == tmpl.landed(direct), refusals,
                all(torch.equal(a, b) for a, b in zip(before, after)), rx.stats, conn.broken)

    held, written, n, counted, refusals, untouched, stats, broken = asyncio.run(run())
    assert held, "release returned while in-place receives were still posted"
    assert written == n and counted  # exactly the spans' bytes (zeros elsewhere)
    (stale, *rest1), (outside, *rest2) = refusals
    assert "stale epoch 7" in stale and "not whole token slots" in outside
    assert rest1 == rest2 == [None, None] and untouched and not broken
    assert stats["direct"] == 1 and stats["dropped_epoch"] == 1 and stats["rejected"] == 1


def test_device_regions_are_cuda_arrays_that_ucxx_reads():
    """`DeviceBytes` (how pool regions go to UCX on CUDA) is read by ucxx as a 1-D uint8
    CUDA buffer at its address and size; no device is touched to build it."""
    from ucxx._lib.arr import Array

    from phalanx.kv_transfer.transport.staging import DeviceBytes

    buf = Array(DeviceBytes(0x7F0000001000, 4096))
    assert buf.cuda and buf.ptr == 0x7F0000001000 and buf.nbytes == 4096
    assert buf.contiguous and buf.shape == (4096,)
