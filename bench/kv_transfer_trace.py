"""`bench/kv_transfer.py --trace`: a timeline of one process's transport operations.

Wraps the transport's send/receive posts (per tag: posted, completed), its gathers and
scatters (start, end) and the receiver's message handling, appending
(CLOCK_MONOTONIC seconds, event, detail) to a list that `dump` writes to
$OUT/trace_<role>.json. Timestamps share one clock across the processes of one host, so
the sender's and the receiver's timelines line up. Bench-only: patches module globals.
"""

from __future__ import annotations

import inspect
import json
import os
import time

EVENTS: list[tuple[float, str, str]] = []
_TAGS: dict[int, str] = {}


def mark(event: str, detail: str = "") -> None:
    EVENTS.append((time.monotonic(), event, detail))


def _tag_name(tag) -> str:
    """ctrl, payload, reply, direct (any message's `direct_tag`) or the tag itself."""
    if isinstance(tag, int) and tag > 7 and tag & 7 == 4:
        return "direct"
    return _TAGS.get(tag, str(tag))


def install() -> None:
    from phalanx.kv_transfer.transport import (direct_landing, receiver, send_connection, sender,
                                     staging, ucx_runtime as rt)

    _TAGS.update({rt.TAG_CTRL: "ctrl", rt.TAG_PAYLOAD: "payload", rt.TAG_REPLY: "reply",
                  rt.TAG_DIRECT: "direct"})

    from ucxx._lib_async.endpoint import Endpoint

    def handed(name: str, inner):  # when ucxx hands the operation to UCX (a task step later)
        async def wrapper(self, buffer, tag=None, force_tag=False):
            if tag in (rt.TAG_CTRL, rt.TAG_REPLY) or tag is None:
                mark(f"ucx_{name}_{_TAGS.get(tag, 'raw')}")
            return await inner(self, buffer, tag=tag, force_tag=force_tag)
        return wrapper

    def traced_all(ep, send, tag, bufs, into=None):
        name = f"{'send' if send else 'recv'}_{_tag_name(tag)}"
        out = [] if into is None else into

        def marked():
            for buf in bufs:
                size = str(buf.nbytes if hasattr(buf, "nbytes") else len(buf))
                mark(f"{name}_post", size)
                yield buf
                out[-1].add_done_callback(lambda _f, size=size: mark(f"{name}_done", size))

        return rt.post_all(ep, send, tag, marked(), into=out)

    for module in (sender, direct_landing, send_connection, receiver):
        module.post_all = traced_all
    Endpoint.send = handed("send", Endpoint.send)
    Endpoint.recv = handed("recv", Endpoint.recv)
    for cls, name in ((staging.KVPools, "gather"), (staging.KVPools, "scatter"),
                      (staging.KVPools, "wait")):
        _wrap_method(cls, name)
    _wrap_method(receiver.KVReceiver, "_apply")
    from phalanx.kv_transfer.transport import part_cutter, slab_copy
    _wrap_method(send_connection.SendConnection, "request")
    _wrap_method(slab_copy.SlabIndex, "copy")
    _wrap_method(slab_copy.SlabIndex, "block_rows")
    _wrap_method(slab_copy.DescRing, "upload")
    _wrap_launch(slab_copy._slab_copy_kernel)
    _wrap_method(staging.KVPools, "_record")
    for cls, name in ((part_cutter.PartCutter, "_batches"),
                      (part_cutter.PartCutter, "_template"),
                      (send_connection.SendConnection, "next_message"),
                      (send_connection.SendConnection, "announce"),
                      (receiver.KVReceiver, "_template"),
                      (receiver.KVReceiver, "_land_in_place"), (receiver.KVReceiver, "_finish"),
                      (sender.KVSender, "send_layer"), (staging.KVPools, "ready_event"),
                      (sender.KVSender, "_post"), (sender.KVSender, "_conn")):
        _wrap_method(cls, name)


