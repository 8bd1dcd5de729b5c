"""What every spawned process of `bench/kv_transfer.py` shares: its environment (UCX
variables, one torch thread, on cuda its GPU and the NCCL group), its KV pools and raw
buffers, commands from the parent, CPU time, optional profiling, the start instant."""

from __future__ import annotations

import asyncio
import os
import resource
import time

import numpy as np
import torch

import kv_transfer_gpu as gpu
from kv_transfer_request import HEAD_DIM, LAYERS, PAGE


def make_pools(num_pages: int, heads: int, fill: bool, dev: torch.device):
    shape = (num_pages, heads, PAGE, HEAD_DIM)

    def make() -> torch.Tensor:
        if dev.type == "cuda":  # bf16 as in the engine
            return (torch.randn if fill else torch.zeros)(shape, dtype=torch.bfloat16,
                                                          device=dev)
        if fill:
            return torch.randint(-30000, 30000, shape, dtype=torch.int16)
        return torch.zeros(shape, dtype=torch.int16)

    pools = [(make(), make()) for _ in range(LAYERS)]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return pools


def make_buf(nbytes: int, dev: torch.device):
    """A raw-mode byte buffer: numpy on CPU, a device tensor on CUDA (ucxx takes both)."""
    if dev.type == "cpu":
        return np.ones(nbytes, dtype=np.uint8)
    buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    return buf


def set_env(args: dict, gpu_index: int) -> torch.device:
    """Environment of a spawned process; on cuda binds it to cuda:gpu_index (before ucxx
    starts and before anything is allocated)."""
    os.environ.update({"UCX_TLS": args["tls"], "UCX_SOCKADDR_TLS_PRIORITY": "tcp",
                       "UCX_WARN_UNUSED_ENV_VARS": "n", **args["ucx_env"]})
    torch.set_num_threads(1)
    if args["device"] != "cuda":
        return torch.device("cpu")
    dev = gpu.bind(gpu_index)
    if args["nccl"]:
        gpu.nccl_init(gpu_index, args["p"] + 1, args["nccl_port"], dev)
    return dev


async def recv_cmd(pipe):
    return await asyncio.get_running_loop().run_in_executor(None, pipe.recv)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def profiled(args, role: str, fn) -> None:
    """Run `fn`; with --profile, under cProfile, top functions to $OUT/profile_<role>.txt."""
    if not args.get("profile"):
        return fn()
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        path = os.path.join(os.environ.get("OUT", "."), f"profile_{role}.txt")
        with open(path, "w") as f:
            f.write(out.getvalue())


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(t - time.monotonic(), 0))
