"""The rank actors: what Ray runs for each rank, each a thin wrapper of a
:class:`~phalanx.actors.rank.rank.Rank` with its role (colocated, prefill, decode).

An actor is threaded (`max_concurrency`): `wait()` blocks one thread for the life of
the loop, so the supervisor learns of the loop's end (or the process's death) from Ray,
while `submit` / `poll` / `stats` run on the others. The class names are what the
chaos tools look for in Ray's actor table (`chaos.ranks.RANK_CLASSES`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

import ray

from ..comm.rendezvous import held_address
from .rank.decode_role import DecodeRole
from .rank.prefill_role import PrefillRole
from .rank.rank import Rank
from .rank.role import RankRole

__all__ = ["DecodeRank", "PrefillRank", "RankActor", "RemoteDecodeRank", "RemotePrefillRank",
           "RemoteRank", "device_index"]

MAX_CONCURRENCY = 8


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


class RankActor:
    """A colocated rank (one of a TP or DP×EP group); the base of the role actors, which
    add only their role's remote methods."""

    def __init__(self, spec=None) -> None:
        self.role = self.make_role()
        self.rank = Rank(spec, self.role, gpu_index=self.gpu_index)

    def make_role(self) -> RankRole:
        return RankRole()

    @property
    def spec(self):
        return self.rank.spec

    def configure(self, spec) -> None:
        self.rank.configure(spec)

    def start(self) -> dict:
        return self.rank.start()

    def stop(self) -> None:
        self.rank.stop()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[str]:
        return self.rank.wait(timeout_s)

    def submit(self, request_id: str, prompt_token_ids, params) -> None:
        self.rank.submit(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        self.rank.abort(request_id)

    def poll(self, timeout_s: float = 0.1) -> list:
        return self.rank.poll(timeout_s)

    def arm_fault(self, point: str, after: int = 0, stall_s: float = 0.0,
                  drop: bool = False) -> None:
        self.rank.arm_fault(point, after, stall_s, drop)

    def stats(self) -> dict:
        return self.rank.stats()

    def kv_check(self) -> dict:
        return self.rank.kv_check()

    def held_prefix_changes(self, since: int) -> dict:
        return self.rank.held_prefix_changes(since)

    def expert_costs(self, reps: int) -> tuple:
        return self.rank.expert_costs(reps)

    def gpu_index(self) -> Optional[int]:
        """The GPU Ray assigned this rank, as an index among the visible ones (the
        supervisor keeps every GPU of the node visible: peers map each other's memory)."""
        import torch
        return device_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                            torch.cuda.device_count())

    def rendezvous_address(self) -> str:
        """A fresh `tcp://ip:port` on this rank's node, for rank 0 of a new epoch (this
        actor): its store is bound now and kept until this rank joins the group."""
        return held_address(ray.util.get_node_ip_address())

    def ping(self) -> int:
        return self.rank.spec.rank


class PrefillRank(RankActor):
    """A rank of a prefill instance (`PrefillRole`)."""

    def make_role(self) -> PrefillRole:
        return PrefillRole()

    def expect(self, key: int, dest) -> None:
        self.role.expect(key, dest)

    def submit_prefill(self, request_id: str, prompt_token_ids: list[int], params, key: int) -> None:
        self.role.submit_prefill(request_id, prompt_token_ids, params, key)

    def forget(self, key: int) -> None:
        self.role.forget(key)

    def release(self, request_id: str) -> None:
        self.role.release(request_id)

    def poll_events(self, timeout_s: float = 0.1) -> tuple[list, list]:
        """(step outputs, transfer events) since the last call; waits up to `timeout_s`."""
        return self.rank.mailbox.poll_events(timeout_s)


class DecodeRank(RankActor):
    """A rank of the decode group of a disaggregated layout (`DecodeRole`)."""

    def make_role(self) -> DecodeRole:
        return DecodeRole(host=ray.util.get_node_ip_address())

    def open_gate(self, transfer_id: str) -> None:
        self.role.open_gate(transfer_id)

    def close_gate(self, transfer_id: str) -> None:
        self.role.close_gate(transfer_id)

    def reserve_many(self, items: list) -> list:
        return self.role.reserve_many(items)

    def unreserve(self, request_id: str) -> None:
        self.role.unreserve(request_id)

    def admit_many(self, items: list) -> None:
        self.role.admit_many(items)

    def kv_stats(self) -> dict:
        return self.role.kv_stats()


RemoteRank = ray.remote(RankActor)
RemotePrefillRank = ray.remote(PrefillRank)
RemoteDecodeRank = ray.remote(DecodeRank)
