"""The MoE exchange through symmetric memory (comm/peer_exchange.py) on one GPU, its
ranks simulated as streams of one process (`LocalWorld`): what a step's exchange costs
in device time, against the copy floor measured in the same run.

    python bench/peer_exchange.py [--worlds 2,4,8] [--tokens 16,64,128] [--iters 50]

Rows: the decode MoE dispatch of the Qwen3-30B-A3B shape (hidden 2048 + the pair's
metadata, bf16, top-8): per rank `tokens` x 8 pairs, so the padded capacity is that
many rows per (source, destination) block. Per case, every rank's exchange (put, then
wait) is queued on its own stream; the round is captured in a CUDA graph and its replay
timed by CUDA events (median of `--iters`: device time, without the host's launches,
which are reported apart: host time to queue one rank's exchange eagerly), for full blocks and for blocks cut to the
average load (`counts` = capacity / world: what the padded path sends). The floor is
the round's bytes read + written at the device-to-device copy rate measured here. On
one GPU all ranks share its memory, so this is the exchange's own cost (launches,
flags, waits), not NVLink's. Prints a table and writes JSON to $OUT/peer_exchange.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

HIDDEN, META, TOP_K = 2048, 8, 8


def _copy_rate(nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * nbytes / statistics.median(times)


def _queue_round(ex, streams, sends, counts) -> None:
    """Every rank's put on its stream, joined, then every rank's wait: on one GPU a
    wait must not run ahead of (and hold the resources of) a put it needs, which two
    streams sharing a hardware queue, or a graph's branches run in turn, would allow.
    (On GPUs of their own, a rank's put and wait share its one stream.)"""
    main = torch.cuda.current_stream()
    for fork in (lambda r, e: e.put(sends[r], counts[r]), lambda r, e: e.wait()):
        for r, (e, st) in enumerate(zip(ex, streams)):
            st.wait_stream(main)
            with torch.cuda.stream(st):
                fork(r, e)
        for st in streams:
            main.wait_stream(st)


def _drain(ex, event, what: str) -> None:
    """Wait for `event`, at most 10 s; past it, abort every rank's waits and fail."""
    end = time.monotonic() + 10.0
    while not event.query():
        if time.monotonic() > end:
            for e in ex:
                e.abort()
            torch.cuda.synchronize()
            raise RuntimeError(f"{what}: not done within 10 s (a wait never saw its put)")
        time.sleep(1e-4)


def _round_s(ex, streams, sends, counts, iters: int) -> tuple[float, float]:
    """(device seconds of one round replayed from a CUDA graph, median of `iters`;
    host seconds to queue one rank's exchange eagerly, median)."""
    host = []
    for _ in range(5):  # eager rounds: compile, warm up, and time the launches
        torch.cuda.synchronize()
        t = time.perf_counter()
        _queue_round(ex, streams, sends, counts)
        host.append((time.perf_counter() - t) / len(ex))
        done = torch.cuda.Event()
        done.record()
        _drain(ex, done, "eager round")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _queue_round(ex, streams, sends, counts)
    times = []
    for _ in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        _drain(ex, end, "graph replay")
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[3:]), statistics.median(host[1:])


def _case(world: int, tokens: int, iters: int, rate: float) -> list[dict]:
    from phalanx.comm.peer_exchange import PeerExchange
    from phalanx.comm.peer_memory import LocalWorld
    cap, width = tokens * TOP_K, HIDDEN + META
    lw = LocalWorld(world, "cuda")
    ex = [PeerExchange(lw.rank(r), "ch", cap, width, torch.bfloat16) for r in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    sends = [torch.randn(world * cap, width, device="cuda").bfloat16() for _ in range(world)]
    rows = []
    for label, per_block in (("full", cap), ("average", max(1, cap // world))):
        counts = [None if label == "full" else
                  torch.full((world,), per_block, dtype=torch.int64, device="cuda")
                  for _ in range(world)]
        t, host_s = _round_s(ex, streams, sends, counts, iters)
        if any(e.failed() for e in ex):
            raise RuntimeError(f"world {world} tokens {tokens}: a wait failed")
        nbytes = world * world * per_block * width * 2
        rows.append({"world": world, "tokens": tokens, "blocks": label, "rows": per_block,
                     "bytes": nbytes, "us": t * 1e6, "host_us": host_s * 1e6, "floor_us": 2 * nbytes / rate * 1e6,
                     "of_floor": (2 * nbytes / rate) / t})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--tokens", default="16,64,128")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    rate = _copy_rate(256 << 20)
    rows = [r for w in map(int, args.worlds.split(",")) for t in map(int, args.tokens.split(","))
            for r in _case(w, t, args.iters, rate)]
    print(f"copy rate {rate / 1e12:.2f} TB/s (read + write)")
    print("| world | tokens/rank | blocks | rows/block | MiB | device us | floor us | of floor "
          "| host us per rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['tokens']} | {r['blocks']} | {r['rows']} | "
              f"{r['bytes'] / 2**20:.2f} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['of_floor']:.2f} | {r['host_us']:.0f} |")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "peer_exchange.json"), "w") as f:
        json.dump({"copy_rate": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
