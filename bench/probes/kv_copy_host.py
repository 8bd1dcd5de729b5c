"""Host cost of one staged KV message on CUDA (`KVPools.gather` through the slab kernel),
piece by piece: the parts a transport loop pays per message before the wire can move it.

    python bench/probes/kv_copy_host.py [--tokens 32768] [--payload-mib 128] [--reps 50] [--sweep]

Shape as bench/kv_transfer.py (48 layers, 4 KV heads, head_dim 128, bf16, page 16),
the request's pages shuffled (every page a slab: the staged path), one message of
`--payload-mib`. Per piece, the median host time over `--reps` (the stream drained
between reps); the kernel's device time by CUDA events for scale. Prints a table and
writes JSON to $OUT/kv_copy_host.json. CUDA only."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

# the request's shape comes from bench/kv_transfer_request.py, one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kv_transfer_request import HEAD_DIM, KV_HEADS, LAYERS, PAGE, rank_batches  # noqa: E402


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _message(args):
    """The pools, the request's template located in them, one staged message's blocks
    (pieces of at most `--payload-mib`), its bytes, and how long locating took (us)."""
    from phalanx.kv_transfer.transport.staging import KVPools
    dev = torch.device("cuda", 0)
    num_pages = args.tokens // PAGE + 8
    flat = torch.zeros(LAYERS, 2, num_pages, KV_HEADS, PAGE, HEAD_DIM, dtype=torch.bfloat16,
                       device=dev)
    pools = KVPools([(flat[i, 0], flat[i, 1]) for i in range(LAYERS)])
    template, blocks = rank_batches(0, 1, args.tokens, num_pages, "shuffled")[1][0]
    capacity = args.payload_mib << 20
    t = time.perf_counter()
    tmpl = pools.template(template, "src")
    locate_us = (time.perf_counter() - t) * 1e6
    pieces, total = [], 0
    for block in blocks.tolist():
        for piece, n in tmpl.cut(tuple(block), capacity):
            if total + n > capacity:
                break
            pieces.append(piece)
            total += n
    return pools, tmpl, np.array(pieces, dtype=np.int32), total, locate_us


def _host_pieces(pools, tmpl, msg: np.ndarray, total: int, reps: int
                 ) -> tuple[dict[str, float], float, float, int]:
    """Median host us per piece of one message's gather; the slab index's first build
    (us), the kernel's device time (us) and the message's slab count."""
    from phalanx.kv_transfer.transport.slab_copy import (BLOCK, SLABS_PER_PROGRAM, DescRing,
                                               _slab_copy_kernel)
    import triton

    dev = pools.device
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    t = time.perf_counter()
    index = tmpl.slabs(pools)
    index_us = (time.perf_counter() - t) * 1e6
    numel = pools.pools[0][0].numel()
    rows, most = index.block_rows(msg, numel)
    payload = out.view(torch.bfloat16)
    pinned = torch.from_numpy(rows).pin_memory()
    desc = pinned.to(dev)
    block = min(BLOCK, triton.next_power_of_2(index.max_len))
    grid = (len(rows), triton.cdiv(most, SLABS_PER_PROGRAM))
    ring = torch.empty(1 << 16, dtype=torch.int64).pin_memory()
    desc_ring = DescRing(dev)

    def launch():
        _slab_copy_kernel[grid](pools._flat, payload, *index._dev, desc, 0, TO_PAYLOAD=True,
                                SLABS=SLABS_PER_PROGRAM, BLOCK=block,
                                MAX_LEN=triton.cdiv(index.max_len, block) * block,
                                ALIGN=16, num_warps=4)

    def ring_h2d():
        view = ring[:rows.size]
        view.numpy()[:] = rows.ravel()
        return view.view(rows.shape).to(dev, non_blocking=True)

    def record_query():
        pools._record().query()

    launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    launch()
    end.record()
    torch.cuda.synchronize()
    pieces = {
        "block_rows (numpy)": lambda: index.block_rows(msg, numel),
        "from_numpy + pin_memory": lambda: torch.from_numpy(rows).pin_memory(),
        "pinned -> device (non_blocking)": lambda: pinned.to(dev, non_blocking=True),
        "ring pinned copy + to (non_blocking)": ring_h2d,
        "kernel launch": launch,
        "SlabIndex.copy": lambda: index.copy(pools._flat, payload, msg, numel, True),
        "SlabIndex.copy, rows in a mapped ring (compiled launch)":
            lambda: index.copy(pools._flat, payload, msg, numel, True, ring=desc_ring),
        "KVPools.gather (+ stream, event)": lambda: pools.gather(tmpl, msg, out),
        "event record + query": record_query,
    }
    return ({name: _median_us(fn, reps) for name, fn in pieces.items()}, index_us,
            start.elapsed_time(end) * 1e3, int(rows[:, 1].sum()))


def _kernel_sweep(pools, tmpl, msg: np.ndarray, total: int, reps: int) -> list[dict]:
    """Device time (us, CUDA events over `reps` back-to-back gathers) of each launch
    shape on random pools; every shape's payload must equal the default's bit for bit."""
    from phalanx.kv_transfer.transport.slab_copy import BLOCK, NUM_WARPS, SLABS_PER_PROGRAM

    pools._flat.copy_(torch.randn_like(pools._flat))
    index, numel, dev = tmpl.slabs(pools), pools.pools[0][0].numel(), pools.device
    want = torch.empty(total // 2, dtype=torch.bfloat16, device=dev)
    index.copy(pools._flat, want, msg, numel, True)
    rows = []
    for slabs in (2, 4, 8):
        for block in (1024, 2048):
            for warps in (2, 4, 8):
                got = torch.zeros_like(want)
                kw = dict(slabs=slabs, block=block, num_warps=warps)
                index.copy(pools._flat, got, msg, numel, True, **kw)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda.synchronize()
                start.record()
                for _ in range(reps):
                    index.copy(pools._flat, got, msg, numel, True, **kw)
                end.record()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) * 1e3 / reps
                rows.append({**kw, "device_us": us, "tb_per_s": 2 * total / us / 1e6,
                             "equal": bool(torch.equal(got, want)),
                             "default": (slabs, block, warps) == (SLABS_PER_PROGRAM, BLOCK,
                                                                 NUM_WARPS)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--payload-mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the slab kernel's launch shapes (device us, TB/s moved)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_copy_host: CUDA only (run it on the GPU machine)")
    pools, tmpl, msg, total, locate_us = _message(args)
    pieces_us, index_us, kernel_us, slabs = _host_pieces(pools, tmpl, msg, total, args.reps)
    result = {"tokens": args.tokens, "message_bytes": total, "blocks": len(msg),
              "slabs": slabs, "locate_template_us": locate_us, "slab_index_first_us": index_us,
              "kernel_device_us": kernel_us, "host_us": pieces_us,
              "gpu": torch.cuda.get_device_name(pools.device)}
    print(f"message: {total} bytes, {len(msg)} blocks, {slabs} slabs; template located "
          f"{locate_us:.0f} us, slab index built {index_us:.0f} us, kernel {kernel_us:.0f} us "
          f"on the device")
    print("| piece | host us (median) |\n|---|---|")
    for name, us in pieces_us.items():
        print(f"| {name} | {us:.1f} |")
    if args.sweep:
        result["sweep"] = _kernel_sweep(pools, tmpl, msg, total, 20)
        print("| slabs | block | warps | device us | TB/s (read+write) | equal |\n|---|---|---|---|---|---|")
        for r in result["sweep"]:
            mark = " (default)" if r["default"] else ""
            print(f"| {r['slabs']} | {r['block']} | {r['num_warps']}{mark} | {r['device_us']:.1f} "
                  f"| {r['tb_per_s']:.2f} | {r['equal']} |")
    path = os.path.join(os.environ.get("OUT", "."), "kv_copy_host.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
