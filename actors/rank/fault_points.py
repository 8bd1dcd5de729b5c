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
    """Armed points of one rank: point -> (passes left, stall seconds)."""

    def __init__(self, rank: int = -1, epoch: int = -1) -> None:
        self.rank, self.epoch = rank, epoch
        self._armed: dict[str, tuple[int, float]] = {}

    def arm(self, point: str, after: int = 0, stall_s: float = 0.0) -> None:
        """At the `after`-th next pass through `point`: exit the process, or (`stall_s`
        > 0) hold the passing thread that long, once (a rank that stalls mid-step)."""
        if after < 0 or stall_s < 0:
            raise ValueError(f"after and stall_s must be >= 0, got {after}, {stall_s}")
        self._armed[point] = (after, stall_s)

    def passed(self, point: str) -> None:
        """The code passes `point`: count down, then exit or stall if it is armed."""
        armed = self._armed.get(point)
        if armed is None:
            return
        left, stall_s = armed
        if left > 0:
            self._armed[point] = (left - 1, stall_s)
            return
        log.warning("fault_injected", rank=self.rank, epoch=self.epoch, point=point,
                    stall_s=stall_s)
        if not stall_s:
            os._exit(FAULT_EXIT_CODE)
        del self._armed[point]
        time.sleep(stall_s)
