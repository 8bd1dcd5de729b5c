"""Stage generators: a forward written as a generator yields wherever one of its
exchanges is in flight (`EPDispatcher.moe_stages`) and returns its result. One runs to its
end alone (`run_to_end`: one batch per step); two run interleaved (`interleave`: two
micro-batches, one's exchange in flight while the other computes).

Invariant: the generators of a step yield at the same points on every rank of a group
(every MoE layer yields twice per micro-batch, also with no tokens), so the ranks submit
their exchanges in the same order.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, TypeVar

__all__ = ["Stages", "interleave", "run_to_end"]

R = TypeVar("R")
Stages = Generator[None, None, R]


def run_to_end(gen: Stages[R]) -> R:
    """Run one stage generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def interleave(gens: Sequence[Stages[Any]]) -> list[Any]:
    """Advance each generator to its next yield in turn until all have ended; their
    return values, in order. A generator's error ends the rest (closed) and is raised."""
    results: list[Any] = [None] * len(gens)
    live = list(range(len(gens)))
    try:
        while live:
            still = []
            for i in live:
                try:
                    next(gens[i])
                    still.append(i)
                except StopIteration as stop:
                    results[i] = stop.value
            live = still
    except BaseException:
        for g in gens:
            g.close()
        raise
    return results
