"""Symmetric memory between the rank processes of one machine: each buffer a shared file
per rank that every rank maps (the CPU path of :class:`~phalanx.comm.peer_memory.PeerMemory`)."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from .peer_memory import PeerMemory

__all__ = ["ShmPeers"]


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
