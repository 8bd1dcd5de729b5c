"""What one ucxx completion costs, by progress mode: the hop every control message,
payload and acknowledgement of the KV transport pays (bench/NOTES.md v9).

Two processes per mode (ucxx is initialised once per process). The client times, per
round: a 64-byte host message to the server and its 64-byte reply (round trip); then,
with `--device cuda`, a 64-byte header, a payload of each `--sizes-mib` from the
client's device buffer into the server's, and the server's 64-byte acknowledgement
(request); and a burst: the header, `--burst` N x MiB payload messages posted at once on
both sides (the receiver posts after reading the header: the transport's in-place
pattern) and the acknowledgement. Medians over `--rounds` rounds after a fifth of warm-up.

Modes: thread / thread-polling with Python futures (ucxx's notifier thread sets them: what
the transport uses), thread without futures (each waiting coroutine re-checks its request
every loop turn), thread(-polling)+spin (futures on, but the waiting coroutine re-checks
its request every loop turn instead of awaiting the future), blocking (the loop wakes on
UCX's epoll descriptor and progresses the worker itself), polling (the loop progresses the
worker every turn). The modes without futures, blocking and polling keep the loop thread
busy (with the GIL) while anything is posted; blocking and polling also when idle.
On a 2-core machine thread-polling+spin starves (four spinning threads).

    python bench/probes/ucx_hops.py [--device cuda] [--two-gpu] [--modes ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

MODES = {"thread+fut": ("thread", True), "thread-polling+fut": ("thread-polling", True),
         "thread": ("thread", False), "blocking": ("blocking", False),
         "polling": ("polling", False), "thread-polling+spin": ("thread-polling", True),
         "thread+spin": ("thread", True)}
TAG_A, TAG_B, TAG_DATA = 1, 2, 3


def _init(mode: str) -> Any:
    import ucxx

    progress, fut = MODES[mode]
    ucxx.init(progress_mode=progress, enable_python_future=fut)
    return ucxx


class _Spin:
    """An endpoint whose send/recv re-check their request every loop turn instead of
    awaiting the future ucxx's notifier thread sets (modes '+spin')."""

    def __init__(self, ep: Any) -> None:
        self._ep = ep

    async def _wait(self, req: Any) -> None:
        while not req.completed:
            await asyncio.sleep(0)
        req.check_error()

    def _post(self, kind: str, buf: Any, tag: int) -> Any:
        from ucxx._lib.arr import Array
        from ucxx._lib_async.utils import hash64bits
        from ucxx.types import Tag

        t = Tag(hash64bits(self._ep._tags[f"msg_{kind}"], hash(tag)))  # as ucxx's Endpoint
        post = self._ep._ep.tag_send if kind == "send" else self._ep._ep.tag_recv
        return post(Array(buf), t)

    async def send(self, buf: Any, tag: int) -> None:
        await self._wait(self._post("send", buf, tag))

    async def recv(self, buf: Any, tag: int) -> None:
        await self._wait(self._post("recv", buf, tag))


def _wrap(mode: str, ep: Any) -> Any:
    return _Spin(ep) if mode.endswith("+spin") else ep


def _buffer(device: str, nbytes: int) -> Any:
    if device == "cpu":
        return np.zeros(nbytes, np.uint8)
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


async def _serve(mode: str, device: str, sizes: list[int], burst: tuple[int, int],
                 rounds: int, q: Any, finished: Any) -> None:
    ucxx = _init(mode)
    done = asyncio.Event()
    bufs = [_buffer(device, s) for s in sizes]
    parts = [_buffer(device, burst[1]) for _ in range(burst[0])]

    async def handler(ep: Any) -> None:
        ep = _wrap(mode, ep)
        small = np.zeros(64, np.uint8)
        for _ in range(rounds):
            await ep.recv(small, tag=TAG_A)
            await ep.send(small, tag=TAG_B)
        for buf in bufs:
            for _ in range(rounds):
                await ep.recv(small, tag=TAG_A)
                await ep.recv(buf, tag=TAG_DATA)
                await ep.send(small, tag=TAG_B)
        for _ in range(rounds):
            await ep.recv(small, tag=TAG_A)
            await asyncio.gather(*[ep.recv(p, tag=TAG_DATA) for p in parts])
            await ep.send(small, tag=TAG_B)
        done.set()

    listener = ucxx.create_listener(handler)
    q.put(listener.port)
    await done.wait()
    # The endpoint stays open until the client has its last reply: closing it earlier
    # cancels the client's receive on a loaded machine.
    await asyncio.get_running_loop().run_in_executor(None, finished.wait, 60)
    ucxx.stop_notifier_thread()  # a non-daemon thread: the process would not exit


