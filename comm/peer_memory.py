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

Backends: :class:`LocalWorld` (here) simulates a world inside one process (tests, and one
GPU standing in for several: each rank a stream); ``comm/shm_peers.py`` shares host memory
between the rank processes of one machine (the CPU path, kernels under Triton's
interpreter); ``comm/gpu/nvshmem_peers.py`` is the one over NVSHMEM on GPUs, and
``comm/gpu/ipc_peers.py`` the one over CUDA IPC where nvshmem4py is missing.
``comm/peer_backends.py`` picks one for a world; this module imports none of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["LocalPeers", "LocalWorld", "PeerMemory"]


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
