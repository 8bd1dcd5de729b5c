"""When a drill's faults fire: seeded times for every `FaultSpec` over the drill's
duration (`planned`), and the event-tied ones (`at=recovery`) left to the runner, which
fires them when it sees the event. Plain logic: the same specs, duration and seed give
the same schedule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .faults import FaultSpec

__all__ = ["Planned", "planned"]


@dataclass(frozen=True, slots=True)
class Planned:
    """A fault to inject `t` seconds after the drill's start."""

    t: float
    spec: FaultSpec


def planned(specs: Sequence[FaultSpec], duration_s: float, seed: int) -> list[Planned]:
    """Every time-tied fault within `duration_s`, in time order: `every` at every, 2
    every, ...; `rate` as a Poisson process; `at` at the times given."""
    rng = random.Random(seed)
    out: list[Planned] = []
    for spec in specs:
        if spec.every_s is not None:
            t = spec.every_s
            while t < duration_s:
                out.append(Planned(t, spec))
                t += spec.every_s
        elif spec.rate is not None:
            t = rng.expovariate(spec.rate)
            while t < duration_s:
                out.append(Planned(t, spec))
                t += rng.expovariate(spec.rate)
        out += [Planned(t, spec) for t in spec.at_s if t < duration_s]
    return sorted(out, key=lambda p: p.t)
