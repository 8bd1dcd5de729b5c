"""The reconciler: one loop that makes the live groups match the desired layout
(ARCHITECTURE §5). Plain logic: no Ray, no torch, no clock of its own.

State per group (a key such as "decode" or ("prefill", 0)): the epoch it serves or
last tried, and a phase:

    serving ──RankLost──▶ down ──(Fence)──▶ fenced ──(Form, budget allows)──▶ forming
       ▲                                      ▲                                  │
       └──────────── Formed (+ Resume) ───────┴──────── FormFailed / RankLost ◀──┘

Events come from anywhere (a rank's death reported by Ray, a failed call, a deadline,
a formation that did not finish): `observe` folds each into the state, and an event of
an epoch that is not the group's current one is dropped (fencing: a late report of a
replaced group never touches its successor). `actions(now)` says what to do next, in
this order: fence every group that is down (tear down its epoch, take its requests
back), then form each fenced group whose backoff has passed, if the restart intensity
allows (at most `max_restarts` formations within `window_s` seconds, as an Erlang/OTP
supervisor), else give up. A group that is formed is resumed (its requests handed to
it). A death during a formation is just another event: the group is fenced and formed
again under the next epoch, after a backoff that doubles with each failed attempt in a
row. The executor (the client that owns the actors) carries out each action and
reports the outcome as the next event; nothing here can raise into a caller.

Width (ARCHITECTURE §3, §5): each group has a desired width (its DP ranks) and forms
at its current one. A formation that fails for want of capacity (a dead rank's node
left, no free CPU/GPU for its placement) narrows the next attempt by one DP rank, down
to `min_width`; a group serving narrower than desired is widened back (fenced and
formed at the desired width, like any recovery) once the executor reports the capacity
back (`CapacityBack`), checked at most every `widen_every_s`. A group of a pool (the
prefill instances) that finds no room even at its narrowest is parked (dropped, not
serving, no formation) while another group of its pool serves, and formed again once
there is room for it.

Layout (ARCHITECTURE §3, the EP-width policy): `reshape(widths)` sets every group's desired
width at once; 0 retires a group (fenced, not formed again). A group whose width changes
is fenced and formed at its new width like any recovery, but as a *planned* formation: it
does not count against the restart intensity (nor does widening back), while a failure
during it does (the next formation is a recovery). Fences go before formations in one
round of actions, so a retired group's ranks are free before a wider one forms.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Union

__all__ = ["Phase", "RestartIntensity", "RankLost", "Formed", "FormFailed", "CapacityBack",
           "Fence", "Form", "Resume", "GiveUp", "Reconciler", "Event", "Action"]


class Phase(str, Enum):
    SERVING = "serving"
    DOWN = "down"  # lost a rank; its epoch is not fenced yet
    FENCED = "fenced"  # its epoch is torn down; waiting to form again
    FORMING = "forming"
    PARKED = "parked"  # dropped for want of room while a peer of its pool serves
    RETIRED = "retired"  # not part of the desired layout (width 0)


@dataclass(frozen=True, slots=True)
class RestartIntensity:
    """At most `max_restarts` formations within any `window_s` seconds (0: a death is
    final). Attempts in a row without serving wait `backoff_s`, doubled each time, at
    most `max_backoff_s`; the first attempt after a group served goes at once."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.window_s > 0:
            raise ValueError(f"recovery window must be positive, got {self.window_s}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"backoff: 0 <= backoff_s <= max_backoff_s required, got "
                             f"{self.backoff_s}, {self.max_backoff_s}")

    def delay(self, failed_in_a_row: int) -> float:
        """The wait before the next attempt after `failed_in_a_row` failed formations."""
        if failed_in_a_row <= 0:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failed_in_a_row - 1))


# -- events (what happened) -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RankLost:
    """A rank of `key`'s `epoch` died, or a call into it failed or timed out."""

    key: Hashable
    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class Formed:
    key: Hashable
    epoch: int