def _server_main(mode: str, device: str, sizes: list[int], burst: tuple[int, int],
                 rounds: int, q: Any, finished: Any) -> None:
    asyncio.run(_serve(mode, device, sizes, burst, rounds, q, finished))


def _median_us(ts: list[float]) -> float:
    return float(np.median(ts[len(ts) // 5:])) * 1e6


async def _client(mode: str, device: str, sizes: list[int], burst: tuple[int, int],
                  rounds: int, port: int) -> dict:
    ucxx = _init(mode)
    ep = _wrap(mode, await ucxx.create_endpoint("127.0.0.1", port))
    small, reply = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    rtt = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await ep.send(small, tag=TAG_A)
        await ep.recv(reply, tag=TAG_B)
        rtt.append(time.perf_counter() - t0)
    row = {"mode": mode, "rtt_us": _median_us(rtt)}
    for size in sizes:
        buf, ts = _buffer(device, size), []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await ep.send(small, tag=TAG_A)
            await ep.send(buf, tag=TAG_DATA)
            await ep.recv(reply, tag=TAG_B)
            ts.append(time.perf_counter() - t0)
        row[f"req_{size >> 20}MiB_us"] = _median_us(ts)
    parts, ts = [_buffer(device, burst[1]) for _ in range(burst[0])], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await ep.send(small, tag=TAG_A)
        await asyncio.gather(*[ep.send(p, tag=TAG_DATA) for p in parts])
        await ep.recv(reply, tag=TAG_B)
        ts.append(time.perf_counter() - t0)
    row[_burst_key(burst)] = _median_us(ts)
    ucxx.stop_notifier_thread()  # a non-daemon thread: the process would not exit
    return row


def _burst_key(burst: tuple[int, int]) -> str:
    return f"burst_{burst[0]}x{burst[1] >> 20}MiB_us"


def _client_main(mode: str, device: str, sizes: list[int], burst: tuple[int, int],
                 rounds: int, q: Any, out: Any, finished: Any) -> None:
    try:
        out.put(asyncio.run(_client(mode, device, sizes, burst, rounds, q.get(timeout=60))))
    except Exception as e:
        out.put({"mode": mode, "error": repr(e)})
    finally:
        finished.set()


def run_mode(mode: str, device: str, server_device: str, sizes: list[int],
             burst: tuple[int, int], rounds: int) -> dict:
    """One mode in two fresh processes (ucxx is initialised once per process)."""
    ctx = mp.get_context("spawn")
    q, out, finished = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_server_main,
                         args=(mode, server_device, sizes, burst, rounds, q, finished)),
             ctx.Process(target=_client_main,
                         args=(mode, device, sizes, burst, rounds, q, out, finished))]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--two-gpu", action="store_true", help="server buffers on cuda:1")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--sizes-mib", default="1,64")
    ap.add_argument("--burst", default="96x8", help="N x MiB: N messages posted at once")
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")] if args.device == "cuda" else []
    client_dev = "cuda:0" if args.device == "cuda" else "cpu"
    server_dev = "cuda:1" if args.two_gpu else client_dev
    count, mib = (int(x) for x in args.burst.split("x"))
    burst = (count, mib << 20)
    rows = []
    for mode in args.modes.split(","):
        try:
            rows.append(run_mode(mode, client_dev, server_dev, sizes, burst, args.rounds))
        except Exception as e:  # one mode failing must not hide the others
            rows.append({"mode": mode, "error": repr(e)})
    with open(os.path.join(args.out, "ucx_hops.json"), "w") as f:
        json.dump({"device": args.device, "two_gpu": args.two_gpu, "rows": rows}, f, indent=1)
    keys = ["rtt_us"] + [f"req_{s >> 20}MiB_us" for s in sizes] + [_burst_key(burst)]
    print("| mode | " + " | ".join(keys) + " |")
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else r.get("error", "-")[:40] for k in keys]
        print(f"| {r['mode']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
