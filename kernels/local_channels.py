"""`LocalChannels`: the shared-memory fast paths of a `GroupComm` whose ranks all run on
one machine: the world's per-step agreement (`ShmAgreement`) and the TP leader's step
plans (`ShmBroadcast`), each in microseconds where gloo takes ~0.1-1.5 ms. Whether a path
is used is decided together at init (gloo): ranks on several machines, or processes of
one machine that cannot map each other's files, keep gloo on every rank.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .peer_memory import ShmPeers
from .shm_agreement import ShmAgreement
from .shm_broadcast import ShmBroadcast

__all__ = ["LocalChannels"]

_R = TypeVar("_R")
# How long a rank waits for its peers' shared-memory files (seconds).
SHM_OPEN_S = 10.0


class LocalChannels:
    """Mixed into `GroupComm` (uses its `_run`, `_guarded`, broadcasts and groups)."""

    one_machine: bool
    _agreement: ShmAgreement | None
    _tp_channel: ShmBroadcast | None

    def _open_agreement(self) -> ShmAgreement | None:
        """Shared-memory agreement when every rank of the world runs on this machine
        (same boot id and host name, gathered over gloo) and every rank could map every
        rank's file (decided together: a machine whose processes do not share
        /dev/shm keeps gloo on every rank), else None."""
        if self.world_size == 1:
            return None
        if self._distinct_ids(_machine_id()) > 1:
            return None
        self.one_machine = True
        nonce = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        self.broadcast_world(nonce)
        return self._shm_together(
            ShmPeers(self.rank, self.world_size, f"{int(nonce):x}",
                     min(self.deadline_s, SHM_OPEN_S)),
            lambda peers: ShmAgreement(peers, self.deadline_s), None)

    def _distinct_ids(self, raw: bytes) -> int:
        """How many distinct 16-byte ids the world's ranks hold (each passes its own;
        gathered over gloo, so every rank gets the same answer)."""
        mine = torch.frombuffer(bytearray(raw), dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run("init", dist.all_gather, parts, mine)
        return len({tuple(p.tolist()) for p in parts})

    def _shm_together(self, peers: ShmPeers, make: Callable[[ShmPeers], _R],
                      group: Any) -> _R | None:
        """`make(peers)` on every rank of `group` (None: the world), or None on every
        rank when one of them could not map every rank's files (decided over gloo);
        the files are unlinked after (every rank has mapped them, or gave up)."""
        try:
            made = make(peers)
        except (OSError, TimeoutError):
            made = None
        failed = torch.tensor([int(made is None)], dtype=torch.int64)
        self._run("init", dist.all_reduce, failed, op=dist.ReduceOp.MAX, group=group)
        peers.close()
        return made if not int(failed[0]) else None

    def open_tp_channel(self, capacity: int) -> bool:
        """Collective over the TP group: a shared-memory channel for its leader's step
        plans (`ShmBroadcast`, up to `capacity` words) when the world runs on one
        machine; whether it is open (else plans keep going over gloo)."""
        if self.tp_size == 1 or not self.one_machine:
            return False
        nonce = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        self.broadcast_tp(nonce)
        self._tp_channel = self._shm_together(
            ShmPeers(self.tp_rank, self.tp_size, f"{int(nonce):x}tp",
                     min(self.deadline_s, SHM_OPEN_S)),
            lambda peers: ShmBroadcast(peers, capacity, self.deadline_s), self._tp_group)
        return self._tp_channel is not None

    def share_tp(self, words: np.ndarray | None) -> np.ndarray | None:
        """Over the TP channel: the leader passes its plan words (True-ish return: the
        words it sent; None: they did not fit and must go over gloo), every other rank
        gets them (None: they go over gloo this round)."""
        channel = self._tp_channel
        if self.tp_rank == 0:
            return self._guarded("share_tp", lambda: words if channel.publish(words) else None)
        return self._guarded("share_tp", channel.receive)


def _machine_id() -> bytes:
    """16 bytes naming this machine (boot id and host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.blake2b(f"{boot}/{socket.gethostname()}".encode(), digest_size=16).digest()
