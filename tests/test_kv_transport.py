"""KV transport over real ucxx between spawned CPU processes on loopback (UCX_TLS=
tcp,sm,self; with endpoint error handling on, UCX 1.21 picks tcp: its shared-memory
transports cannot report a dead peer).

The processes are `kv_actors`' actors, driven by its commands; the module fixture stops
or kills every process it started, so a hang cannot stall CI. The cases are in
`kv_cases`; the transport's pieces driven in-process are tested in
`test_kv_transport_inproc`.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time

import pytest
from kv_actors import (Actor, check_landed, cut_receives_then_fresh, join_layer,
                       make_receivers, make_senders, post_burst, posts_straight, prepare_all,
                       receiver_view, send_all, send_layer, set_receiver_epoch, submit_layer,
                       wait_request)
from kv_announce import announce_lives, check_lives
from kv_cases import CASES, IN_PLACE, LAYERS, case_layouts, case_plan

from phalanx.kv_transfer.transport import TransferError


@pytest.fixture(scope="module")
def actors():
    """Start actors on demand (all in parallel when asked for together); kill at the end."""
    ctx = mp.get_context("spawn")
    started: list[Actor] = []

    def start(n: int) -> list[Actor]:
        new = [Actor(ctx) for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for actor in started:
        actor.stop()


@pytest.fixture(scope="module")
def pair(actors):
    """(prefill actor, decode actor), shared by the module's tests."""
    return tuple(actors(2))


@pytest.mark.parametrize("case,form", [
    *((case, "copies") for case in ["tp2_to_tp1", "tp1_to_tp2", "tp4_kv2_to_tp1", *IN_PLACE]),
    ("tp4_kv2_to_tp1", "batches"), ("tp1_to_tp2_runs", "batches"),
    ("tp2_to_tp1", "prepared"), ("tp1_to_tp2_runs", "prepared"),
    ("tp1_to_tp1_runs", "prepared")])
def test_request_kv_lands_bit_exact(pair, case, form):
    """Planner + transport move a request's KV (2 layers, all batches in flight at once)
    across different TP degrees and page sizes; the decode pools equal the plan applied
    in-process and the layout's definition, bit for bit, and nothing else is written.
    With consecutive pages, spans of the receiver's pools are received in place (sent
    from the pools too when they are spans there) and the partial last page is staged.
    The copies go as `planner.Copy` lists or as `plan_batches`' template batches, the
    latter also `prepare`d first (which writes nothing, announces the in-place parts,
    and refuses other ranks' copies)."""
    prefill, decode = pair
    addrs = decode.call(make_receivers, case=case)
    prefill.call(make_senders, case=case, addrs=addrs)
    if form == "prepared":
        refused = prefill.call(prepare_all, case=case, addrs=addrs, request_id=f"req-{case}")
        assert ("is not from rank 0" in refused if case_layouts(case)[0].tp > 1
                else refused == "one rank"), refused
        assert all(decode.call(receiver_view, case=case, rank=r, request_id="")["stats"]
                   ["messages"] == 0 for r in addrs)
    acked = prefill.call(send_all, case=case, addrs=addrs, request_id=f"req-{case}", form=form)
    assert acked == sum(len({(c.src_rank, c.dst_rank) for c in case_plan(case).for_layer(l)})
                        for l in range(LAYERS))
    result = decode.call(check_landed, case=case, request_id=f"req-{case}")
    assert result == {r: {"vs_plan": True, "vs_layout": True} for r in addrs}
    stats = [decode.call(receiver_view, case=case, rank=r, request_id="")["stats"] for r in addrs]
    assert all((s["direct"] > 0) == IN_PLACE.get(case, False) for s in stats), stats
    if IN_PLACE.get(case):  # the partial last page and nothing else went staged
        assert all(s["messages"] > s["direct"] for s in stats), stats
    # prepared parts sent from pool to pool (same heads per page on both sides) went
    # announced, and none was withdrawn; staged parts' templates went ahead
    assert all((s["announced"] > 0) == (form == "prepared" and case == "tp1_to_tp1_runs")
               and (s["defined_ahead"] > 0) == (form == "prepared")
               and s["withdrawn"] == 0 for s in stats), [
        {k: s[k] for k in ("announced", "withdrawn", "defined_ahead", "direct")} for s in stats]


