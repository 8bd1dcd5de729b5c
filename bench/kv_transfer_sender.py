"""A sender process of `bench/kv_transfer.py`: one prefill rank's `KVSender` over filled
pools, a raw ucxx endpoint to the receiver, and on cuda the NCCL baseline's sending side;
per command it waits for the start instant, moves its share one way and reports."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

import kv_transfer_gpu as gpu
from kv_transfer_proc import (EARLY, TAG_EARLY, cpu_seconds, digest, make_buf, make_pools,
                              pool_spans, profiled, recv_cmd, set_env, sleep_until)
from kv_transfer_request import LAYERS, PAGE, kv_layouts, rank_batches, request_plan


def sender_main(pipe, rank: int, args) -> None:
    dev = set_env(args, rank)
    try:
        profiled(args, f"sender{rank}", lambda: asyncio.run(_sender(pipe, rank, args, dev)))
    finally:
        if args["nccl"]:
            gpu.nccl_close()


async def _sender(pipe, rank: int, args, dev: torch.device) -> None:
    from phalanx.kv_transfer.transport import KVSender, ensure_ucx, shutdown_ucx
    ucxx = ensure_ucx(args["progress"])
    src, _ = kv_layouts(args["p"], 1)
    heads = len(src.heads_of(rank))
    num_pages = -(-args["max_tokens"] // PAGE) + 8
    pools = make_pools(num_pages, heads, True, dev)
    tx = KVSender(pools, rank=rank, epoch=1, timeout_s=60.0,
                  staging_buffers=args["staging"], progress_mode=args["progress"],
                  announce=args.get("announce", True))
    addr, raw_addr = pipe.recv()
    await tx.connect(tuple(addr))
    raw_ep = await ucxx.create_endpoint(*raw_addr)
    raw_buf, reply = make_buf(0, dev), np.empty(1, dtype=np.uint8)
    plans, spans = {}, {}
    pipe.send("ready")
    while (cmd := await recv_cmd(pipe)) is not None:
        if cmd[0] == "digest":
            tables = request_plan(args["p"], cmd[1], num_pages, args["pages"])[0]
            pipe.send(digest(pools, [tables[(rank, 0)]], "src"))
            continue
        what, rid, tokens, start = cmd
        if tokens not in plans:
            plans[tokens] = rank_batches(rank, args["p"], tokens, num_pages, args["pages"])
        batches, whole, plan_s, nbytes = plans[tokens]
        if what.startswith("raw") or what == "nccl":
            if len(raw_buf) < nbytes:
                raw_buf = make_buf(nbytes, dev)
        prepare_s = 0.0
        if what == "whole_prepared":
            t = time.perf_counter()
            tx.prepare(tuple(addr), rid, whole)
            prepare_s = time.perf_counter() - t
        await sleep_until(start, args.get("spin_ms", 0.0) / 1e3)
        if args.get("trace"):
            import kv_transfer_trace
            kv_transfer_trace.mark("cmd", what)
        cpu0 = cpu_seconds()
        if what == "nccl":
            gpu.nccl_send(raw_buf[:nbytes], args["p"])
        elif what in ("raw_spans", "raw_spans_early"):
            regions = spans[tokens] = spans.get(tokens) or pool_spans(
                pools, request_plan(args["p"], tokens, num_pages, args["pages"])[0][(rank, 0)], "src")
            await _send_spans(raw_ep, regions, tokens, what == "raw_spans_early")
            await raw_ep.recv(reply)
        elif what.startswith("raw"):
            count = 1 if what == "raw" else LAYERS
            size = nbytes // count
            await raw_ep.send(np.array([count, size, 0], dtype="<u8"))
            await asyncio.gather(*(raw_ep.send(raw_buf[i * size:(i + 1) * size])
                                   for i in range(count)))
            await raw_ep.recv(reply)
        elif what in ("whole", "whole_prepared"):
            await tx.send_layer(tuple(addr), rid, whole)
        elif what == "pipelined":
            await asyncio.gather(*(tx.send_layer(tuple(addr), rid, b) for b in batches))
        else:
            for b in batches:
                await tx.send_layer(tuple(addr), rid, b)
        if args.get("trace"):
            kv_transfer_trace.mark("end", what)
        pipe.send((time.monotonic(), nbytes, plan_s, cpu_seconds() - cpu0, prepare_s))
    await tx.close()
    raw_ep.abort()
    shutdown_ucx()


async def _send_spans(ep, regions: list, tokens: int, early: bool) -> None:
    """raw_spans: the header, then once it is sent every span; raw_spans_early (the
    receiver's receives already posted, on their own tag): all at once."""
    head = ep.send(np.array([len(regions), EARLY if early else 0, tokens], dtype="<u8"))
    if early:
        await asyncio.gather(head, *(ep.send(r, tag=TAG_EARLY) for r in regions))
    else:
        await head
        await asyncio.gather(*(ep.send(r) for r in regions))
