"""`ShmBroadcast`: rank `root`'s vector of small ints to every rank of one machine's group,
through shared memory (a TP group's step plan), in microseconds where two gloo
broadcasts take ~0.3-1.5 ms; bounded by a deadline, a dead rank noticed at once.

Layout: the root's `ShmPeers` buffer holds int64 ``[1 + capacity]``: word 0 is
``tag << 32 | n`` (n values follow; ``n = 2**32 - 1``: this round's values went another
way), words 1..n are ``tag << 32 | value``, tag the round number mod 2**31. A reader
takes a word only when its tag is the round's (an aligned 8-byte store is seen whole, so
no ordering between words is needed). After reading, every rank passes a
`ShmAgreement` (a barrier), so the root never overwrites a round someone still reads.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .shm_peers import ShmPeers
from .shm_agreement import ShmAgreement, spin_until

__all__ = ["ShmBroadcast"]

_TAG_MOD = 1 << 31
_LOW = (1 << 32) - 1
ELSEWHERE = _LOW  # word 0's count when the round's values did not fit


class ShmBroadcast:
    """Collective: the root calls :meth:`publish`, every other rank :meth:`receive`, in
    the same rounds; values must lie in [0, 2**32), at most `capacity` of them, else the
    round's values go another way (publish returns False, receive None) and the caller
    sends them over another channel."""

    def __init__(self, peers: ShmPeers, capacity: int, deadline_s: float, root: int = 0,
                 name: str = "broadcast") -> None:
        import torch
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.rank, self.root, self.capacity = peers.rank, root, capacity
        self.deadline_s = deadline_s
        peers.alloc(name, 1 + capacity, torch.int64)
        self._words = peers.views(name)[root].numpy()
        self._barrier = ShmAgreement(peers, deadline_s, name=f"{name}.barrier")
        self._peers = peers  # owns the mappings the views read
        self._round = 0

    def publish(self, values: np.ndarray) -> bool:
        """Root: this round's `values` (int64); False when they did not fit (sent as
        'elsewhere': the caller sends them another way)."""
        if self.rank != self.root:
            raise RuntimeError(f"rank {self.rank} is not the root ({self.root})")
        self._round += 1
        tag = (self._round % _TAG_MOD) << 32
        n = len(values)
        fits = n <= self.capacity and (n == 0 or (int(values.min()) >= 0
                                                   and int(values.max()) <= _LOW - 1))
        if fits:
            self._words[1:1 + n] = values.astype(np.int64, copy=False) | tag
        self._words[0] = tag | (n if fits else ELSEWHERE)
        self._barrier.max([0])  # every rank has read this round
        return fits

    def receive(self) -> Optional[np.ndarray]:
        """A non-root rank: this round's values, or None when they went another way."""
        if self.rank == self.root:
            raise RuntimeError("the root publishes")
        self._round += 1
        want = self._round % _TAG_MOD
        what = f"broadcast {self._round} from rank {self.root}"
        root_pid = self._barrier.pid(self.root)
        spin_until(lambda: (int(self._words[0]) >> 32) == want, self.deadline_s, root_pid, what)
        n = int(self._words[0]) & _LOW
        out = None
        if n != ELSEWHERE:
            box = []

            def landed() -> bool:
                words = self._words[1:1 + n].copy()
                if np.all((words >> 32) == want):
                    box.append(words & _LOW)
                    return True
                return False

            spin_until(landed, self.deadline_s, root_pid, what)
            out = box[0]
        self._barrier.max([0])
        return out
