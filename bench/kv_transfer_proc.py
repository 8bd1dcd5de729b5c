"""What every spawned process of `bench/kv_transfer.py` shares: its environment (UCX
variables, one torch thread, on cuda its GPU and the NCCL group), its KV pools and raw
buffers, commands from the parent, CPU time, optional profiling, the start instant, the
digest of a request's slots (the check that what landed is what was sent), and the raw
baselines' wire constants."""

from __future__ import annotations

import asyncio
import hashlib
import os
import resource
import sys
import time

import numpy as np
import torch

import kv_transfer_gpu as gpu
from kv_transfer_request import HEAD_DIM, LAYERS, PAGE

EARLY, TAG_EARLY = 1, 7  # raw_spans_early: its header's size field; its spans' tag


def make_pools(num_pages: int, heads: int, fill: bool, dev: torch.device):
    """Per-layer (K, V) pools as the engine allocates them: views of one tensor
    `[layers, 2, pages, heads, page, head_dim]`."""
    shape = (LAYERS, 2, num_pages, heads, PAGE, HEAD_DIM)
    if dev.type == "cuda":  # bf16 as in the engine
        buf = (torch.randn if fill else torch.zeros)(shape, dtype=torch.bfloat16, device=dev)
    elif fill:
        buf = torch.randint(-30000, 30000, shape, dtype=torch.int16)
    else:
        buf = torch.zeros(shape, dtype=torch.int16)
    pools = [(buf[i, 0], buf[i, 1]) for i in range(LAYERS)]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return pools


def digest(pools, tables: list, side: str) -> str:
    """Hash of the slots `tables` name on `side`, in payload order (block by block): equal
    on both sides exactly when every slot landed with its value."""
    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.transport.staging import KVPools
    view, h = KVPools(pools), hashlib.blake2b(digest_size=16)
    for table in tables:
        for template, blocks in m.templates_of(table):
            tmpl = view.template(template, side)
            for block in blocks:
                out = torch.empty(tmpl.nbytes(block[None]), dtype=torch.uint8, device=view.device)
                view.gather(tmpl, block[None], out)
                view.sync()
                h.update(out.cpu().numpy())
    return h.hexdigest()


def pool_spans(pools, table, side: str) -> list:
    """The regions (uint8 views of the pools, as ucxx takes them) of the blocks of `table`
    that are spans of `side`'s pools, in payload order."""
    from phalanx.kv_transfer.planning import messages as m
    from phalanx.kv_transfer.transport.staging import KVPools
    from phalanx.kv_transfer.transport.ucx_runtime import ucx_buffer
    view, out = KVPools(pools), []
    for template, blocks in m.templates_of(table):
        tmpl = view.template(template, side)
        for layer, kind, r0, r1 in blocks.tolist():
            span = tmpl.spans.span(r0, r1)
            if span is not None:
                out.append(ucx_buffer(view.region(layer, kind, span)))
    return out


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
    if args.get("switch_interval"):
        sys.setswitchinterval(args["switch_interval"])
    if args.get("payload_only"):
        skip_staging_copies()
    if args.get("trace"):
        import kv_transfer_trace
        kv_transfer_trace.install()
    if args["device"] != "cuda":
        return torch.device("cpu")
    dev = gpu.bind(0 if args.get("one_gpu") else gpu_index)
    if args["nccl"]:
        gpu.nccl_init(gpu_index, args["p"] + 1, args["nccl_port"], dev)
    return dev


def skip_staging_copies() -> None:
    """`--payload-only`: the transport's gather and scatter move no bytes (the scatter
    still reports the slots it would land), so `pipelined` times the wire, the control
    messages and the acks alone."""
    from phalanx.kv_transfer.transport import staging 

    def scatter(self, tmpl, blocks, payload):
        landed: dict[int, int] = {}
        for layer, _, r0, r1 in blocks.tolist():
            landed[layer] = landed.get(layer, 0) + int(tmpl.slots_cum[r1] - tmpl.slots_cum[r0])
        return landed, None

    staging.KVPools.gather = lambda self, tmpl, blocks, out, ready=(): None
    staging.KVPools.scatter = scatter


async def recv_cmd(pipe):
    return await asyncio.get_running_loop().run_in_executor(None, pipe.recv)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def profiled(args, role: str, fn) -> None:
    """Run `fn`; with --profile, under cProfile, top functions to $OUT/profile_<role>.txt;
    with --trace, the process's timeline to $OUT/trace_<role>.json."""
    if args.get("trace"):
        import kv_transfer_trace
        try:
            return _profiled(args, role, fn)
        finally:
            kv_transfer_trace.dump(role)
    return _profiled(args, role, fn)


def _profiled(args, role: str, fn) -> None:
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


async def sleep_until(t: float, spin_s: float = 0.0) -> None:
    """Sleep until `t`; the last `spin_s` seconds spin (the loop and the core stay awake,
    as in a busy prefill process, instead of waking from idle at the start)."""
    await asyncio.sleep(max(t - spin_s - time.monotonic(), 0))
    while time.monotonic() < t:
        pass
