"""Spawned CPU processes for the KV transport's tests over real ucxx (`test_kv_transport`):
an *actor* runs its transport objects on a `TransportThread` (the engine's threading
model) and executes commands sent over a pipe, each in a worker thread, so a wait and a
send can overlap; every call has a wall-clock bound. The commands are this module's
functions taking the actor's `state` first (they run in the actor's process: spawn
imports this module there)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import traceback

import numpy as np
import torch
from kv_cases import CASES, LAYERS, case_batches, case_layouts, case_plan, side_pools, zero_pools

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

    def __init__(self, ctx, env: dict = UCX_ENV) -> None:
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_actor_main, args=(child, env), daemon=True)
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
    from phalanx.kv_transfer.planning.copy_table import layer_batches
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
    """Per live connection of the sender or receiver at `key`: whether `post_all` posts
    on it straight through ucxx's request API."""
    from phalanx.kv_transfer.transport.ucx_runtime import _posts_straight
    obj = state[key]
    inner = obj.sender if isinstance(obj, BlockingKVSender) else obj.receiver
    conns = inner._conns.values() if isinstance(obj, BlockingKVSender) else inner._conns

    async def check():
        return [_posts_straight(conn.ep) for conn in conns]

    return obj.thread.call(check(), CALL_TIMEOUT_S)


async def _loopback() -> tuple:
    """A ucxx listener and both endpoints of a loopback connection to it: (listener,
    client, server)."""
    import asyncio

    import ucxx

    accepted = asyncio.get_running_loop().create_future()

    async def on_connect(ep):
        accepted.set_result(ep)

    listener = ucxx.create_listener(on_connect)
    client = await ucxx.create_endpoint("127.0.0.1", listener.port)
    return listener, client, await accepted


def _with_output(state, coro) -> tuple:
    """`coro` run on the actor's transport thread: (its result, what the process wrote
    to fds 1 and 2 meanwhile: ucxx's C++ log lines go there)."""
    import tempfile

    with tempfile.TemporaryFile() as log:
        saved = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        try:
            result = state["thread"].call(coro, CALL_TIMEOUT_S)
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
        log.seek(0)
        return result, log.read().decode(errors="replace")


def post_burst(state, count: int) -> tuple[bool, bool, str]:
    """In this process: `count` receives and `count` sends of 64 bytes posted at once with
    `post_all` on a new loopback connection; (every receive holds its send's bytes, both
    endpoints post straight, what the process wrote to stdout and stderr meanwhile)."""
    import asyncio

    from phalanx.kv_transfer.transport import ucx_runtime as rt

    async def burst():
        rt.ensure_ucx("thread")
        listener, client, server = await _loopback()
        got = [np.zeros(64, np.uint8) for _ in range(count)]
        sent = [np.full(64, i % 251, np.uint8) for i in range(count)]
        ops = rt.post_all(server, False, 9, got) + rt.post_all(client, True, 9, sent)
        await asyncio.wait_for(asyncio.gather(*ops), CALL_TIMEOUT_S / 2)
        straight = rt._posts_straight(server) and rt._posts_straight(client)
        await client.close()
        listener.close()
        return all((a == b).all() for a, b in zip(got, sent)), straight

    (equal, straight), log = _with_output(state, burst())
    return equal, straight, log


def prepare_all(state, case: str, addrs: dict, request_id: str) -> str:
    """`prepare` every per-layer template batch of the request (as `send_all`'s
    "batches" form sends them), then another rank's copies: the ValueError's text."""
    from phalanx.kv_transfer.planning.copy_table import layer_batches
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


def cut_receives_then_fresh(state) -> tuple[bool, list, str]:
    """In this process: receives posted straight with `post_all` that nothing sends,
    cut by a deadline (`wait_for` cancels their futures, as the receiver's in-place
    deadline does) and their endpoints aborted (as `_break` does); then a receive and a
    send on a new loopback connection. (every cut future cancelled, what the new receive
    got, what the process wrote to stdout and stderr meanwhile)."""
    import asyncio

    from phalanx.kv_transfer.transport import ucx_runtime as rt

    async def cut_then_fresh():
        rt.ensure_ucx("thread")
        listener, client, server = await _loopback()
        cut = rt.post_all(server, False, 9, [np.zeros(64, np.uint8) for _ in range(4)])
        try:
            await asyncio.wait_for(asyncio.gather(*cut), 0.3)
        except asyncio.TimeoutError:
            pass
        rt.abort_endpoint(server)
        rt.abort_endpoint(client)
        await asyncio.sleep(0.3)  # ucxx completes the aborted requests meanwhile
        listener2, client2, server2 = await _loopback()
        got = np.zeros(64, np.uint8)
        ops = (rt.post_all(server2, False, 9, [got])
               + rt.post_all(client2, True, 9, [np.full(64, 5, np.uint8)]))
        await asyncio.wait_for(asyncio.gather(*ops), CALL_TIMEOUT_S / 2)
        await client2.close()
        listener2.close()
        listener.close()
        return all(f.cancelled() for f in cut), got.tolist()

    (cancelled, got), log = _with_output(state, cut_then_fresh())
    return cancelled, got, log
