"""Process plumbing of `bench/multi_gpu.py`: spawned rank processes with a deadline,
file rendezvous and a file barrier, device setup and sync, logging, freeing memory
between phases."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback

import torch

CPU_WORLD = 2  # ranks on CPU unless --world says otherwise


def rendezvous(opts: dict, name: str) -> str:
    """A fresh `file://` init method for the group `name` of this run. Files, not TCP
    ports: a port picked up front can be taken by then (gloo's own connections draw
    from the same ephemeral range), which failed a check's rendezvous with EADDRINUSE."""
    return "file://" + os.path.join(opts["rdv_dir"], name)


def file_barrier(opts: dict, name: str, rank: int, world: int, timeout_s: float) -> None:
    """Every rank of `world` touches `<rdv_dir>/<name>.<rank>`, then waits for all of
    them (for ranks that sit out a phase while the others run it)."""
    path = os.path.join(opts["rdv_dir"], name)
    open(f"{path}.{rank}", "w").close()
    end = time.monotonic() + timeout_s
    while not all(os.path.exists(f"{path}.{r}") for r in range(world)):
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name}: not all {world} ranks came within {timeout_s:.0f} s")
        time.sleep(0.05)


def _entry(fn, rank, world, opts, q) -> None:
    try:
        q.put((rank, "ok", fn(rank, world, opts)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_procs(fn, world: int, opts: dict, timeout_s: float) -> tuple[dict, dict]:
    """Run `fn(rank, world, opts)` in `world` spawned processes; (results, errors)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, opts, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end and len(results) + len(errors) < world:
            try:
                rank, status, val = q.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            (results if status == "ok" else errors)[rank] = val
            if status != "ok":
                break  # the peers would wait on the dead rank until their deadline
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, end - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in range(world):
        if r not in results and r not in errors:
            errors[r] = f"no result within {timeout_s:.0f} s (exit code {procs[r].exitcode})"
    return results, errors


def setup_device(rank: int, opts: dict) -> torch.device:
    if opts["device"] == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def log(opts: dict, msg: str) -> None:
    who = f" {opts['who']}" if opts.get("who") else ""
    print(f"[{time.monotonic() - opts['t0']:6.1f}s{who}] {msg}", flush=True)


def free_memory(dev: torch.device) -> None:
    import gc
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
