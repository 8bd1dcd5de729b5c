"""Process plumbing of `bench/multi_gpu.py`: spawned rank processes with a deadline,
file rendezvous and a file barrier, device setup and sync, logging, freeing memory
between phases."""

from __future__ import annotations

import os
import time

import torch

from phalanx.spawn import run_ranks

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


def run_procs(fn, world: int, opts: dict, timeout_s: float) -> tuple[dict, dict]:
    """Run `fn(rank, world, opts)` in `world` spawned processes; (results, errors)."""
    return run_ranks(fn, world, (opts,), timeout_s=timeout_s, stop_on_error=True)


def setup_device(rank: int, opts: dict) -> torch.device:
    if opts["device"] == "cuda":
        index = rank % torch.cuda.device_count()  # --share-gpus: ranks wrap around
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
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
