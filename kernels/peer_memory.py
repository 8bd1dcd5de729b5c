"""Symmetric memory: buffers every rank of a world allocates under the same name and
size, each rank able to address every peer's copy (ARCHITECTURE §1: NVSHMEM for
dispatch/combine).

Contract of :class:`PeerMemory` (one object per rank): :meth:`alloc` is collective (all
ranks allocate the same names, sizes and dtypes in the same order) and returns this
rank's buffer, zeroed; :meth:`peer_ptrs` gives every rank's address of that buffer as
this rank's kernels must use it, as an int64 tensor [world] on the device. A dead peer's
memory stays mapped (measured with NVSHMEM on 2×H200: stores into it neither fault nor
land anywhere that matters), so kernels that read peers' signals must bound their waits
themselves.

Backends: :class:`LocalWorld` simulates a world inside one process (tests, and one GPU
standing in for several: each rank a stream); :class:`ShmPeers` shares host memory
between the rank processes of one machine (the CPU path, kernels under Triton's
interpreter); ``kernels/gpu/nvshmem_peers.py`` is the one over NVSHMEM on GPUs, and
``kernels/gpu/ipc_peers.py`` the one over CUDA IPC where nvshmem4py is missing.
"""

from __future__ import annotations

import os
import tempfile
import time
from abc import ABC, abstractmethod

import torch

__all__ = ["LocalPeers", "LocalWorld", "PeerMemory", "ShmPeers", "open_peer_memory"]


class PeerMemory(ABC):
    """One rank's view of a world's symmetric buffers."""

    rank: int
    world_size: int
    device: torch.device

    @abstractmethod
    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collective: this rank's zeroed 1-D buffer `name` of `numel` `dtype` elements."""

    @abstractmethod
    def peer_ptrs(self, name: str) -> torch.Tensor:
        """int64 [world] on the device: rank r's buffer `name` as this rank addresses it."""

    def close(self) -> None:
        """Free what this rank allocated (collective where the backend needs it)."""

    @staticmethod
    def _named(table: dict, name: str):
        """`table[name]`, or KeyError saying the buffer was never allocated."""
        found = table.get(name)
        if found is None:
            raise KeyError(f"no buffer {name!r}: alloc it first")
        return found


class LocalWorld:
    """A world of `world_size` ranks in one process; :meth:`rank` is rank r's view.
    The first rank to allocate a name creates every rank's buffer of it."""

    def __init__(self, world_size: int, device: str | torch.device = "cpu") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.device = torch.device(device)
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def rank(self, r: int) -> LocalPeers:
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} outside [0, {self.world_size})")
        return LocalPeers(self, r)

    def _get(self, name: str, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        bufs = self._buffers.get(name)
        if bufs is None:
            bufs = [torch.zeros(numel, dtype=dtype, device=self.device)
                    for _ in range(self.world_size)]
            self._buffers[name] = bufs
        elif bufs[0].numel() != numel or bufs[0].dtype != dtype:
            raise ValueError(f"buffer {name!r} allocated as {bufs[0].numel()} x {bufs[0].dtype}, "
                             f"now asked as {numel} x {dtype}: ranks disagree")
        return bufs


class LocalPeers(PeerMemory):
    """Rank `rank` of a :class:`LocalWorld`."""

    def __init__(self, world: LocalWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.device = world.device

    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.world._get(name, numel, dtype)[self.rank]

    def peer_ptrs(self, name: str) -> torch.Tensor:
        bufs = self.world._buffers.get(name)
        if bufs is None:
            raise KeyError(f"no buffer {name!r}: alloc it first")
        return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=self.device)


class ShmPeers(PeerMemory):
    """Rank `rank` of a world of processes on one machine sharing files in `root`
    (default ``/dev/shm``, else the temp folder): a buffer is a file per rank, ``{root}/phalanx-{tag}-{name}-{rank}``,
    that every rank maps. `tag` names the world (unique per formation: a stale file of
    an earlier world must never be mapped). :meth:`alloc` waits up to `deadline_s` for
    the peers' files (else TimeoutError); with `barrier` (every rank's mappings made,
    within a deadline) each rank then unlinks its file, so a rank killed later leaves
    nothing behind in `root`."""

    def __init__(self, rank: int, world_size: int, tag: str, deadline_s: float = 30.0,
                 root: str | None = None, barrier=None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if not tag or "/" in tag:
            raise ValueError(f"tag must be a non-empty file name part, got {tag!r}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        if root is None:  # memory-backed where the machine has it
            root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._tag, self._deadline_s, self._root = tag, deadline_s, root
        self._maps: dict[str, list[torch.Tensor]] = {}
        self._own: list[str] = []
        self._barrier = barrier

    def _path(self, name: str, rank: int) -> str:
        return os.path.join(self._root, f"phalanx-{self._tag}-{name}-{rank}")

    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if name in self._maps:
            raise ValueError(f"buffer {name!r} already allocated")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        mine = self._path(name, self.rank)
        tmp = f"{mine}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:  # zeroed, then published whole under its name
            f.truncate(nbytes)
            if nbytes:  # held now: a full /dev/shm fails here (OSError), not in a store later
                os.posix_fallocate(f.fileno(), 0, nbytes)
        os.rename(tmp, mine)
        self._own.append(mine)
        end = time.monotonic() + self._deadline_s
        maps = []
        for r in range(self.world_size):
            path = self._path(name, r)
            while not (os.path.exists(path) and os.path.getsize(path) == nbytes):
                if time.monotonic() > end:
                    raise TimeoutError(f"rank {r}'s buffer {name!r} ({nbytes} bytes) did not "
                                       f"appear within {self._deadline_s} s")
                time.sleep(0.005)
            maps.append(torch.from_file(path, shared=True, size=numel, dtype=dtype))
        self._maps[name] = maps
        if self._barrier is not None:
            self._barrier()  # every rank mapped every file: the names can go
            self.close()
        return maps[self.rank]

    def peer_ptrs(self, name: str) -> torch.Tensor:
        return torch.tensor([m.data_ptr() for m in self.views(name)], dtype=torch.int64)

    def views(self, name: str) -> list[torch.Tensor]:
        """Every rank's buffer `name` as this process maps it (host code reads peers'
        copies through these)."""
        return self._named(self._maps, name)

    def close(self) -> None:
        """Remove this rank's files (peers keep their mappings until they drop them)."""
        for path in self._own:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._own.clear()


def open_peer_memory(comm, device: torch.device) -> PeerMemory:
    """The world of `comm` (a :class:`~phalanx.kernels.comm.GroupComm`) as symmetric
    memory on `device`: NVSHMEM on CUDA (CUDA IPC without nvshmem4py), /dev/shm files on
    CPU. Collective; the id
    (NVSHMEM's, or the files' random tag) travels from rank 0 over gloo."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            from .gpu.nvshmem_peers import NvshmemPeers
            import nvshmem.core  # noqa: F401
        except ImportError:  # no nvshmem4py: CUDA IPC maps the peers' buffers instead
            from .gpu.ipc_peers import CudaIpcPeers
            return CudaIpcPeers(comm.rank, comm.world_size, device, comm.broadcast_world,
                                comm.barrier)
        return NvshmemPeers(comm.rank, comm.world_size, device, comm.broadcast_world,
                            comm.barrier)
    nonce = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    comm.broadcast_world(nonce)
    return ShmPeers(comm.rank, comm.world_size, f"{int(nonce):x}", comm.deadline_s,
                    barrier=comm.barrier)
