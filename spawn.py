"""Run one function on N spawned processes ("ranks") with a deadline: the process
plumbing shared by the multi-rank tests and benchmarks that drive `torch.distributed`
without Ray (`run_ranks`)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any, Callable, Iterable, Optional

__all__ = ["run_ranks"]


def _entry(fn: Callable, rank: int, world: int, args: tuple, q, threads: int) -> None:
    if threads:
        import torch
        torch.set_num_threads(threads)
    try:
        q.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, args: tuple = (), *, timeout_s: float,
              expect: Optional[Iterable[int]] = None, stop_on_error: bool = False,
              torch_threads: int = 0) -> tuple[dict[int, Any], dict[int, str]]:
    """`fn(rank, world, *args)` on `world` spawned processes (picklable `fn` and args):
    (rank -> return value, rank -> error text). Waits until every rank of `expect`
    (default all) has reported or `timeout_s` passed; `stop_on_error`: stop waiting at
    the first error (its peers would wait on it until their own deadlines). Ranks that
    never reported get an error entry ("no result ..."); leftovers are killed.
    `torch_threads`: torch.set_num_threads in each rank first (0: leave it)."""
    expect = set(range(world)) if expect is None else set(expect)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, tuple(args), q, torch_threads),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end and not expect <= (results.keys() | errors.keys()):
            try:
                rank, status, val = q.get(timeout=0.2)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
                continue
            (results if status == "ok" else errors)[rank] = val
            if status != "ok" and stop_on_error:
                break
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, end - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in sorted(expect):
        if r not in results and r not in errors:
            errors[r] = f"no result within {timeout_s:.0f} s (exit code {procs[r].exitcode})"
    return results, errors
