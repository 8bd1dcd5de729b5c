"""KV transport over real ucxx between spawned CPU processes on loopback (UCX_TLS=
tcp,sm,self; with endpoint error handling on, UCX 1.21 picks tcp: its shared-memory
transports cannot report a dead peer).

Each process is an *actor*: it runs its transport objects on a `TransportThread` (the
engine's threading model) and executes commands sent over a pipe, each in a worker
thread, so a wait and a send can overlap. Every call has a wall-clock bound; the module
fixture stops or kills every process it started, so a hang cannot stall CI.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import NamedTuple

import numpy as np
import pytest
import torch

from phalanx.kv_transfer.layout import KVLayout
from phalanx.kv_transfer.packed_table import pack_table
from phalanx.kv_transfer.planner import plan_request
from phalanx.kv_transfer.transport import (BlockingKVReceiver, BlockingKVSender, TransferError,
                                           TransportThread)

UCX_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_SOCKADDR_TLS_PRIORITY": "tcp",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
CALL_TIMEOUT_S = 30.0
LAYERS = 2


class Case(NamedTuple):
    src_tp: int
    dst_tp: int
    kv_heads: int
    src_page: int
    dst_page: int
    tokens: int = 45
    head_dim: int = 8
    runs: bool = False  # the request's pages consecutive on both sides (else shuffled)


CASES = {
    "tp2_to_tp1": Case(2, 1, 4, 16, 8),
    "tp1_to_tp2": Case(1, 2, 4, 8, 16),
    "tp4_kv2_to_tp1": Case(4, 1, 2, 4, 16),
    "tp1_to_tp1": Case(1, 1, 4, 16, 16),
    "big": Case(1, 1, 4, 16, 16, tokens=4096, head_dim=256),  # 32 MiB per layer
    # consecutive pages, 295 KiB of whole pages per (layer, kind) and rank pair: spans of
    # the receiver's pools (>= the sender's IN_PLACE_MIN_BYTES) are received in place
    "tp1_to_tp1_runs": Case(1, 1, 4, 16, 16, tokens=603, head_dim=64, runs=True),
    "tp1_to_tp2_runs": Case(1, 2, 4, 16, 16, tokens=603, head_dim=64, runs=True),
    "tp2_to_tp1_runs": Case(2, 1, 4, 16, 16, tokens=603, head_dim=64, runs=True),
}
# per case, whether any message is received in place (the receiver's pools hold every
# head of the copies' whole pages consecutively only when it holds no more heads than
# each sender: tp2 -> tp1 interleaves two senders' heads in every page)
IN_PLACE = {"tp1_to_tp1_runs": True, "tp1_to_tp2_runs": True, "tp2_to_tp1_runs": False}


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


# ----------------------------------------------------------------------- the data

def _layouts(case: str) -> tuple[KVLayout, KVLayout]:
    c = CASES[case]
    return (KVLayout(c.src_tp, c.kv_heads, c.src_page, c.head_dim, LAYERS, 4),
            KVLayout(c.dst_tp, c.kv_heads, c.dst_page, c.head_dim, LAYERS, 4))


def _pages(layout: KVLayout, tokens: int, seed: int, runs: bool = False
           ) -> tuple[int, list[int]]:
    """(pool size, the request's page ids: a shuffled subset of the pool, or consecutive
    pages from seed % 3 on)."""
    need = layout.pages_for(tokens)
    num_pages = need + 3
    if runs:
        return num_pages, list(range(seed % 3, seed % 3 + need))
    ids = np.random.default_rng(seed).permutation(num_pages)[:need]
    return num_pages, [int(p) for p in ids]


def _logical_kv(case: str) -> torch.Tensor:
    """The request's KV by global head and token: [layer, kind, head, token, head_dim]."""
    c = CASES[case]
    g = torch.Generator().manual_seed(7)
    return torch.randn(LAYERS, 2, c.kv_heads, c.tokens, c.head_dim, generator=g)


