"""KV transport over real ucxx between spawned CPU processes on loopback (UCX_TLS=
tcp,sm,self; with endpoint error handling on, UCX 1.21 picks tcp: its shared-memory
transports cannot report a dead peer).

Each process is an *actor*: it runs its transport objects on a `TransportThread` (the
engine's threading model) and executes commands sent over a pipe, each in a worker
thread, so a wait and a send can overlap. Every call has a wall-clock bound; the module
fixture stops or kills every process it started, so a hang cannot stall CI. The cases
are in `kv_cases`; the transport's pieces driven in-process are tested in
`test_kv_transport_inproc`.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from kv_cases import (CASES, IN_PLACE, LAYERS, case_batches, case_layouts, case_plan,
                      side_pools, zero_pools)

from phalanx.kv_transfer.transport import (BlockingKVReceiver, BlockingKVSender, TransferError,
                                           TransportThread)

UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_SOCKADDR_TLS_PRIORITY": "tcp",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
CALL_TIMEOUT_S = 30.0

# ----------------------------------------------------------------------- actors

def _actor_main(pipe, env: dict) -> None:
    os.environ.update(env)  # before ucxx is first imported (lazily, by the transport)
    torch.set_num_threads(1)
    state = {"thread": TransportThread(), "lock": threading.Lock()}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def run(cid, fn, kwargs):
        try:
            reply = (cid, "ok", fn(state, **kwargs))
        except BaseException as e:
            reply = (cid, "error", (type(e).__name__, str(e), traceback.format_exc()))
        with state["lock"]:
            pipe.send(reply)

    while (msg := pipe.recv()) is not None:
        pool.submit(run, *msg)
    pool.shutdown(wait=True)
    for obj in state.values():
        if isinstance(obj, (BlockingKVSender, BlockingKVReceiver)):
            obj.close()
    state["thread"].stop()


class Actor:
    """A spawned process running `_actor_main`; `call(fn, **kw)` runs `fn(state, **kw)`."""

    def __init__(self, ctx) -> None:
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_actor_main, args=(child, UCX_ENV), daemon=True)
        self.proc.start()
        self._next, self._replies = 0, {}

    def submit(self, fn, **kwargs) -> int:
        self._next += 1
        self._pipe.send((self._next, fn, kwargs))
        return self._next

    def result(self, cid: int, timeout_s: float = CALL_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while cid not in self._replies:
            if not self._pipe.poll(max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"actor {self.proc.pid}: no reply within {timeout_s} s")
            rid, status, value = self._pipe.recv()
            self._replies[rid] = (status, value)
        status, value = self._replies.pop(cid)
        if status == "error":
            raise RuntimeError(f"{value[0]}: {value[1]}\n{value[2]}")
        return value

    def call(self, fn, **kwargs):
        return self.result(self.submit(fn, **kwargs), CALL_TIMEOUT_S)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._pipe.send(None)
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


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


# ----------------------------------------------------------------------- actor commands

def make_receivers(state, case: str, epoch: int = 1, timeout_s: float = 10.0,
                   ranks=None, **kwargs) -> dict[int, tuple]:
    ranks = range(case_layouts(case)[1].tp) if ranks is None else ranks
    addrs = {}
    for r in ranks:
        events = state.setdefault(("events", case, r), [])

        def on_landed(request_id, layers, epoch, events=events, case=case, r=r):
            rx = state[("rx", case, r)].receiver  # on the loop thread: direct access
            events.append((request_id, layers.start, layers.stop, time.monotonic(),
                           rx.landed(request_id)))

        state[("pools", case, r)] = pools = zero_pools(case, r)
        rx = BlockingKVReceiver(state["thread"], pools, rank=r, epoch=epoch,
                                timeout_s=timeout_s, on_landed=on_landed, **kwargs)
        state[("rx", case, r)] = rx
        addrs[r] = rx.start()
    return addrs


def make_senders(state, case: str, addrs: dict, epoch: int = 1, ranks=None, tag: str = "",
                 timeout_s: float = 10.0) -> None:
    ranks = range(case_layouts(case)[0].tp) if ranks is None else ranks
    for r in ranks:
        tx = BlockingKVSender(state["thread"], side_pools(case, "src", r, "noise"),
                              rank=r, epoch=epoch, timeout_s=timeout_s)
        state[("tx", case + tag, r)] = tx
        for dst_rank, addr in addrs.items():
            assert tx.connect(tuple(addr)) == dst_rank


def send_all(state, case: str, addrs: dict, request_id: str, form: str = "copies") -> int:
    """Every src rank streams every layer to every dst rank, all batches in flight.
    form: each batch as `planner.Copy` lists ("copies"), as template batches per layer
    ("batches"), or the whole request in one template batch per rank pair ("whole")."""
    from phalanx.kv_transfer.copy_table import layer_batches
    plan, futures, sends = case_plan(case), [], []
    if form == "copies":
        for layer in range(LAYERS):
            sub = plan.for_layer(layer)
            sends += [(s, d, [c for c in sub if c.src_rank == s and c.dst_rank == d])
                      for s, d in sub.bytes_by_pair()]
    elif form == "prepared":  # prepare_all's batches, the same objects
        sends = state[("prepared", case)]
    elif form == "batches":
        by_layer = {pair: layer_batches(b) for pair, b in case_batches(case).items()}
        sends = [(s, d, by_layer[(s, d)][layer])
                 for layer in range(LAYERS) for s, d in by_layer]
    else:
        sends = [(s, d, b) for (s, d), b in case_batches(case).items()]
    for s, d, copies in sends:
        futures.append(state[("tx", case, s)].submit_layer(tuple(addrs[d]), request_id, copies))
    acked = sum(f.result(CALL_TIMEOUT_S).ok for f in futures)
    if form == "prepared":  # every send took its prepared parts
        assert not any(state[("tx", case, s)].sender._conns[tuple(addrs[d])].prepared
                       for s, d, _ in sends)
    return acked


def posts_straight(state, key: tuple) -> list[bool]:
    """Per live connection of the sender or receiver at `key`: whether `_post_all` posts
    on it straight through ucxx's request API."""
    from phalanx.kv_transfer.ucx_runtime import _posts_straight
    obj = state[key]
    inner = obj.sender if isinstance(obj, BlockingKVSender) else obj.receiver
    conns = inner._conns.values() if isinstance(obj, BlockingKVSender) else inner._conns

    async def check():
        return [_posts_straight(conn.ep) for conn in conns]

    return obj.thread.call(check(), CALL_TIMEOUT_S)