def _wrap_method(cls, name: str) -> None:
    """Marks `name`_start and `name`_end around every call of cls.name; a synchronous
    call's end carries the calling thread's CPU time inside it (`cpu=` µs: far below
    the wall time between the marks, the thread was waiting, e.g. for the GIL)."""
    inner = getattr(cls, name)
    if inspect.iscoroutinefunction(inner):
        async def wrapper(self, *args, **kwargs):
            mark(f"{name}_start")
            try:
                return await inner(self, *args, **kwargs)
            finally:
                mark(f"{name}_end")
    else:
        wrapper = _timed(name, inner)
    setattr(cls, name, wrapper)


def _timed(name: str, fn):
    """`fn` marking `name`_start and `name`_end, the end with the thread's CPU µs."""
    def wrapper(*args, **kwargs):
        mark(f"{name}_start")
        cpu = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"{name}_end", f"cpu={(time.thread_time() - cpu) * 1e6:.0f}")
    return wrapper


def _wrap_launch(kernel) -> None:
    """Marks launch_start / launch_end (with CPU µs) around a Triton kernel's launches."""
    kernel.run = _timed("launch", kernel.run)


def dump(role: str) -> None:
    path = os.path.join(os.environ.get("OUT", "."), f"trace_{role}.json")
    with open(path, "w") as f:
        json.dump(EVENTS, f)


def timeline(out_dir: str, mode: str = "pipelined", limit: int = 120) -> list[str]:
    """The last `mode` run's events of every process in `out_dir`, merged, as lines
    'ms role event detail' relative to the run's start."""
    traces = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("trace_") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                traces[name[6:-5]] = json.load(f)
    cmds = [(t, d) for role, ev in traces.items() if role.startswith("sender")
            for t, e, d in ev if e == "cmd"]
    cmds.sort()
    starts = [t for t, d in cmds if d == mode]
    if not starts:
        return [f"no {mode} run in {out_dir}"]
    t0 = starts[-1]
    t1 = min([t for t, _ in cmds if t > t0] or [float("inf")])
    merged = sorted((t, role, e, d) for role, ev in traces.items() for t, e, d in ev
                    if t0 <= t < t1 and e != "cmd")
    return [f"{(t - t0) * 1e3:9.3f} {role:10s} {e:22s} {d}" for t, role, e, d in merged[:limit]]


def summary(lines: list[str]) -> list[str]:
    """Per event kind of a timeline: count, and the median gap (ms) from each occurrence
    to the next of the same kind, plus the median duration of start/end and post/done
    pairs taken in order (and of a start/end pair, its median CPU time, ms)."""
    import statistics
    times: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}  # CPU µs of the calls that ended
    for line in lines:
        parts = line.split()
        if len(parts) >= 3:
            times.setdefault((parts[1], parts[2]), []).append(float(parts[0]))
        if len(parts) >= 4 and parts[3].startswith("cpu="):
            cpus.setdefault((parts[1], parts[2]), []).append(float(parts[3][4:]))
    out = []
    for (role, event), ts in sorted(times.items()):
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        row = f"{role:10s} {event:22s} n={len(ts):3d} gap={statistics.median(gaps) if gaps else 0:7.3f}"
        for a, b in (("_start", "_end"), ("_post", "_done")):
            if event.endswith(a):
                ends = times.get((role, event[:-len(a)] + b), [])
                durs = [e - s for s, e in zip(ts, ends)]
                if durs:
                    row += f" dur={statistics.median(durs):7.3f} max={max(durs):7.3f}"
                spent = cpus.get((role, event[:-len(a)] + b))
                if a == "_start" and spent:
                    row += f" cpu={statistics.median(spent) / 1e3:7.3f}"
        out.append(row)
    return out


if __name__ == "__main__":
    import sys
    mode = sys.argv[2] if len(sys.argv) > 2 else "pipelined"
    lines = timeline(sys.argv[1], mode, limit=100000)
    for line in summary(lines):
        print(line)
    lo, hi = (int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0:60").split(":"))
    for line in lines[lo:hi]:
        print(line)
