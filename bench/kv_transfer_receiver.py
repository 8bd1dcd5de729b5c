"""The receiver process of `bench/kv_transfer.py`: one decode rank's `KVReceiver` over
empty pools, a raw ucxx listener (the raw baselines), and on cuda the NCCL baseline's
receiving side; it answers the parent's commands until told to stop."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

import kv_transfer_gpu as gpu
from kv_transfer_proc import (EARLY, TAG_EARLY, cpu_seconds, digest, make_buf, make_pools,
                              pool_spans, profiled, recv_cmd, set_env)
from kv_transfer_request import KV_HEADS, PAGE, request_plan, sender_shares


def receiver_main(pipe, args) -> None:
    dev = set_env(args, args["p"])
    try:
        profiled(args, "receiver", lambda: asyncio.run(_receiver(pipe, args, dev)))
    finally:
        if args["nccl"]:
            gpu.nccl_close()


async def _receiver(pipe, args, dev: torch.device) -> None:
    from phalanx.kv_transfer.transport import KVReceiver, ensure_ucx, shutdown_ucx
    ucxx = ensure_ucx(args["progress"])
    num_pages = -(-args["max_tokens"] // PAGE) + 8
    pools = make_pools(num_pages, KV_HEADS, False, dev)
    rx = KVReceiver(pools, rank=0, epoch=1,
                    timeout_s=60.0, staging_buffers=args["staging"], progress_mode=args["progress"],
                    max_payload_bytes=args["payload_mib"] << 20, direct=args["direct"])
    addr = await rx.start()
    raw_eps, nccl_bufs = [], {}

    early: dict[int, list] = {}  # tokens -> raw_spans_early's receives, posted ahead
    raw_serve = _raw_server(args, dev, pools, num_pages, raw_eps, early)
    listener = ucxx.create_listener(raw_serve, 0)
    pipe.send((addr, ("127.0.0.1", listener.port)))
    while (cmd := await recv_cmd(pipe)) is not None:
        if cmd == "cpu":
            pipe.send(cpu_seconds())
            continue
        rid, tokens = cmd
        if rid == "digest":  # per sender rank, its share as it landed here
            tables = request_plan(args["p"], tokens, num_pages, args["pages"])[0]
            pipe.send([digest(pools, [tables[(s, 0)]], "dst") for s in range(args["p"])])
            continue
        if rid == "early":
            early[tokens] = _post_early(args, pools, num_pages, raw_eps[0], tokens)
            await asyncio.sleep(0)  # the tasks post their receives
            pipe.send("posted")
            continue
        if rid == "nccl":  # blocks this loop: nothing else is in flight meanwhile
            if tokens not in nccl_bufs:
                shares = sender_shares(args["p"], tokens, num_pages, args["pages"])
                nccl_bufs[tokens] = [make_buf(n, dev) for n in shares]
            gpu.nccl_recv(nccl_bufs[tokens])
            pipe.send("nccl")
            continue
        await rx.wait_request(rid, tokens, timeout_s=30.0)
        await rx.release(rid)
        pipe.send(rx.stats["bytes"])
    await rx.close()
    for ep in raw_eps:
        ep.abort()
    await asyncio.sleep(0.2)  # let the raw handlers see the close and return
    listener.close()
    shutdown_ucx()


def _mark(args, event: str, detail: str) -> None:
    if args.get("trace"):
        import kv_transfer_trace
        kv_transfer_trace.mark(event, detail)


_SPANS: dict[int, list] = {}  # tokens -> the request's spans (one set of pools per process)


def _dst_spans(args, pools, num_pages: int, tokens: int) -> list:
    """The request's (layer, kind) spans in the receiver's pools, made once per size."""
    if tokens not in _SPANS:
        _SPANS[tokens] = pool_spans(
            pools, request_plan(1, tokens, num_pages, args["pages"])[0][(0, 0)], "dst")
    return _SPANS[tokens]


def _post_early(args, pools, num_pages: int, ep, tokens: int) -> list:
    """raw_spans_early's receives of the request's spans on `ep` (tag TAG_EARLY), posted
    now (before the run's start instant), as tasks."""
    return [asyncio.ensure_future(ep.recv(r, tag=TAG_EARLY))
            for r in _dst_spans(args, pools, num_pages, tokens)]


def _raw_server(args, dev: torch.device, pools, num_pages: int, raw_eps: list, early: dict):
    """The raw baselines' listener handler: per run a header [count, size, tokens], then
    `count` messages (raw_spans: straight into the pools' spans, all posted; raw_spans_early,
    header size EARLY: the same, their receives in `early`, posted before the run; else
    into `--staging` buffers of `size`); a 1-byte reply once they are in."""
    async def raw_serve(ep):
        raw_eps.append(ep)
        bufs = [make_buf(0, dev)] * args["staging"]
        head = np.empty(3, dtype="<u8")
        while True:
            try:
                await ep.recv(head)
                count, size, tokens = (int(x) for x in head)
                _mark(args, "raw_head_read", str(count))
                if tokens:
                    regions = _dst_spans(args, pools, num_pages, tokens)
                    assert len(regions) == count
                    if size == EARLY:  # raw_spans_early: its receives were posted ahead
                        await asyncio.gather(*early.pop(tokens))
                        await ep.send(np.ones(1, dtype=np.uint8))
                        continue
                    await asyncio.gather(*(ep.recv(r) for r in regions))
                    await ep.send(np.ones(1, dtype=np.uint8))
                    continue
                bufs = [b if len(b) >= size else make_buf(size, dev) for b in bufs]
                window = asyncio.Semaphore(len(bufs))

                async def one(i: int) -> None:
                    async with window:
                        await ep.recv(bufs[i % len(bufs)][:size])

                await asyncio.gather(*(one(i) for i in range(count)))
                _mark(args, "raw_data_read", str(count))
                await ep.send(np.ones(1, dtype=np.uint8))
            except Exception:
                for task in (t for posted in early.values() for t in posted):
                    task.cancel()
                return

    return raw_serve