def post_burst(state, count: int) -> tuple[bool, bool, str]:
    """In this process: `count` receives and `count` sends of 64 bytes posted at once with
    `_post_all` on a new loopback connection; (every receive holds its send's bytes, both
    endpoints post straight, what the process wrote to stdout and stderr meanwhile)."""
    import asyncio
    import tempfile

    import ucxx

    from phalanx.kv_transfer import ucx_runtime as rt

    async def burst():
        rt.ensure_ucx("thread")
        accepted = asyncio.get_running_loop().create_future()

        async def on_connect(ep):
            accepted.set_result(ep)

        listener = ucxx.create_listener(on_connect)
        client = await ucxx.create_endpoint("127.0.0.1", listener.port)
        server = await accepted
        got = [np.zeros(64, np.uint8) for _ in range(count)]
        sent = [np.full(64, i % 251, np.uint8) for i in range(count)]
        ops = rt._post_all(server, False, 9, got) + rt._post_all(client, True, 9, sent)
        await asyncio.wait_for(asyncio.gather(*ops), CALL_TIMEOUT_S / 2)
        straight = rt._posts_straight(server) and rt._posts_straight(client)
        await client.close()
        listener.close()
        return all((a == b).all() for a, b in zip(got, sent)), straight

    with tempfile.TemporaryFile() as log:  # ucxx's C++ log lines go to fd 1 (or 2)
        saved = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        try:
            equal, straight = state["thread"].call(burst(), CALL_TIMEOUT_S)
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
        log.seek(0)
        return equal, straight, log.read().decode(errors="replace")


def prepare_all(state, case: str, addrs: dict, request_id: str) -> str:
    """`prepare` every per-layer template batch of the request (as `send_all`'s
    "batches" form sends them), then another rank's copies: the ValueError's text."""
    from phalanx.kv_transfer.copy_table import layer_batches
    by_layer = {pair: layer_batches(b) for pair, b in case_batches(case).items()}
    sends = state[("prepared", case)] = [(s, d, by_layer[(s, d)][layer])
                                         for layer in range(LAYERS) for s, d in by_layer]
    for s in {s for s, _, _ in sends}:
        state[("tx", case, s)].prepare([(tuple(addrs[d]), request_id, copies)
                                        for r, d, copies in sends if r == s]
                                       ).result(CALL_TIMEOUT_S)
    assert all(len(state[("tx", case, s)].sender._conns[tuple(addrs[d])].prepared) > 0
               for s, d, _ in sends)
    foreign = [c for c in case_plan(case) if c.src_rank != 0]
    if not foreign:
        return "one rank"
    try:
        state[("tx", case, 0)].prepare([(tuple(addrs[0]), request_id, foreign)]
                                       ).result(CALL_TIMEOUT_S)
    except ValueError as e:
        return str(e)
    return "accepted"


def send_layer(state, case: str, addr, request_id: str, layer: int, tag: str = "",
               rank: int = 0, timeout_s=None, epoch=None):
    """One layer from one src rank; (ok, error type, error message, start, end)."""
    tx = state[("tx", case + tag, rank)]
    if epoch is not None:
        tx.set_epoch(epoch)
    copies = [c for c in case_plan(case).for_layer(layer) if c.src_rank == rank]
    start = time.monotonic()
    try:
        tx.send_layer_sync(tuple(addr), request_id, copies, timeout_s=timeout_s)
        return True, "", "", start, time.monotonic()
    except TransferError as e:
        return False, type(e).__name__, str(e), start, time.monotonic()


