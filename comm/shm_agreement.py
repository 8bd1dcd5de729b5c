"""`ShmAgreement`: the element-wise maximum of a few small ints over the ranks of one
machine, through shared memory (a step's world agreement: status, token count, eager
flag), in microseconds where a gloo all-reduce takes ~0.1-1 ms; bounded by a deadline,
and a rank whose process is gone ends the wait at once (its pid is published).

Layout: every rank owns one `ShmPeers` buffer of int64 ``[2 (parity), SLOTS]``, then
its pid and its wake counter (`wake`: idle ranks watch the counters to start their next
round at once instead of sleeping on). Round
``r`` (counted alike on every rank) writes parity ``r % 2``; each word is
``(r mod 2**31) << 32 | value``, so a reader takes a word as round r's only when its tag
says so, and no ordering between the words is needed (an aligned 8-byte store is seen
whole). A rank writes round r + 1 only after it read every rank's round r, and round
r + 2 only after every rank published round r + 1, i.e. finished reading round r: the
parity a reader reads is never overwritten under it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from .shm_peers import ShmPeers

__all__ = ["ShmAgreement", "spin_until"]

SLOTS = 8
_TAG_MOD = 1 << 31
_LOW = (1 << 32) - 1
_SPINS = 64  # busy polls (~µs each) before yielding the core between polls


class ShmAgreement:
    """Collective maximum over `peers`' world (all ranks call :meth:`max` in the same
    order, with as many values); values must lie in [0, 2**32)."""

    def __init__(self, peers: ShmPeers, deadline_s: float, name: str = "agreement") -> None:
        import torch
        self.rank, self.world_size, self.deadline_s = peers.rank, peers.world_size, deadline_s
        peers.alloc(name, 2 * SLOTS + 2, torch.int64)  # + the owner's pid and wake count
        views = [v.numpy() for v in peers.views(name)]
        self._slots = [v[:2 * SLOTS].reshape(2, SLOTS) for v in views]
        self._pids = [v[2 * SLOTS:2 * SLOTS + 1] for v in views]
        self._wakes = [v[2 * SLOTS + 1:] for v in views]
        self._pids[self.rank][0] = os.getpid()
        self._peers = peers  # owns the mappings the views read
        self._round = 0

    def pid(self, rank: int) -> int:
        """Rank `rank`'s process id as it published it (0 until then)."""
        return int(self._pids[rank][0])

    def wake(self) -> None:
        """Tell every rank that this one has work (an idle rank waiting in its loop
        watches `wakes()`): this rank's own counter goes up (one writer per word; two
        threads racing still change it)."""
        mine = self._wakes[self.rank]
        mine[0] = int(mine[0]) + 1

    def wakes(self) -> int:
        """The sum of every rank's wake counter: changes whenever a rank called `wake`."""
        return sum(int(w[0]) for w in self._wakes)

    def max(self, values: Sequence[int]) -> list[int]:
        """Every rank's `values`, element-wise maximum. TimeoutError when a rank does
        not publish within the deadline; ValueError for values out of range (raised
        before publishing: the peers then time out)."""
        n = len(values)
        if not 1 <= n <= SLOTS:
            raise ValueError(f"1 to {SLOTS} values per agreement, got {n}")
        vals = [int(v) for v in values]
        if any(not 0 <= v <= _LOW for v in vals):
            raise ValueError(f"values must lie in [0, 2**32), got {vals}")
        self._round += 1
        parity, tag = self._round % 2, (self._round % _TAG_MOD) << 32
        self._slots[self.rank][parity, :n] = np.array(vals, dtype=np.int64) | tag
        out = np.array(vals, dtype=np.int64)
        want = tag >> 32
        for q in range(self.world_size):
            if q == self.rank:
                continue
            slot, box = self._slots[q][parity, :n], []

            def landed() -> bool:
                words = slot.copy()
                if np.all((words >> 32) == want):
                    box.append(words)
                    return True
                return False

            spin_until(landed, self.deadline_s, self.pid(q), f"agreement {self._round}, rank {q}")
            np.maximum(out, box[0] & _LOW, out=out)
        return out.tolist()


def spin_until(ready: Callable[[], bool], deadline_s: float, pid: int, what: str) -> None:
    """Poll `ready()` until it holds: busy at first, then yielding the core (ranks may
    outnumber the cores), then sleeping. TimeoutError past `deadline_s`; RuntimeError
    as soon as process `pid` (the awaited rank's; 0: unknown) is gone."""
    start, spins = time.monotonic(), 0
    while not ready():
        spins += 1
        if spins <= _SPINS:
            continue
        waited = time.monotonic() - start
        if waited > deadline_s:
            raise TimeoutError(f"{what}: not within {deadline_s} s")
        if spins % 256 == 0 and not _alive(pid):
            raise RuntimeError(f"{what}: process {pid} exited")
        if waited < 5e-3:
            os.sched_yield()
        else:
            time.sleep(5e-4)


def _alive(pid: int) -> bool:
    """Whether process `pid` of this machine still runs (unknown pid 0: assumed so); a
    dead one is noticed at once, not at the deadline, as gloo notices a closed socket."""
    if pid <= 0:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
