"""Which :class:`~phalanx.comm.peer_memory.PeerMemory` backend a world gets: the one module
that knows them all (each backend imports only the abstract class, so nothing circles)."""

from __future__ import annotations

import torch

from .peer_memory import PeerMemory
from .shm_peers import ShmPeers

__all__ = ["open_peer_memory"]


def open_peer_memory(comm, device: torch.device) -> PeerMemory:
    """The world of `comm` (a :class:`~phalanx.comm.group_comm.GroupComm`) as symmetric
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
