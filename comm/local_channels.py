"""`LocalChannels`: the shared-memory fast paths of a `GroupComm` whose ranks all run on
one machine: the world's per-step agreement (`ShmAgreement`), the TP leader's step
plans (`ShmBroadcast`), and the CPU tensors' TP sums and gathers and world all-to-alls
(`ShmCollectives`), each in microseconds where gloo takes ~0.1-1.5 ms. Whether a path
is used is decided together when it is opened (gloo): ranks on several machines, or
processes of one machine that cannot map each other's files, keep gloo on every rank.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .shm_peers import ShmPeers
from .shm_agreement import ShmAgreement
from .shm_broadcast import ShmBroadcast
from .shm_collectives import ShmCollectives

__all__ = ["LocalChannels"]

_R = TypeVar("_R")
# How long a rank waits for its peers' shared-memory files (seconds).
SHM_OPEN_S = 10.0


class LocalChannels:
    """Mixed into `GroupComm` (uses its `_run`, `_guarded`, broadcasts and groups)."""

    one_machine: bool
    _agreement: ShmAgreement | None
    _tp_channel: ShmBroadcast | None
    _tp_tensors: ShmCollectives | None
    _world_tensors: ShmCollectives | None

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
        return self._open_shared("", lambda peers: ShmAgreement(peers, self.deadline_s),
                                 tp=False)

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
        self._tp_channel = self._open_shared(
            "tp", lambda peers: ShmBroadcast(peers, capacity, self.deadline_s), tp=True)
        return self._tp_channel is not None

    def _open_shared(self, name: str, make: Callable[[ShmPeers], _R], tp: bool) -> _R | None:
        """`make(peers)` over fresh shared files of this TP group (`tp`) or of the world,
        named by a nonce its first rank broadcasts (`_shm_together`)."""
        nonce = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        (self.broadcast_tp if tp else self.broadcast_world)(nonce)
        rank, size = (self.tp_rank, self.tp_size) if tp else (self.rank, self.world_size)
        return self._shm_together(ShmPeers(rank, size, f"{int(nonce):x}{name}",
                                           min(self.deadline_s, SHM_OPEN_S)),
                                  make, self._tp_group if tp else None)

    def open_tensor_channels(self, tp_bytes: int, world_bytes: int) -> None:
        """Collective over the world: shared-memory channels for CPU tensors when the
        world runs on one machine: the TP group's sums and gathers of up to `tp_bytes`
        per rank (tp > 1), the world's all-to-alls of up to `world_bytes` per rank
        (dp > 1). Larger tensors, and CUDA ones, keep their backend."""
        if not self.one_machine:
            return
        if self.tp_size > 1 and tp_bytes >= 4:
            self._tp_tensors = self._open_shared(
                "tpt", lambda peers: ShmCollectives(peers, tp_bytes, self.deadline_s), tp=True)
        if self.dp_size > 1 and world_bytes >= 4:
            self._world_tensors = self._open_shared(
                "wt", lambda peers: ShmCollectives(peers, world_bytes, self.deadline_s), tp=False)

    def _local_sum_tp(self, t: torch.Tensor) -> bool:
        """`t` summed over the TP group through shared memory (False: not this way)."""
        channel = self._tp_tensors
        return (channel is not None and not t.is_cuda
                and self._guarded("all_reduce_tp", lambda: channel.all_reduce_sum(t)))

    def _local_gather_tp(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        channel = self._tp_tensors
        if channel is None or t.is_cuda:
            return None
        return self._guarded("all_gather_tp", lambda: channel.all_gather(t))

    def _local_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes, input_split_sizes) -> bool:
        channel = self._world_tensors
        return (channel is not None and not input.is_cuda and not output.is_cuda
                and self._guarded("all_to_all_single", lambda: channel.all_to_all(
                    output, input, output_split_sizes, input_split_sizes)))

    def wake_peers(self) -> None:
        """Tell every rank of the world (of one machine) that this one has work."""
        if self._agreement is not None:
            self._agreement.wake()

    def wake_count(self) -> int | None:
        """Changes whenever some rank called `wake_peers`; None when the ranks cannot
        tell each other (several machines)."""
        return self._agreement.wakes() if self._agreement is not None else None

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