def check_landed(state, case: str, request_id: str) -> dict:
    """Wait for the request, then compare with (1) the plan applied in-process and (2)
    the layout's definition of where each (head, token) lives; bit-exact."""
    plan = case_plan(case)
    src = {r: side_pools(case, "src", r, "noise") for r in range(case_layouts(case)[0].tp)}
    out = {}
    for r in range(case_layouts(case)[1].tp):
        rx = state[("rx", case, r)]
        rx.wait_request_sync(request_id, CASES[case].tokens, timeout_s=10.0)
        ref = zero_pools(case, r)
        for c in plan:
            if c.dst_rank == r:
                k = 0 if c.kind == "k" else 1
                ref[c.layer][k][c.dst_page, c.dst_head:c.dst_head + c.num_heads,
                                c.dst_offset:c.dst_offset + c.num_tokens] = \
                    src[c.src_rank][c.layer][k][c.src_page, c.src_head:c.src_head + c.num_heads,
                                               c.src_offset:c.src_offset + c.num_tokens]
        semantic = side_pools(case, "dst", r, "zero")
        got = state[("pools", case, r)]
        out[r] = {"vs_plan": all(torch.equal(ref[l][k], got[l][k])
                                 for l in range(LAYERS) for k in range(2)),
                  "vs_layout": all(torch.equal(semantic[l][k], got[l][k])
                                   for l in range(LAYERS) for k in range(2))}
    return out


def wait_request(state, case: str, rank: int, request_id: str, timeout_s: float):
    start = time.monotonic()
    try:
        state[("rx", case, rank)].wait_request_sync(request_id, CASES[case].tokens,
                                                    timeout_s=timeout_s)
        return "ok", "", time.monotonic() - start
    except TransferError as e:
        return type(e).__name__, str(e), time.monotonic() - start


def receiver_view(state, case: str, rank: int, request_id: str) -> dict:
    rx, pools = state[("rx", case, rank)], state[("pools", case, rank)]
    return {"landed": rx.landed(request_id), "stats": rx.stats(),
            "events": state[("events", case, rank)],
            "layer_nonzero": [bool(pools[l][0].any() or pools[l][1].any()) for l in range(LAYERS)]}


def set_receiver_epoch(state, case: str, rank: int, epoch: int) -> None:
    state[("rx", case, rank)].set_epoch(epoch)


def submit_layer(state, case: str, addr, request_id: str, layer: int, rank: int = 0,
                 tag: str = "") -> bool:
    """Start one layer's batch and return at once (`join_layer` waits for it)."""
    tx = state[("tx", case + tag, rank)]
    copies = [c for c in case_plan(case).for_layer(layer) if c.src_rank == rank]
    state[("inflight", case + tag, rank)] = (time.monotonic(),
                                             tx.submit_layer(tuple(addr), request_id, copies))
    return True


def join_layer(state, case: str, rank: int = 0, tag: str = "", timeout_s: float = 20.0):
    start, fut = state[("inflight", case + tag, rank)]
    try:
        fut.result(timeout_s)
        return "ok", "", time.monotonic() - start
    except TransferError as e:
        return type(e).__name__, str(e), time.monotonic() - start


# ----------------------------------------------------------------------- tests

@pytest.mark.parametrize("case,form", [
    *((case, "copies") for case in ["tp2_to_tp1", "tp1_to_tp2", "tp4_kv2_to_tp1", *IN_PLACE]),
    ("tp4_kv2_to_tp1", "batches"), ("tp1_to_tp2_runs", "batches"),
    ("tp2_to_tp1", "prepared"), ("tp1_to_tp2_runs", "prepared")])
def test_request_kv_lands_bit_exact(pair, case, form):
    """Planner + transport move a request's KV (2 layers, all batches in flight at once)
    across different TP degrees and page sizes; the decode pools equal the plan applied
    in-process and the layout's definition, bit for bit, and nothing else is written.
    With consecutive pages, spans of the receiver's pools are received in place (sent
    from the pools too when they are spans there) and the partial last page is staged.
    The copies go as `planner.Copy` lists or as `plan_batches`' template batches, the
    latter also `prepare`d first (which sends nothing and refuses other ranks' copies)."""
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
    """300 receives and 300 sends posted at once through `_post_all` (as a large request's
    in-place blocks are) all land, straight through ucxx's request API, and ucxx never
    finds its futures pool empty (it would log "No Futures available")."""
    equal, straight, err = pair[0].call(post_burst, count=300)
    assert equal and straight
    assert "No Futures available" not in err, err[-500:]


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
