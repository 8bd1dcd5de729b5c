"""Symmetric memory over NVSHMEM (nvshmem4py): the GPU backend of
:class:`~phalanx.comm.peer_memory.PeerMemory`.

One NVSHMEM world per process and formation: rank 0 makes the unique id, the caller
carries its bytes to the others (``broadcast``: e.g. ``GroupComm.broadcast_world`` over
gloo), every rank joins with it. Buffers come from the symmetric heap
(``alloc`` is collective, as ``nvshmem_malloc``); a peer's copy is addressed through
``get_peer_tensor`` (NVLink peers on one host). Multicast stays off
(``NVSHMEM_DISABLE_NVLS=1`` on the GPU machine).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..peer_memory import PeerMemory

__all__ = ["NvshmemPeers"]


class NvshmemPeers(PeerMemory):
    """Rank `rank` of an NVSHMEM world of `world_size` processes, one GPU each.

    broadcast(t): overwrites the CPU int8 tensor `t` in place with rank 0's copy (rank
    0's holds its NVSHMEM id; e.g. `GroupComm.broadcast_world`). barrier(): returns once every
    rank reached it, within a deadline (not NVSHMEM's own barrier, which would wait
    for a dead peer forever); after each allocation, so no peer stores into a buffer
    before its owner zeroed it.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 broadcast: Callable[[torch.Tensor], object],
                 barrier: Callable[[], None]) -> None:
        import nvshmem.core as nvshmem
        try:
            from cuda.core import Device
        except ImportError:  # cuda-core before 0.4
            from cuda.core.experimental import Device
        self._nv = nvshmem
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        dev = Device(self.device.index if self.device.index is not None else torch.cuda.current_device())
        dev.set_current()
        uid = nvshmem.get_unique_id(empty=rank != 0)
        raw = uid._data.view(np.int8)
        shared = torch.from_numpy(raw.copy())
        broadcast(shared)
        raw[:] = shared.numpy()
        nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
        self._barrier = barrier
        self._tensors: dict[str, torch.Tensor] = {}
        self._ptrs: dict[str, torch.Tensor] = {}

    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if name in self._tensors:
            raise ValueError(f"buffer {name!r} already allocated")
        t = self._nv.interop.torch.tensor((numel,), dtype=dtype)
        t.zero_()
        torch.cuda.synchronize(self.device)
        self._barrier()  # every copy zeroed before any peer may store into it
        self._tensors[name] = t
        ptrs = [t.data_ptr() if pe == self.rank else self._peer_ptr(t, pe)
                for pe in range(self.world_size)]
        self._ptrs[name] = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        return t

    def _peer_ptr(self, t: torch.Tensor, pe: int) -> int:
        """Where this rank's kernels reach rank `pe`'s copy of `t` (load/store over
        NVLink); RuntimeError where NVSHMEM has no such mapping (nvshmem_ptr is NULL:
        the peer is not P2P-reachable from this process)."""
        try:
            ptr = self._nv.interop.torch.get_peer_tensor(t, pe).data_ptr()
        except Exception as e:  # NvshmemError / NvshmemInvalid
            raise RuntimeError(f"rank {self.rank} cannot map rank {pe}'s symmetric memory: "
                               f"{e}") from e
        if not ptr:
            raise RuntimeError(f"rank {self.rank} cannot map rank {pe}'s symmetric memory "
                               "(no P2P path: the peer exchange needs NVLink peers)")
        return ptr

    def peer_ptrs(self, name: str) -> torch.Tensor:
        return self._named(self._ptrs, name)

    def close(self) -> None:
        """Free every buffer and leave the NVSHMEM world (collective)."""
        torch.cuda.synchronize(self.device)
        for t in self._tensors.values():
            self._nv.interop.torch.free_tensor(t)
        self._tensors.clear()
        self._ptrs.clear()
        self._nv.finalize()
