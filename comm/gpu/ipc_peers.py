"""Symmetric memory over CUDA IPC: the backend of
:class:`~phalanx.comm.peer_memory.PeerMemory` for rank processes that share one GPU
(where NVSHMEM's several-processes-per-GPU mode does not deliver peers' stores: measured
on one H200 without MPS, its waits missed their deadline) or see their peers' GPUs.

Each buffer is its own `cudaMalloc` allocation (IPC handles name whole allocations, so
never a slice of torch's caching allocator); its 64-byte handle travels to every rank
over `broadcast` (e.g. ``GroupComm.broadcast_world`` over gloo, never pickled), and each
rank opens its peers' handles. Layout of what travels: uint8 [world, 64], row r rank r's
handle, gathered by one broadcast per rank.

A peer that dies frees its allocations with its context: a later store into its mapping
may fault, which ends the survivor's step with a CUDA error (fatal: the supervisor
re-forms the group, as for any fatal rank error).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..peer_memory import PeerMemory

__all__ = ["CudaIpcPeers"]

_HANDLE_BYTES = 64


def _runtime():
    try:
        from cuda.bindings import runtime
    except ImportError:  # cuda-python before 12.6
        from cuda import cudart as runtime
    return runtime


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime error {err!r}")
    return rest[0] if len(rest) == 1 else rest


class _DeviceArray:
    """`nbytes` of device memory at `ptr` as a CUDA array (interface v2, uint8)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 2}


class CudaIpcPeers(PeerMemory):
    """Rank `rank` of a world of `world_size` processes on one host.

    broadcast(t, src): overwrites the CPU tensor `t` in place with rank `src`'s copy.
    barrier(): returns once every rank reached it, within a deadline; after each
    allocation (every copy zeroed before any peer may store into it) and before any rank
    frees (no store lands in freed memory)."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 broadcast: Callable[..., object], barrier: Callable[[], None]) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._rt = _runtime()
        self._broadcast, self._barrier = broadcast, barrier
        self._own: dict[str, int] = {}  # name -> this rank's allocation
        self._opened: list[int] = []  # peers' mappings, closed by close()
        self._tensors: dict[str, torch.Tensor] = {}
        self._ptrs: dict[str, torch.Tensor] = {}

    def alloc(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if name in self._tensors:
            raise ValueError(f"buffer {name!r} already allocated")
        rt = self._rt
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        with torch.cuda.device(self.device):
            ptr = _check(rt.cudaMalloc(max(nbytes, 1)))
            self._own[name] = int(ptr)
            t = torch.as_tensor(_DeviceArray(int(ptr), nbytes), device=self.device)
            t = t.view(dtype)
            t.zero_()
            torch.cuda.synchronize(self.device)
            handle = _check(rt.cudaIpcGetMemHandle(int(ptr)))
        handles = torch.zeros(self.world_size, _HANDLE_BYTES, dtype=torch.uint8)
        handles[self.rank] = torch.frombuffer(bytearray(bytes(handle.reserved)), dtype=torch.uint8)
        for src in range(self.world_size):
            row = handles[src].clone()
            self._broadcast(row, src)
            handles[src] = row
        ptrs = []
        with torch.cuda.device(self.device):
            for r in range(self.world_size):
                if r == self.rank:
                    ptrs.append(int(ptr))
                    continue
                h = rt.cudaIpcMemHandle_t()
                h.reserved = bytes(handles[r].tolist())
                try:
                    peer = int(_check(rt.cudaIpcOpenMemHandle(
                        h, rt.cudaIpcMemLazyEnablePeerAccess)))
                except RuntimeError as e:
                    raise RuntimeError(f"rank {self.rank} cannot map rank {r}'s buffer "
                                       f"{name!r}: {e}") from e
                self._opened.append(peer)
                ptrs.append(peer)
        self._barrier()  # every copy zeroed and mapped before any store
        self._tensors[name] = t
        self._ptrs[name] = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        return t

    def peer_ptrs(self, name: str) -> torch.Tensor:
        return self._named(self._ptrs, name)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (collective: a barrier first)."""
        if not self._own and not self._opened:
            return
        torch.cuda.synchronize(self.device)
        self._barrier()
        rt = self._rt
        with torch.cuda.device(self.device):
            for p in self._opened:
                rt.cudaIpcCloseMemHandle(p)
            self._tensors.clear()
            self._ptrs.clear()
            for p in self._own.values():
                rt.cudaFree(p)
        self._opened.clear()
        self._own.clear()