def _side_pools(case: str, side: str, rank: int, fill: str) -> list[tuple[torch.Tensor, ...]]:
    """`side`'s pools of `rank` with the request's tokens in place; other slots are
    noise ('noise') or zero ('zero')."""
    layout, tokens = _layouts(case)[0 if side == "src" else 1], CASES[case].tokens
    num_pages, ids = _pages(layout, tokens, 11 if side == "src" else 12, CASES[case].runs)
    heads = list(layout.heads_of(rank))
    kv = _logical_kv(case)
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.arange(tokens)
    page = torch.tensor(ids)[t // layout.page_size]
    off = t % layout.page_size
    shape = (num_pages, len(heads), layout.page_size, layout.head_dim)
    pools = []
    for layer in range(LAYERS):
        pair = []
        for kind in range(2):
            pool = torch.randn(shape, generator=g) if fill == "noise" else torch.zeros(shape)
            pool[page, :, off, :] = kv[layer, kind, heads].permute(1, 0, 2)
            pair.append(pool)
        pools.append(tuple(pair))
    return pools


def _plan(case: str):
    (src, dst), c = _layouts(case), CASES[case]
    return plan_request(src, dst, c.tokens, _pages(src, c.tokens, 11, c.runs)[1],
                        _pages(dst, c.tokens, 12, c.runs)[1])


def _zero_pools(case: str, rank: int) -> list[tuple[torch.Tensor, ...]]:
    layout = _layouts(case)[1]
    shape = (_pages(layout, CASES[case].tokens, 12)[0], len(layout.heads_of(rank)),
             layout.page_size, layout.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]


# ----------------------------------------------------------------------- actor commands

def make_receivers(state, case: str, epoch: int = 1, timeout_s: float = 10.0,
                   ranks=None, **kwargs) -> dict[int, tuple]:
    ranks = range(_layouts(case)[1].tp) if ranks is None else ranks
    addrs = {}
    for r in ranks:
        events = state.setdefault(("events", case, r), [])

        def on_landed(request_id, layers, epoch, events=events, case=case, r=r):
            rx = state[("rx", case, r)].receiver  # on the loop thread: direct access
            events.append((request_id, layers.start, layers.stop, time.monotonic(),
                           rx.landed(request_id)))

        state[("pools", case, r)] = pools = _zero_pools(case, r)
        rx = BlockingKVReceiver(state["thread"], pools, rank=r, epoch=epoch,
                                timeout_s=timeout_s, on_landed=on_landed, **kwargs)
        state[("rx", case, r)] = rx
        addrs[r] = rx.start()
    return addrs


def make_senders(state, case: str, addrs: dict, epoch: int = 1, ranks=None, tag: str = "",
                 timeout_s: float = 10.0) -> None:
    ranks = range(_layouts(case)[0].tp) if ranks is None else ranks
    for r in ranks:
        tx = BlockingKVSender(state["thread"], _side_pools(case, "src", r, "noise"),
                              rank=r, epoch=epoch, timeout_s=timeout_s)
        state[("tx", case + tag, r)] = tx
        for dst_rank, addr in addrs.items():
            assert tx.connect(tuple(addr)) == dst_rank


def _batches(case: str) -> dict[tuple[int, int], list]:
    """The request's copies per rank pair as `copy_table.plan_batches` builds them."""
    from phalanx.kv_transfer.copy_table import plan_batches
    (src, dst), c = _layouts(case), CASES[case]
    return plan_batches(src, dst, range(c.tokens), _pages(src, c.tokens, 11, c.runs)[1],
                        _pages(dst, c.tokens, 12, c.runs)[1])


def send_all(state, case: str, addrs: dict, request_id: str, form: str = "copies") -> int:
    """Every src rank streams every layer to every dst rank, all batches in flight.
    form: each batch as `planner.Copy` lists ("copies"), as template batches per layer
    ("batches"), or the whole request in one template batch per rank pair ("whole")."""
    from phalanx.kv_transfer.copy_table import layer_batches
    plan, futures, sends = _plan(case), [], []
    if form == "copies":
        for layer in range(LAYERS):
            sub = plan.for_layer(layer)
            sends += [(s, d, [c for c in sub if c.src_rank == s and c.dst_rank == d])
                      for s, d in sub.bytes_by_pair()]
    elif form == "prepared":  # prepare_all's batches, the same objects
        sends = state[("prepared", case)]
    elif form == "batches":
        by_layer = {pair: layer_batches(b) for pair, b in _batches(case).items()}
        sends = [(s, d, by_layer[(s, d)][layer])
                 for layer in range(LAYERS) for s, d in by_layer]
    else:
        sends = [(s, d, b) for (s, d), b in _batches(case).items()]
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
    by_layer = {pair: layer_batches(b) for pair, b in _batches(case).items()}
    sends = state[("prepared", case)] = [(s, d, by_layer[(s, d)][layer])
                                         for layer in range(LAYERS) for s, d in by_layer]
    for s in {s for s, _, _ in sends}:
        state[("tx", case, s)].prepare([(tuple(addrs[d]), request_id, copies)
                                        for r, d, copies in sends if r == s]
                                       ).result(CALL_TIMEOUT_S)
    assert all(len(state[("tx", case, s)].sender._conns[tuple(addrs[d])].prepared) > 0
               for s, d, _ in sends)
    foreign = [c for c in _plan(case) if c.src_rank != 0]
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
    copies = [c for c in _plan(case).for_layer(layer) if c.src_rank == rank]
    start = time.monotonic()
    try:
        tx.send_layer_sync(tuple(addr), request_id, copies, timeout_s=timeout_s)
        return True, "", "", start, time.monotonic()
    except TransferError as e:
        return False, type(e).__name__, str(e), start, time.monotonic()


def check_landed(state, case: str, request_id: str) -> dict:
    """Wait for the request, then compare with (1) the plan applied in-process and (2)
    the layout's definition of where each (head, token) lives; bit-exact."""
    plan = _plan(case)
    src = {r: _side_pools(case, "src", r, "noise") for r in range(_layouts(case)[0].tp)}
    out = {}
    for r in range(_layouts(case)[1].tp):
        rx = state[("rx", case, r)]
        rx.wait_request_sync(request_id, CASES[case].tokens, timeout_s=10.0)
        ref = _zero_pools(case, r)
        for c in plan:
            if c.dst_rank == r:
                k = 0 if c.kind == "k" else 1
                ref[c.layer][k][c.dst_page, c.dst_head:c.dst_head + c.num_heads,
                                c.dst_offset:c.dst_offset + c.num_tokens] = \
                    src[c.src_rank][c.layer][k][c.src_page, c.src_head:c.src_head + c.num_heads,
                                               c.src_offset:c.src_offset + c.num_tokens]
        semantic = _side_pools(case, "dst", r, "zero")
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
    copies = [c for c in _plan(case).for_layer(layer) if c.src_rank == rank]
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
        assert ("is not from rank 0" in refused if _layouts(case)[0].tp > 1
                else refused == "one rank"), refused
        assert all(decode.call(receiver_view, case=case, rank=r, request_id="")["stats"]
                   ["messages"] == 0 for r in addrs)
    acked = prefill.call(send_all, case=case, addrs=addrs, request_id=f"req-{case}", form=form)
    assert acked == sum(len({(c.src_rank, c.dst_rank) for c in _plan(case).for_layer(l)})
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


# ----------------------------------------------------------------------- in-process

def test_wire_format_round_trips_and_validates():
    """Framed msgspec messages round-trip; copy tables encode compactly and cut into
    templates + blocks that replay to the same table; out-of-range copies are named."""
    from phalanx.kv_transfer import messages as m
    req = m.TransferRequest("r", 3, 7, 0, 2, 5, b"\x01\x02", b"", 10)
    buf = bytearray(m.frame(req)) + bytearray(100)  # a fixed receive buffer, partly used
    assert m.unframe(buf, m.TO_RECEIVER) == req
    with pytest.raises(ValueError):
        m.unframe(bytearray(16), m.TO_RECEIVER)
    plan = _plan("tp2_to_tp1")
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
    from phalanx.kv_transfer import messages as m
    from phalanx.kv_transfer.transport import _Pools
    plan = _plan(case)
    shape = _one_allocation if one_allocation else (lambda pools: pools)
    for d in range(_layouts(case)[1].tp):
        dst = _Pools(shape(_zero_pools(case, d)))
        assert (dst._flat is not None) == one_allocation
        for s in range(_layouts(case)[0].tp):
            table = m.encode_copies([c for c in plan if (c.src_rank, c.dst_rank) == (s, d)])
            src = _Pools(shape(_side_pools(case, "src", s, "noise")))
            for template, blocks in m.templates_of(table):
                tx, rx = src.template(template, "src"), dst.template(template, "dst")
                pieces = [p for b in blocks.tolist() for p, _ in tx.cut(b, 700)]
                cut = np.array(pieces, dtype=np.int32)
                buf = torch.empty(tx.nbytes(cut), dtype=torch.uint8)
                assert src.gather(tx, cut, buf) is None  # CPU: done on return
                landed, done = dst.scatter(rx, cut, buf)
                assert done is None and sum(landed.values()) == rx.slots_cum[-1] * len(blocks)
        want = _side_pools(case, "dst", d, "zero")
        assert all(torch.equal(want[l][k], dst.pools[l][k]) for l in range(LAYERS)
                   for k in range(2))


def test_receiver_rejects_bad_batches_without_writing():
    """An out-of-range template, a malformed packed template, a payload size that disagrees with the blocks, an
    unknown template, or another epoch: the batch is dropped with a reason and the pools
    stay untouched."""
    import asyncio
    from collections import OrderedDict
    from phalanx.kv_transfer import messages as m
    from phalanx.kv_transfer.transport import KVReceiver

    async def run():
        pools = _zero_pools("tp1_to_tp1", 0)
        rx = KVReceiver(pools, rank=0, epoch=2)
        ((template, blocks),) = m.templates_of(
            m.encode_copies(_plan("tp1_to_tp1").for_layer(0).copies))
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
        assert all(landed is None and event is None for _, landed, event in errors)
        return [e for e, _, _ in errors], rx.stats, all(not t.any() for pair in pools for t in pair)

    errors, stats, untouched = asyncio.run(run())
    assert "dst head range" in errors[0] and "packed table" in errors[1]
    assert "does not match" in errors[2]
    assert "unknown template 7" in errors[3] and "stale epoch 1" in errors[4]
    assert stats["rejected"] == 4 and stats["dropped_epoch"] == 1 and untouched

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
    from phalanx.kv_transfer import messages as m
    from phalanx.kv_transfer.receive_connection import _RecvConn
    from phalanx.kv_transfer.receiver import KVReceiver
    from phalanx.kv_transfer.ucx_runtime import TAG_DIRECT

    case = "tp1_to_tp1_runs"
    ((template, blocks),) = m.templates_of(m.encode_copies(_plan(case).copies))

    async def run():
        pools = _zero_pools(case, 0)
        rx = KVReceiver(pools, rank=0, epoch=1, gated=True)
        rx.expect("r")
        tmpl = rx._pools.template(template, "dst")
        whole = [(layer, kind, r0, b) for layer, kind, r0, r1 in blocks.tolist()
                 for a, b, direct in tmpl.spans.split(r0, r1, 1) if direct and a == r0]
        direct = np.array(whole, dtype=np.int32)
        n = tmpl.nbytes(direct)
        sizes = (tmpl.bytes_cum[direct[:, 3]] - tmpl.bytes_cum[direct[:, 2]]).astype("<i8").tobytes()
        starts = tmpl.spans.start[direct[:, 2]].astype("<i8")
        conn = _RecvConn(_FakeEndpoint())
        msg = m.TransferRequest("r", 1, 1, 0, LAYERS, -1, b"", m.encode_blocks(direct),
                                n, True, sizes, starts.tobytes())
        landing = asyncio.ensure_future(rx._land_in_place(conn, msg))
        while not conn.ep.posted:  # the first receive is posted, the others are being made
            await asyncio.sleep(0)
        releasing = asyncio.ensure_future(rx.release("r"))
        error, landed, done = await landing
        while len(conn.ep.posted) < len(direct):
            await asyncio.sleep(0.001)
        assert error == "" and len(conn.ep.posted) == len(direct) >= 4
        assert all(tag == TAG_DIRECT for tag, _, _ in conn.ep.posted)
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
            drain = asyncio.ensure_future(rx._land_in_place(conn, refused))
            while not drain.done():  # the drain posts its receives one after another
                conn.ep.deliver(0x55)
                await asyncio.sleep(0.001)
            assert len(conn.ep.posted) == seq * len(direct)
            refusals.append(await asyncio.wait_for(drain, 5))
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

    from phalanx.kv_transfer.staging import DeviceBytes

    buf = Array(DeviceBytes(0x7F0000001000, 4096))
    assert buf.cuda and buf.ptr == 0x7F0000001000 and buf.nbytes == 4096
    assert buf.contiguous and buf.shape == (4096,)
