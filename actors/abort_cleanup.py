"""An aborted prefill attempt taken apart in stages without blocking the caller (plain
logic: the client hands in the calls and how to tell which are still running).

The stages are those of a failure's `_abandon`, in the same order: every prefill rank
forgets the stream (its announced messages are withdrawn, which ends the receives the
decode ranks posted for them), then the decode gates close (which waits for receives
still running into the pages), then the decode pages are returned and the prefill
leader drops the request. A stage is issued once every call of the stage before it has
returned, or once that stage's deadline has passed (a stage whose deadline is None
waits for its calls: pages are never returned while a write into them may still land).
The client moves every cleanup on from its poll loop (`advance`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["AbortCleanup", "Stage"]


@dataclass(frozen=True, slots=True)
class Stage:
    """`issue()` starts the stage's calls and returns their handles."""

    name: str
    issue: Callable[[], list]
    timeout_s: Optional[float]  # None: wait for every call


class AbortCleanup:
    """One aborted attempt's stages; the first is issued at construction."""

    def __init__(self, request_id: str, epoch: int, stages: Sequence[Stage],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.request_id, self.epoch = request_id, epoch  # epoch: the decode group's
        self._stages, self._clock = deque(stages), clock
        self.stage: Optional[Stage] = None
        self._handles: list = []
        self._until: Optional[float] = None
        self._issue_next()

    @property
    def done(self) -> bool:
        return self.stage is None

    def _issue_next(self) -> None:
        self.stage = self._stages.popleft() if self._stages else None
        if self.stage is not None:
            self._handles = list(self.stage.issue())
            timeout = self.stage.timeout_s
            self._until = None if timeout is None else self._clock() + timeout

    def advance(self, running: Callable[[list], list]) -> list[tuple[str, list[Any], bool]]:
        """Issue every stage whose predecessor is over; `running(handles)` gives the
        handles still running. Returns each stage left behind as (name, its handles,
        whether it was left at its deadline with calls still running), for the caller
        to check their results."""
        ended = []
        while self.stage is not None:
            left = running(self._handles) if self._handles else []
            late = bool(left) and self._until is not None and self._clock() >= self._until
            if left and not late:
                break
            ended.append((self.stage.name, self._handles, late))
            self._issue_next()
        return ended
