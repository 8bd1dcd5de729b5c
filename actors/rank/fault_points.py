"""`FaultPoints`: named places in a rank's code where a chaos drill places a fault exactly
(the step's start, inside an MoE dispatch, before a KV send). They place faults; the
kills from outside (`chaos.ranks`) are what prove recovery."""

from __future__ import annotations

import os
import time

from ...log import get_logger

__all__ = ["FaultPoints", "FAULT_EXIT_CODE"]

log = get_logger(__name__)

FAULT_EXIT_CODE = 17


class FaultPoints:
    """Armed points of one rank: point -> (passes left, stall seconds, drop)."""

    def __init__(self, rank: int = -1, epoch: int = -1) -> None:
        self.rank, self.epoch = rank, epoch
        self._armed: dict[str, tuple[int, float, bool]] = {}

    def arm(self, point: str, after: int = 0, stall_s: float = 0.0, drop: bool = False) -> None:
        """At the `after`-th next pass through `point`, once: exit the process; or
        (`stall_s` > 0) hold the passing thread that long (a rank that stalls mid-step);
        or (`drop`) tell the caller to drop what it was about to do (`passed` returns
        True: a KV send lost on the link)."""
        if after < 0 or stall_s < 0:
            raise ValueError(f"after and stall_s must be >= 0, got {after}, {stall_s}")
        if drop and stall_s:
            raise ValueError("a fault point drops or stalls, not both")
        self._armed[point] = (after, stall_s, drop)

    def passed(self, point: str) -> bool:
        """The code passes `point`: count down, then exit, stall or drop if it is armed.
        True: the caller drops what it was about to do."""
        armed = self._armed.get(point)
        if armed is None:
            return False
        left, stall_s, drop = armed
        if left > 0:
            self._armed[point] = (left - 1, stall_s, drop)
            return False
        log.warning("fault_injected", rank=self.rank, epoch=self.epoch, point=point,
                    stall_s=stall_s, drop=drop)
        if not (stall_s or drop):
            os._exit(FAULT_EXIT_CODE)
        del self._armed[point]
        if stall_s:
            time.sleep(stall_s)
        return drop
