"""What a drill injects: `FaultSpec`, parsed from the command line's `--fault` values.

Syntax: `KIND[:key=value]...`, for example

    kill-rank:every=15s             SIGKILL a rank process every 15 s
    pause-rank:every=40s:for=5s     SIGSTOP a rank for 5 s, then SIGCONT (a straggler)
    kill-actor:rate=0.05            ray.kill a rank actor at random, 0.05 a second on average
    kill-rank:at=recovery           kill a rank of a group that is being re-formed
    fault-point:point=moe_dispatch:every=20s    arm an internal fault point (exact placement)
    kv-delay:every=30s:for=2s       stall a prefill rank's next KV send for 2 s
    kv-drop:every=30s               drop a prefill rank's next KV batch (its transfer fails)
    remove-node:at=40s              kill a Ray node's raylet (a node of this machine)

Keys: `every` (a period), `rate` (faults per second, Poisson), `at` (times or the event
`recovery`, comma-separated), `for` (pause and delay length), `role` (`group`, `prefill`,
`decode`: which ranks), `point` (fault-point's point). Times take `s` or `ms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["EVENTS", "FaultSpec", "KINDS", "POINTS", "parse_fault"]

KINDS = ("kill-rank", "kill-actor", "pause-rank", "fault-point", "kv-delay", "kv-drop",
         "remove-node")
EVENTS = ("recovery",)  # named moments a fault may be tied to
POINTS = ("step", "moe_dispatch", "kv_send")  # internal fault points (actors/rank/fault_points)
ROLES = ("group", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One `--fault`: its kind and when (exactly one of `every_s`, `rate`, `at`)."""

    kind: str
    every_s: Optional[float] = None
    rate: Optional[float] = None
    at_s: tuple[float, ...] = ()
    at_events: tuple[str, ...] = ()
    for_s: float = 0.0
    role: Optional[str] = None
    point: Optional[str] = None

    def __post_init__(self) -> None:
        when = sum(x is not None for x in (self.every_s, self.rate)) + bool(self.at_s or self.at_events)
        _need(self.kind in KINDS, f"unknown fault kind {self.kind!r}; known: {', '.join(KINDS)}")
        _need(when == 1, f"{self.kind}: give exactly one of every=, rate=, at=")
        _need(self.every_s is None or self.every_s > 0, f"{self.kind}: every must be > 0")
        _need(self.rate is None or self.rate > 0, f"{self.kind}: rate must be > 0")
        _need(all(t >= 0 for t in self.at_s), f"{self.kind}: at times must be >= 0")
        _need(self.role is None or self.role in ROLES,
              f"{self.kind}: role must be one of {', '.join(ROLES)}")
        needs_for = self.kind in ("pause-rank", "kv-delay")
        _need(not needs_for or self.for_s > 0, f"{self.kind}: give for= (how long)")
        _need(needs_for or self.for_s == 0, f"{self.kind}: for= applies to pause-rank and "
                                            "kv-delay only")
        _need((self.kind == "fault-point") == (self.point is not None),
              f"{self.kind}: point= is fault-point's (one of {', '.join(POINTS)})")
        _need(self.point is None or self.point in POINTS,
              f"fault-point: point must be one of {', '.join(POINTS)}")

    def __str__(self) -> str:
        return self.text

    @property
    def text(self) -> str:
        parts = [self.kind]
        if self.every_s is not None:
            parts.append(f"every={self.every_s:g}s")
        if self.rate is not None:
            parts.append(f"rate={self.rate:g}")
        if self.at_s or self.at_events:
            parts.append("at=" + ",".join([f"{t:g}s" for t in self.at_s] + list(self.at_events)))
        if self.for_s:
            parts.append(f"for={self.for_s:g}s")
        for key in ("role", "point"):
            if getattr(self, key) is not None:
                parts.append(f"{key}={getattr(self, key)}")
        return ":".join(parts)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _seconds(text: str, key: str) -> float:
    try:
        if text.endswith("ms"):
            return float(text[:-2]) / 1e3
        return float(text[:-1] if text.endswith("s") else text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a time (like 15s or 500ms)") from None


def parse_fault(text: str) -> FaultSpec:
    """`--fault`'s value as a `FaultSpec`; ValueError naming what is wrong."""
    kind, *pairs = text.strip().split(":")
    fields: dict = {"kind": kind}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        _need(bool(sep) and bool(value), f"{text!r}: {pair!r} is not key=value")
        if key == "every":
            fields["every_s"] = _seconds(value, key)
        elif key == "rate":
            try:
                fields["rate"] = float(value)
            except ValueError:
                raise ValueError(f"rate={value!r} is not a number") from None
        elif key == "at":
            items = value.split(",")
            fields["at_events"] = tuple(i for i in items if i in EVENTS)
            fields["at_s"] = tuple(_seconds(i, key) for i in items if i not in EVENTS)
        elif key == "for":
            fields["for_s"] = _seconds(value, key)
        elif key in ("role", "point"):
            fields[key] = value
        else:
            raise ValueError(f"{text!r}: unknown key {key!r} (every, rate, at, for, role, point)")
    return FaultSpec(**fields)
