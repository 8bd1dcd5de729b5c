"""`Formation`: one epoch's formation of a group, as a sequence of steps that each wait on
Ray calls, driven to the end at once (`run`: start-up) or a step at a time without
blocking (`advance`: the recovery loop, so that the other groups keep serving while one
re-forms).

The steps are a generator that yields `Wait`s and receives each one's results. A step's
first failed call raises at once (a dead rank's error, while its peers still wait for it
in a rendezvous); a step not done within its timeout raises the `Wait`'s `expired` error.
Either way the generator is closed (its `finally` runs) and the error raised to the
driver; the formation is then over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError

__all__ = ["Formation", "Wait", "gather"]


@dataclass(frozen=True, slots=True)
class Wait:
    """Ray calls a step waits on, and for how long; `expired` makes the error raised when
    they are not all done in time (default: GetTimeoutError)."""

    refs: list
    timeout_s: float
    expired: Callable[[], BaseException] | None = None

    def timed_out(self) -> BaseException:
        if self.expired is not None:
            return self.expired()
        return GetTimeoutError(f"{len(self.refs)} calls not all answered after {self.timeout_s} s")


Steps = Generator[Wait, list, None]


class Formation:
    """Drives `steps` (see the module docstring). `done` once the generator has ended."""

    def __init__(self, steps: Steps, clock: Callable[[], float] = time.monotonic) -> None:
        self._steps, self._clock = steps, clock
        self.done = False
        self._wait: Wait | None = None
        self._deadline = 0.0
        self._checked: set = set()  # the current step's answers already taken
        self._next(lambda: next(self._steps))

    def advance(self) -> bool:
        """Take every step whose calls have all answered, without blocking: True once
        formed; raises the formation's error."""
        while not self.done:
            w = self._wait
            ready, _ = ray.wait(w.refs, num_returns=len(w.refs), timeout=0)
            for ref in ready:
                if ref not in self._checked:  # each answer once: a failed call raises now
                    self._checked.add(ref)
                    self._check(lambda: ray.get(ref))
            if len(ready) < len(w.refs):
                if self._clock() >= self._deadline:
                    self._fail(w.timed_out())
                return False
            results = self._check(lambda: ray.get(w.refs))
            self._next(lambda: self._steps.send(results))
        return True

    def run(self) -> None:
        """Every step to the end, blocking; raises the formation's error."""
        while not self.done:
            w = self._wait
            try:
                results = gather(w.refs, max(0.0, self._deadline - self._clock()))
            except GetTimeoutError as e:
                self._fail(w.timed_out(), e)
            except BaseException as e:  # noqa: BLE001 - thrown into the steps, re-raised
                self._fail(e)
            self._next(lambda: self._steps.send(results))

    def close(self) -> None:
        """Abandon the formation (its generator's `finally` runs)."""
        self.done = True
        self._steps.close()

    def _next(self, step: Callable[[], Wait]) -> None:
        try:
            self._wait = step()
        except StopIteration:
            self.done = True
            return
        except BaseException:
            self.done = True
            raise
        self._deadline = self._clock() + self._wait.timeout_s
        self._checked = set()

    def _check(self, call):
        try:
            return call()
        except BaseException as e:  # noqa: BLE001 - thrown into the steps, re-raised
            self._fail(e)

    def _fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        self.done = True
        self._steps.close()
        if cause is not None:
            raise error from cause
        raise error


def gather(refs: list, timeout_s: float) -> list:
    """`ray.get(refs)`, but the first call that fails raises at once (a dead rank's
    error, while its peers still wait for it in a rendezvous); GetTimeoutError when
    not all have answered within `timeout_s`."""
    end = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            raise GetTimeoutError(f"{len(pending)} of {len(refs)} calls unanswered after "
                                  f"{timeout_s} s")
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            ray.get(ref)  # raises the call's error now
    return ray.get(list(refs))
