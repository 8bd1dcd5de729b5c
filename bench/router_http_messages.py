"""Messages between the routing bench's processes (`bench/router_http.py`): what a
simulated worker reports to the phalanx proxy, as a rank reports to the cluster driver,
and the ground truth it reports to the bench. msgspec JSON on the wire."""

from __future__ import annotations

from typing import Optional

import msgspec


class WorkerStats(msgspec.Struct, frozen=True):
    """A worker's load, in the keys of an engine's `stats()` the driver reads."""

    num_waiting: int
    num_waiting_tokens: int
    num_running: int
    kv_usage: float


class HeldChanges(msgspec.Struct, frozen=True, omit_defaults=True):
    """A `held_prefix_changes(since)` answer: `evicted` since eviction `since`, or
    `full` (every held page hash) when asked with -1 or the log no longer reaches back;
    `seq` is the worker's eviction count when it answered."""

    seq: int
    evicted: Optional[list[int]] = None
    full: Optional[list[int]] = None

    def as_reply(self) -> dict:
        """The dict form `actors.held_reports.HeldReports.take` reads."""
        if self.full is not None:
            return {"seq": self.seq, "full": self.full}
        return {"seq": self.seq, "evicted": self.evicted or []}


class GroundTruth(msgspec.Struct, frozen=True):
    """A worker's prefix cache, measured by itself: requests prefilled, their prompt
    tokens, the tokens of those found cached when their prefill started, the seconds
    its prefill lane was busy, and the pages its cache evicted."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    prefill_busy_s: float = 0.0  # simulated prefill time (the lane's busy seconds)
    evictions: int = 0  # pages evicted from its cache


__all__ = ["GroundTruth", "HeldChanges", "WorkerStats"]
