"""CUDA side of `bench/kv_transfer.py` (`--device cuda`): which layouts fit this machine,
binding each spawned process to its GPU, the NCCL send/recv baseline, GPU metadata.

Placement: layout `P-D` runs sender rank r on cuda:r and the receiver on cuda:P, so it
needs P + 1 GPUs. The NCCL baseline joins the P senders (group ranks 0..P-1) and the
receiver (group rank P) in one process group; each sender sends its share of the bytes
as one buffer and waits for a 1-element reply sent once the receiver has every share,
the same pattern as the ucxx `raw` mode. Multicast / NVLS stays off (GPU machine rule).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def fitting_senders(layouts: list[int], one_gpu: bool = False) -> list[int]:
    """The sender counts P of `layouts` that fit the visible GPUs (P + 1 each, or all on
    one); says which are skipped, and exits with a message when CUDA is missing or none
    fits."""
    if not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: no CUDA device visible (torch "
                         f"{torch.__version__}, built for CUDA {torch.version.cuda}); run "
                         f"it on the GPU machine, or use --device cpu")
    n = torch.cuda.device_count()
    fit = [p for p in layouts if p + 1 <= n or (one_gpu and n)]
    for p in layouts:
        if p not in fit:
            print(f"skipping layout {p}-1: it needs {p + 1} GPUs ({p} sender(s) on "
                  f"cuda:0..cuda:{p - 1}, the receiver on cuda:{p}); this machine has {n}",
                  flush=True)
    if not fit:
        hint = f"at most --layouts {n - 1}-1" if n > 1 else "a layout needs 2 GPUs at least"
        raise SystemExit(f"--device cuda: no requested layout fits {n} GPU(s); layout P-1 "
                         f"needs P + 1 GPUs ({hint})")
    return fit


def bind(index: int) -> torch.device:
    """Bind this process to cuda:index and create its CUDA context, before ucxx.init (UCX
    picks up the context current when it starts) and before any allocation."""
    os.environ.update(NO_MULTICAST)
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    torch.cuda.synchronize(dev)
    return dev


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_init(rank: int, world: int, port: int, dev: torch.device) -> None:
    """Join the benchmark's NCCL group (blocks until all `world` processes join); one
    all-reduce creates the communicator before any point-to-point call."""
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev, timeout=timedelta(seconds=120))
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize(dev)


def _p2p(ops: list) -> None:
    import torch.distributed as dist
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def nccl_send(buf: torch.Tensor, receiver: int) -> None:
    """Sender: `buf` to the receiver, then wait until its reply arrives."""
    import torch.distributed as dist
    reply = torch.zeros(1, dtype=torch.uint8, device=buf.device)
    _p2p([dist.P2POp(dist.isend, buf, receiver)])
    _p2p([dist.P2POp(dist.irecv, reply, receiver)])
    torch.cuda.synchronize(buf.device)


def nccl_recv(bufs: list[torch.Tensor]) -> None:
    """Receiver: bufs[r] from sender r, all at once; then one reply to every sender."""
    import torch.distributed as dist
    _p2p([dist.P2POp(dist.irecv, b, r) for r, b in enumerate(bufs)])
    torch.cuda.synchronize(bufs[0].device)
    one = torch.ones(1, dtype=torch.uint8, device=bufs[0].device)
    _p2p([dist.P2POp(dist.isend, one, r) for r in range(len(bufs))])
    torch.cuda.synchronize(bufs[0].device)


def nccl_close() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _version(v) -> str:
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def meta() -> dict:
    """GPU names and versions for the JSON (initialises CUDA in the caller)."""
    n = torch.cuda.device_count()
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(n)],
            "cuda": torch.version.cuda,
            "nccl": _version(torch.cuda.nccl.version()),
            "placement": "sender rank r on cuda:r, receiver on cuda:P (layout P-1)"}