def test_pooled_spans_travel_as_one_message_beyond_the_capacity(pair):
    """A request whose whole pages are spans of both sides' pools, sent as one batch to a
    receiver whose staging receives hold 64 KiB: its 4 spans of ~600 KiB (cut into
    pieces of at most 64 KiB) travel as one direct message, straight from pool to pool;
    only the partial last page goes staged, and the receiver makes its staging buffers
    only then. The pools end bit-exact."""
    prefill, decode = pair
    case = "tp1_to_tp1_runs"
    addrs = decode.call(make_receivers, case=case, max_payload_bytes=64 << 10)
    prefill.call(make_senders, case=case, addrs=addrs)
    connected = decode.call(receiver_view, case=case, rank=0, request_id="")["stats"]
    assert prefill.call(send_all, case=case, addrs=addrs, request_id="one", form="whole") == 1
    assert decode.call(check_landed, case=case, request_id="one") == {
        0: {"vs_plan": True, "vs_layout": True}}
    stats = decode.call(receiver_view, case=case, rank=0, request_id="")["stats"]
    assert stats["direct"] == 1 and stats["messages"] > 1, stats
    # staging buffers are made by the first staged message (the partial last page)
    assert connected["staging_bytes"] == 0 and stats["staging_bytes"] == 3 * (64 << 10), stats
    whole_pages = (CASES[case].tokens // 16) * 16 * 4 * 64 * 4 * 2 * LAYERS
    assert stats["bytes"] > whole_pages > 10 * (64 << 10), stats
    # both sides posted payloads straight through ucxx's request API (not as tasks)
    assert prefill.call(posts_straight, key=("tx", case, 0)) == [True]
    assert decode.call(posts_straight, key=("rx", case, 0)) == [True]


def test_a_burst_of_posts_goes_straight_and_keeps_the_futures_pool_filled(pair):
    """300 receives and 300 sends posted at once through `post_all` (as a large request's
    in-place blocks are) all land, straight through ucxx's request API, and ucxx never
    finds its futures pool empty (it would log "No Futures available")."""
    equal, straight, err = pair[0].call(post_burst, count=300)
    assert equal and straight
    assert "No Futures available" not in err, err[-500:]


def test_receives_cut_by_a_deadline_leave_ucxx_working(pair):
    """Receives posted straight on ucxx's request API, cut by a deadline (their futures
    cancelled) and their endpoint aborted, as the receiver does when in-place receives
    time out: a later connection's operations still complete (ucxx's notifier outlives
    the cancelled futures) and nothing raised in ucxx's threads (a future set twice would
    print an InvalidStateError traceback)."""
    cancelled, got, log = pair[1].call(cut_receives_then_fresh)
    assert cancelled
    assert got == [5] * 64
    assert "Traceback" not in log and "InvalidStateError" not in log, log[-1000:]


def test_layers_stream_in_order(pair):
    """Layer 0 is written and acknowledged before layer 1 is sent; when layer 0 lands,
    layer 1 has not (CLOCK_MONOTONIC is shared by the processes of one host)."""
    prefill, decode = pair
    addrs = decode.call(make_receivers, case="tp1_to_tp1")
    prefill.call(make_senders, case="tp1_to_tp1", addrs=addrs)
    sends = [prefill.call(send_layer, case="tp1_to_tp1", addr=addrs[0], request_id="stream",
                          layer=layer) for layer in range(LAYERS)]
    assert all(ok for ok, *_ in sends), sends
    view = decode.call(receiver_view, case="tp1_to_tp1", rank=0, request_id="stream")
    (rid0, a0, b0, t0, landed0), (rid1, a1, b1, t1, landed1) = view["events"]
    assert (a0, b0, a1, b1) == (0, 1, 1, 2)
    assert landed0 == {0: 2 * 4 * 45}          # layer 1 not there yet
    assert landed1 == {0: 2 * 4 * 45, 1: 2 * 4 * 45}
    (_, _, _, start0, acked0), (_, _, _, start1, acked1) = sends
    assert start0 <= t0 <= acked0 <= start1 <= t1 <= acked1


def test_sender_killed_mid_transfer_fails_the_wait(pair, actors):
    """A prefill process dies while its second (32 MiB) layer is in flight: the decode
    side's wait raises TransferError well before its deadline (the closed endpoint is
    seen), and the receiver keeps serving."""
    _, decode = pair
    (victim,) = actors(1)
    addrs = decode.call(make_receivers, case="big")
    victim.call(make_senders, case="big", addrs=addrs)
    waiting = decode.submit(wait_request, case="big", rank=0, request_id="doomed", timeout_s=8.0)
    assert victim.call(send_layer, case="big", addr=addrs[0], request_id="doomed", layer=0)[0]
    victim.call(submit_layer, case="big", addr=addrs[0], request_id="doomed", layer=1)
    victim.signal(signal.SIGKILL)
    kind, message, elapsed = decode.result(waiting, 20.0)
    print(f"receiver wait failed after {elapsed:.3f} s: {message}")
    assert kind == "TransferError", message
    assert elapsed < 8.0 + 1.0
    view = decode.call(receiver_view, case="big", rank=0, request_id="doomed")
    assert view["landed"].get(0) == 2 * 4 * 4096 and view["landed"].get(1, 0) < 2 * 4 * 4096
    assert view["stats"]["conn_lost"] == 1


def test_receiver_hung_or_killed_fails_the_sender(pair, actors):
    """A frozen decode process: a send hits its deadline (TransferError 'timeout');
    then it is killed while a second connection's send is in flight: that send raises
    TransferError at once, long before its 20 s deadline."""
    prefill, _ = pair
    (victim,) = actors(1)
    addrs = victim.call(make_receivers, case="tp1_to_tp1", ranks=[0])
    for tag in ("a", "b"):
        prefill.call(make_senders, case="tp1_to_tp1", addrs=addrs, tag=tag, timeout_s=20.0)
    assert prefill.call(send_layer, case="tp1_to_tp1", addr=addrs[0], request_id="x", layer=0,
                        tag="a")[0]
    victim.signal(signal.SIGSTOP)
    ok, kind, message, start, end = prefill.call(send_layer, case="tp1_to_tp1", addr=addrs[0],
                                                 request_id="x", layer=1, tag="a", timeout_s=1.5)
    assert (ok, kind) == (False, "TransferError") and "timeout" in message, message
    print(f"hung receiver: send failed after {end - start:.3f} s: {message}")
    assert 1.4 <= end - start < 5.0
    prefill.call(submit_layer, case="tp1_to_tp1", addr=addrs[0], request_id="y", layer=0,
                 tag="b")
    time.sleep(0.3)
    victim.signal(signal.SIGKILL)
    kind, message, elapsed = prefill.call(join_layer, case="tp1_to_tp1", tag="b")
    print(f"killed receiver: send failed {elapsed - 0.3:.3f} s after the kill: {message}")
    assert kind == "TransferError", message
    assert elapsed < 10.0


@pytest.mark.parametrize("case", ["tp1_to_tp1", "tp1_to_tp1_runs"])
def test_other_epochs_are_dropped(pair, case):
    """After the decode side moves to epoch 2, a batch stamped epoch 1 is dropped (not
    written; negative ack -> TransferError), the connection stays usable, and the same
    batch at epoch 2 lands. A sender of another epoch is refused at the handshake. With
    consecutive pages the dropped batch's in-place payload is received into scratch
    space, never into the pools."""
    prefill, decode = pair
    addrs = decode.call(make_receivers, case=case, ranks=[0])  # fresh receiver, epoch 1
    prefill.call(make_senders, case=case, addrs=addrs, tag="e")
    assert prefill.call(send_layer, case=case, addr=addrs[0], request_id="ep", layer=0,
                        tag="e")[0]
    first = decode.call(receiver_view, case=case, rank=0, request_id="ep")["stats"]
    assert (first["direct"] > 0) == CASES[case].runs
    decode.call(set_receiver_epoch, case=case, rank=0, epoch=2)
    ok, kind, message, *_ = prefill.call(send_layer, case=case, addr=addrs[0], request_id="ep",
                                         layer=1, tag="e")
    assert (ok, kind) == (False, "TransferError") and "stale epoch 1" in message, message
    view = decode.call(receiver_view, case=case, rank=0, request_id="ep")
    assert view["layer_nonzero"] == [True, False]
    assert view["stats"]["dropped_epoch"] >= 1 and view["stats"]["messages"] == first["messages"]
    assert prefill.call(send_layer, case=case, addr=addrs[0], request_id="ep", layer=1,
                        tag="e", epoch=2)[0]
    view = decode.call(receiver_view, case=case, rank=0, request_id="ep")
    assert view["layer_nonzero"] == [True, True]
    assert view["stats"]["messages"] == 2 * first["messages"] and view["stats"]["conn_lost"] == 0
    with pytest.raises(RuntimeError, match="TransferError.*rejected"):
        prefill.call(make_senders, case=case, addrs=addrs, tag="old", epoch=1)


def test_announced_messages_land_withdraw_expire_and_are_bounded(pair):
    """`prepare` announces a batch's in-place parts: the receiver posts their receives
    before anything is sent, and other batches are written and acked meanwhile. An
    announced message that is withdrawn, expires, or is fenced by an epoch change ends
    its receives without writing (release returns at once; the connection goes on, and
    the batch sent later lands bit-exact). One that is never answered is cut by the
    receiver's bound, which breaks the connection."""
    check_lives(pair[1].call(announce_lives, timeout_s=2.0))