@dataclass(frozen=True, slots=True)
class FormFailed:
    key: Hashable
    epoch: int
    reason: str
    short: bool = False  # for want of capacity: try narrower


@dataclass(frozen=True, slots=True)
class CapacityBack:
    """There is room again for `key` at its desired width (the executor checked)."""

    key: Hashable
    epoch: int


Event = Union[RankLost, Formed, FormFailed, CapacityBack]


# -- actions (what to do) -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Fence:
    """Tear down `key`'s `epoch` (every actor of it) and take back its requests."""

    key: Hashable
    epoch: int
    planned: bool = False  # no rank was lost (widening back): nothing to wait for


@dataclass(frozen=True, slots=True)
class Form:
    """Form `key` again under an epoch of at least `epoch` (the executor may skip some,
    e.g. to retry a taken port); report `Formed` or `FormFailed` with the epoch used.
    Events of earlier epochs are dropped from now on."""

    key: Hashable
    epoch: int
    attempt: int  # formations of this group in a row since it last served (1, 2, ...)
    width: int = 1  # DP ranks to form with
    why: str = ""  # what made the group re-form (for the log)
    planned: bool = False  # a layout change or widening: not a recovery


@dataclass(frozen=True, slots=True)
class Resume:
    """`key` serves under `epoch`: hand it the requests it should hold."""

    key: Hashable
    epoch: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The restart intensity is exceeded: the layout fails for good."""

    reasons: tuple[str, ...]
    restarts: int


Action = Union[Fence, Form, Resume, GiveUp]


@dataclass(slots=True)
class GroupState:
    epoch: int
    width: int = 1  # DP ranks it serves (or forms) with
    desired: int = 1  # DP ranks it should have
    min_width: int = 1
    phase: Phase = Phase.SERVING
    attempts: int = 0  # formations in a row that have not served yet
    retry_at: float = 0.0
    widen_at: float = 0.0  # earliest time to check for capacity to widen
    reasons: list[str] = field(default_factory=list)  # since it last served
    pool: Optional[Hashable] = None  # groups of one pool stand in for each other
    planned: bool = False  # its next fence and formation are a layout change, not a recovery
    narrowable: bool = False  # may form narrower than desired for want of room
    pending: Optional[int] = None  # a reshape that arrived while forming: width after it


class Reconciler:
    """Desired: every key serving. Actual: `groups`. See the module docstring."""

    def __init__(self, epochs: dict[Hashable, int], intensity: RestartIntensity,
                 widths: dict[Hashable, tuple[int, int]] | None = None,
                 widen_every_s: float = 2.0, pools: dict[Hashable, Hashable] | None = None
                 ) -> None:
        """`epochs`: each group's key and the epoch it serves under now; `widths`: each
        group's (desired width, min width) (default (1, 1); (0, 0): retired, not part of
        the layout yet); `pools`: key -> pool of the groups that may be parked while a
        peer of their pool serves."""
        self.intensity, self.widen_every_s = intensity, widen_every_s
        widths = widths or {}
        self.groups = {}
        for key, epoch in epochs.items():
            desired, least = widths.get(key, (1, 1))
            if (desired, least) != (0, 0) and not 1 <= least <= desired:
                raise ValueError(f"group {key!r}: 1 <= min width <= width required, "
                                 f"got {least}, {desired}")
            self.groups[key] = GroupState(epoch, desired, desired, least,
                                          pool=(pools or {}).get(key),
                                          narrowable=least < desired)
            if desired == 0:
                self.groups[key].phase = Phase.RETIRED
        self.restarts: deque[float] = deque()  # when each formation started, in the window
        self.total_restarts = 0
        self.reshapes = 0  # planned formations (layout changes, widening back)
        self.failed: GiveUp | None = None
        self._resume: list[Resume] = []
        self.history: list[tuple[float, str, Hashable, int, str]] = []  # (t, what, key, epoch, why)

    # -- queries ---------------------------------------------------------------------
    def serving(self, key: Hashable) -> bool:
        return self.failed is None and self.groups[key].phase is Phase.SERVING

    @property
    def settled(self) -> bool:
        """Every group serves (nothing to reconcile)."""
        return self.failed is None and not self._resume and all(
            g.phase in (Phase.SERVING, Phase.PARKED, Phase.RETIRED) for g in self.groups.values())

    def budget_left(self, now: float) -> int:
        """Formations the intensity still allows within the window ending at `now`."""
        recent = sum(t > now - self.intensity.window_s for t in self.restarts)
        return max(0, self.intensity.max_restarts - recent)

    def narrow(self) -> dict[Hashable, int]:
        """Groups serving narrower than desired, or parked: key -> DP ranks missing."""
        return {k: g.desired - g.width for k, g in self.groups.items()
                if g.phase in (Phase.SERVING, Phase.PARKED) and g.width < g.desired}

    def widen_due(self, now: float) -> list[Hashable]:
        """Narrow groups whose capacity the executor should check now (it reports
        `CapacityBack` if there is room); each is checked at most every
        `widen_every_s`."""
        due = [k for k in self.narrow() if self.groups[k].widen_at <= now]
        for k in due:
            self.groups[k].widen_at = now + self.widen_every_s
        return due if self.failed is None else []

    def next_due(self) -> float | None:
        """When the earliest deferred formation is due (None: none deferred)."""
        due = [g.retry_at for g in self.groups.values() if g.phase is Phase.FENCED]
        return min(due) if due and self.failed is None else None

    # -- events ----------------------------------------------------------------------
    def observe(self, event: Event, now: float = 0.0) -> bool:
        """Fold `event` in; False when it was dropped (another epoch, or no longer
        relevant to the group's phase)."""
        g = self.groups.get(event.key)
        if g is None or self.failed is not None:
            return False
        if g.phase is Phase.PARKED and isinstance(event, CapacityBack):
            g.epoch = max(g.epoch, event.epoch)  # a parked group has no epoch serving
        if g.phase is Phase.FORMING and event.epoch > g.epoch:
            g.epoch = event.epoch  # the attempt runs under a later epoch than its floor
        if event.epoch != g.epoch:
            return False
        if isinstance(event, Formed):
            if g.phase is not Phase.FORMING:
                return False
            g.phase, g.attempts, g.reasons, g.planned = Phase.SERVING, 0, [], False
            g.widen_at = now + self.widen_every_s
            self._note(now, "formed", event.key, event.epoch, f"width {g.width}")
            if g.pending is not None:  # reshaped while it formed: change it now
                self._change(event.key, g, g.pending, now)
            else:
                self._resume.append(Resume(event.key, event.epoch))
            return True
        if isinstance(event, CapacityBack):
            if g.phase not in (Phase.SERVING, Phase.PARKED) or g.width >= g.desired:
                return False
            g.phase, g.width, g.planned = Phase.DOWN, g.desired, True
            g.reasons.append(f"capacity back: widening to {g.desired}")
            self._note(now, "widen", event.key, event.epoch, f"to width {g.desired}")
            return True
        if g.phase not in (Phase.SERVING, Phase.FORMING):
            return False  # already down: one fence covers every report of this epoch
        g.phase, g.planned = Phase.DOWN, False  # what forms next is a recovery
        g.reasons.append(event.reason)
        what = "form_failed" if isinstance(event, FormFailed) else "rank_lost"
        self._note(now, what, event.key, event.epoch, event.reason)
        if isinstance(event, FormFailed) and event.short and g.width > g.min_width:
            g.width -= 1
            g.attempts = 0  # a narrower layout is a new try, not a failed retry
            self._note(now, "narrow", event.key, event.epoch, f"to width {g.width}: {event.reason}")
        elif isinstance(event, FormFailed) and event.short and self._peer_serves(event.key):
            g.phase, g.width, g.attempts = Phase.PARKED, 0, 0  # torn down by the executor
            g.widen_at = now + self.widen_every_s
            self._note(now, "parked", event.key, event.epoch, event.reason)
        return True

    def reshape(self, widths: dict[Hashable, int], now: float = 0.0) -> list[Hashable]:
        """Set each listed group's desired width (0: retire it); the keys whose layout
        changes. A serving group of another width is fenced and formed at the new one; a
        retired group is formed; a group that is recovering forms at the new width; one
        forming now changes once it has formed."""
        changed = []
        for key, width in widths.items():
            g = self.groups[key]
            if width < 0 or not isinstance(width, int):
                raise ValueError(f"group {key!r}: width must be an integer >= 0, got {width!r}")
            if g.desired == width and g.pending is None:
                continue
            changed.append(key)
            if g.phase is Phase.FORMING:
                g.pending = width
            else:
                self._change(key, g, width, now)
        return changed

    def _change(self, key: Hashable, g: GroupState, width: int, now: float) -> None:
        g.pending, g.desired, g.width = None, width, width
        g.min_width = 1 if g.narrowable and width else width
        why = f"layout: width {width}" if width else "layout: retired"
        self._note(now, "reshape", key, g.epoch, why)
        if g.phase in (Phase.SERVING, Phase.PARKED):  # a parked epoch is fenced (a no-op) first
            g.phase, g.planned, g.attempts = Phase.DOWN, True, 0
            g.reasons.append(why)
        elif g.phase is Phase.RETIRED and width:
            g.phase, g.planned, g.attempts, g.retry_at = Phase.FENCED, True, 0, now
            g.reasons.append(why)
        elif g.phase is Phase.FENCED and not width:
            g.phase = Phase.RETIRED

    def _peer_serves(self, key: Hashable) -> bool:
        pool = self.groups[key].pool
        return pool is not None and any(
            k != key and g.pool == pool and g.phase is Phase.SERVING for k, g in self.groups.items())

    # -- the loop's next steps -------------------------------------------------------
    def actions(self, now: float) -> list[Action]:
        """What to do now (see the module docstring); the state moves as if each were
        carried out: the executor reports how each formation ended."""
        if self.failed is not None:
            return []
        out: list[Action] = []
        for key, g in self.groups.items():
            if g.phase is Phase.DOWN:
                g.phase = Phase.FENCED if g.desired else Phase.RETIRED
                g.retry_at = now if g.planned else now + self.intensity.delay(g.attempts)
                out.append(Fence(key, g.epoch, g.planned))
        for key, g in self.groups.items():
            if g.phase is not Phase.FENCED or g.retry_at > now:
                continue
            if g.planned:  # a layout change: not a recovery, outside the intensity
                self.reshapes += 1
                g.phase, g.attempts, g.epoch = Phase.FORMING, g.attempts + 1, g.epoch + 1
                out.append(Form(key, g.epoch, g.attempts, g.width, g.reasons[-1] if g.reasons else "",
                                planned=True))
                continue
            while self.restarts and self.restarts[0] <= now - self.intensity.window_s:
                self.restarts.popleft()
            if len(self.restarts) >= self.intensity.max_restarts:
                reasons = tuple(r for s in self.groups.values() for r in s.reasons)
                self.failed = GiveUp(reasons, self.total_restarts)
                self._note(now, "gave_up", key, g.epoch, "; ".join(reasons)[:300])
                return out + [self.failed]
            self.restarts.append(now)
            self.total_restarts += 1
            g.phase, g.attempts, g.epoch = Phase.FORMING, g.attempts + 1, g.epoch + 1
            out.append(Form(key, g.epoch, g.attempts, g.width, g.reasons[-1] if g.reasons else ""))
        out += self._resume
        self._resume = []
        return out

    def _note(self, now: float, what: str, key: Hashable, epoch: int, why: str) -> None:
        self.history.append((now, what, key, epoch, why))
        del self.history[:-256]
