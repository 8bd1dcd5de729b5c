"""`RankActor`: one GPU (or CPU) rank as a Ray actor, a thin subclass of `RankEngine`.

The actor is threaded (`max_concurrency`): `wait()` blocks one thread for the life of
the loop, so the supervisor learns of the loop's end (or the process's death) from Ray,
while `submit` / `poll` / `stats` run on the others.
"""

from __future__ import annotations

import socket

import ray

from ..engine.rank_engine import RankEngine

MAX_CONCURRENCY = 8


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankActor(RankEngine):
    """What Ray runs for each rank; everything but the rendezvous helpers is `RankEngine`."""

    def rendezvous_address(self) -> str:
        """A fresh `tcp://ip:port` on this rank's node, for rank 0 of a new epoch."""
        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port(ip)}"

    def ping(self) -> int:
        return self.spec.rank


RemoteRank = ray.remote(RankActor)
