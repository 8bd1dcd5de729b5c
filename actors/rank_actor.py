"""`RankActor`: one GPU (or CPU) rank as a Ray actor, a thin subclass of `RankEngine`.

The actor is threaded (`max_concurrency`): `wait()` blocks one thread for the life of
the loop, so the supervisor learns of the loop's end (or the process's death) from Ray,
while `submit` / `poll` / `stats` run on the others.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Optional

import ray

from ..engine.rank_engine import RankEngine

MAX_CONCURRENCY = 8


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def device_index(assigned: Sequence, visible: Optional[str], count: int) -> Optional[int]:
    """This process's CUDA index of the GPU Ray assigned it (`assigned`: its GPU ids),
    where every GPU of the node stays visible (`visible`: the process's
    CUDA_VISIBLE_DEVICES, ids as the node lists them, or None: all `count`). None when
    Ray assigned no GPU. A node that declares more GPUs than it has (tests sharing one
    GPU) wraps around."""
    if not assigned:
        return None
    gpu = str(assigned[0])
    if visible:
        listed = [v.strip() for v in visible.split(",")]
        if gpu in listed:
            return listed.index(gpu)
    return int(float(gpu)) % max(1, count)


class RankActor(RankEngine):
    """What Ray runs for each rank; everything but the rendezvous and device helpers is
    `RankEngine`."""

    def gpu_index(self) -> Optional[int]:
        """The GPU Ray assigned this rank, as an index among the visible ones (the
        supervisor keeps every GPU of the node visible: peers map each other's memory)."""
        import torch
        return device_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                            torch.cuda.device_count())

    def rendezvous_address(self) -> str:
        """A fresh `tcp://ip:port` on this rank's node, for rank 0 of a new epoch."""
        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port(ip)}"

    def ping(self) -> int:
        return self.spec.rank


RemoteRank = ray.remote(RankActor)
