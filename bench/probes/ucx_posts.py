"""What posting a ucxx operation costs the posting thread: N receives and N sends of
`--mib` MiB each, posted at once, as tasks of `Endpoint.recv/send` (a coroutine per
operation, the transport's way until v10) or straight through the endpoint's request API
(`Endpoint._ep.tag_recv/tag_send`, what `kv_transfer.transport.ucx_runtime.post_all` does), per
ucxx progress mode, delayed submission on/off, and buffer kind (host, or device memory
as the transport hands pool regions to UCX: a bare `__cuda_array_interface__`).

One process per configuration (ucxx is initialised once per process), with both
endpoints of a loopback connection; receives on cuda:0, sends from cuda:1 when two GPUs
are visible. Reports the host time per posted receive and send (median of `--reps` after two
warm-up rounds) and the round's total (posts, transfer, every completion seen).

    python bench/probes/ucx_posts.py [--device cuda|cpu] [--modes thread-polling,thread]
                              [--count 96] [--mib 8] [--reps 8] [--bound-s 30]

Prints a table last and writes $OUT/ucx_posts.json (or ./ucx_posts.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time


class _DeviceBytes:
    """Device memory as the transport passes it to UCX (`staging.DeviceBytes`)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 2}


async def _measure(mode: str, device: str, count: int, nbytes: int, reps: int) -> dict:
    import numpy as np
    import ucxx
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXXTag, UCXXTagMaskFull
    from ucxx._lib_async.utils import hash64bits

    keep = []

    def buf(gpu: int):
        if device == "cpu":
            return np.zeros(nbytes, np.uint8)
        import torch
        t = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        keep.append(t)
        return _DeviceBytes(t.data_ptr(), nbytes)

    if device == "cuda":
        import torch
        torch.cuda.set_device(0)
    ucxx.init(progress_mode=mode, enable_python_future=True)
    accepted = asyncio.get_running_loop().create_future()

    async def on_connect(ep):
        accepted.set_result(ep)

    listener = ucxx.create_listener(on_connect)
    client = await ucxx.create_endpoint("127.0.0.1", listener.port)
    server = await accepted
    two = device == "cuda" and __import__("torch").cuda.device_count() > 1
    rbufs, sbufs = [buf(0) for _ in range(count)], [buf(1 if two else 0) for _ in range(count)]
    rtag = UCXXTag(hash64bits(server._tags["msg_recv"], hash(7)))
    stag = UCXXTag(hash64bits(client._tags["msg_send"], hash(7)))
    got: dict[str, list[float]] = {k: [] for k in ("straight", "tasks", "straight_send",
                                                   "tasks_send", "straight_ms", "tasks_ms")}
    for rep in range(reps + 2):
        for how in ("straight", "tasks"):
            t0 = time.perf_counter()
            if how == "straight":  # requests kept: a dropped UCXRequest is cancelled
                rreq = [server._ep.tag_recv(Array(b), rtag, UCXXTagMaskFull) for b in rbufs]
                t1 = time.perf_counter()
                sreq = [client._ep.tag_send(Array(b), stag) for b in sbufs]
                t2 = time.perf_counter()
                waits = [r.future for r in rreq + sreq]
            else:
                waits = await _as_tasks(server.recv, rbufs)
                t1 = time.perf_counter()
                waits += await _as_tasks(client.send, sbufs)
                t2 = time.perf_counter()
            await asyncio.gather(*waits)
            t3 = time.perf_counter()
            if rep >= 2:
                got[how].append((t1 - t0) / count * 1e6)
                got[how + "_send"].append((t2 - t1) / count * 1e6)
                got[how + "_ms"].append((t3 - t0) * 1e3)
    await client.close()
    listener.close()
    ucxx.stop_notifier_thread()  # a non-daemon thread: the process would not exit
    return {k: sorted(v)[len(v) // 2] for k, v in got.items()}


async def _as_tasks(post, bufs: list) -> list:
    """A task of `post(buf, tag=7)` per buffer, yielding to the loop after tasks 1, 2, 4,
    ... (as the transport's `_post_many` did until v10) and once at the end."""
    tasks = []
    for i, b in enumerate(bufs):
        tasks.append(asyncio.ensure_future(post(b, tag=7)))
        if (i + 1) & i == 0:
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    return tasks


def _child(args: list[str]) -> None:
    mode, delayed, device, count, nbytes, reps = args
    os.environ["UCXPY_ENABLE_DELAYED_SUBMISSION"] = delayed
    row = asyncio.run(_measure(mode, device, int(count), int(nbytes), int(reps)))
    print("RESULT " + json.dumps(row), flush=True)


def _result(stdout: str | bytes) -> dict:
    """The child's RESULT line as a dict ({} if it printed none)."""
    text = stdout if isinstance(stdout, str) else stdout.decode(errors="replace")
    found = [line for line in text.splitlines() if line.startswith("RESULT ")]
    return json.loads(found[-1][7:]) if found else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--modes", default="thread-polling,thread")
    ap.add_argument("--count", type=int, default=96)
    ap.add_argument("--mib", type=float, default=8)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--bound-s", type=float, default=30, help="per configuration")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child)
    nbytes, rows = int(args.mib * (1 << 20)), []
    for mode in args.modes.split(","):
        for delayed in ("1", "0"):
            cmd = [sys.executable, __file__, "--child", mode, delayed, args.device,
                   str(args.count), str(nbytes), str(args.reps)]
            row = {"mode": mode, "delayed": delayed == "1"}
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bound_s)
                stdout, error = out.stdout, (out.stderr.strip().splitlines() or ["?"])[-1]
            except subprocess.TimeoutExpired as e:  # what it printed before its bound
                stdout, error = e.stdout or "", "timeout"
            row.update(_result(stdout) or {"error": error})
            rows.append(row)
    with open(os.path.join(args.out, "ucx_posts.json"), "w") as f:
        json.dump({"device": args.device, "count": args.count, "mib": args.mib, "rows": rows},
                  f, indent=1)
    print(f"{args.count} x {args.mib} MiB, {args.device}")
    print("| mode | delayed | straight us/recv | us/send | tasks us/recv | us/send "
          "| straight round ms | tasks round ms |")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | {r['delayed']} | {r['error'][:60]} | | | | | |")
        else:
            print(f"| {r['mode']} | {r['delayed']} | {r['straight']:.1f} | "
                  f"{r['straight_send']:.1f} | {r['tasks']:.1f} | {r['tasks_send']:.1f} | "
                  f"{r['straight_ms']:.2f} | {r['tasks_ms']:.2f} |")


if __name__ == "__main__":
    main()
