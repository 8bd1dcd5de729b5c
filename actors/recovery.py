"""The thin executor of the reconciler (reconciler.py) over a client's rank groups.

A client reports every failure it meets as `lost(key, epoch, error)` (a call into a rank
that raised, a deadline, a connection to a rank that is gone) and calls `reconcile()`
from its poll loop; nothing else in the client recovers anything. `reconcile` also
learns of deaths from Ray on its own (each serving group's `wait()` calls), then carries
out the reconciler's actions: fence (kill every actor of the epoch, free its placement
groups, then the client's `on_fence(key)` takes the group's requests back), form (a new
epoch, begun without blocking and taken further by each later `reconcile`, so the other
groups keep serving meanwhile; its outcome is the next event, so a death during
formation only forms again), resume (the client's `on_resume(key)` hands the group its
requests), give up (raises `GroupFailure`, now and on every later call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Optional

from ..config import EngineConfig
from ..log import get_logger
from .reconciler import (CapacityBack, Fence, Form, Formed, FormFailed, GiveUp, RankLost,
                         Reconciler, RestartIntensity, Resume)
from .supervisor import CapacityShort, GroupFailure, GroupSupervisor, RankDeath

log = get_logger(__name__)

NAME_DEATH_S = 1.0  # at a fence, how long to wait for Ray to name a dead process


def intensity_of(config: EngineConfig, max_recoveries: Optional[int] = None) -> RestartIntensity:
    """The restart intensity `config.parallel` asks for (`max_recoveries` overrides R)."""
    p = config.parallel
    return RestartIntensity(p.max_recoveries if max_recoveries is None else max_recoveries,
                            p.recovery_window_s)


class Recovery:
    """`groups`: key -> supervisor, each formed already (the epoch it serves under, at
    the width it should have); `narrowable`: keys of the groups that may serve with fewer
    DP ranks when a dead rank cannot be replaced (`replace_timeout_s`); `pools`: key ->
    pool of the groups that stand in for each other (one may be dropped while another
    serves: prefill instances); `retired`: keys not in the layout at start (not formed;
    `reshape` brings them in)."""

    def __init__(self, groups: dict[Hashable, GroupSupervisor], intensity: RestartIntensity,
                 on_fence: Callable[[Hashable], None], on_resume: Callable[[Hashable], None],
                 narrowable: tuple = (), replace_timeout_s: float = 30.0,
                 pools: Optional[dict] = None, retired: tuple = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.groups, self.on_fence, self.on_resume, self.clock = groups, on_fence, on_resume, clock
        self.replace_timeout_s = replace_timeout_s
        widths = {k: (0, 0) if k in retired else (g.dp, 1 if k in narrowable else g.dp)
                  for k, g in groups.items()}
        self.reconciler = Reconciler({k: g.epoch for k, g in groups.items()}, intensity, widths,
                                     pools=pools)
        self.deaths: dict[Hashable, list[RankDeath]] = {}  # named at fences since it served
        self.formed: dict[Hashable, int] = {k: 0 for k in groups}  # re-formations, by key
        self.failure: Optional[GroupFailure] = None
        self.events: list[tuple[float, str, str, int, str]] = []  # (t, what, key, epoch, why)
        self._forming: dict[Hashable, tuple[Form, float]] = {}  # under way: (action, start)

    @property
    def recoveries(self) -> int:
        """Re-formations started so far (every group)."""
        return self.reconciler.total_restarts

    @property
    def reshapes(self) -> int:
        """Planned formations so far (layout changes, widening back)."""
        return self.reconciler.reshapes

    def serving(self, key: Hashable) -> bool:
        return self.reconciler.serving(key)

    def reshape(self, widths: dict[Hashable, int]) -> list[Hashable]:
        """A new desired layout: each key's DP ranks (0: retire it); carried out by the
        next `reconcile`. The keys that change."""
        changed = self.reconciler.reshape(widths, self.clock())
        if changed:
            log.warning("layout_reshape", widths={str(k): w for k, w in widths.items()},
                        changed=[str(k) for k in changed])
        return changed

    def lost(self, key: Hashable, epoch: int, error: BaseException | str) -> None:
        """A call into `key`'s `epoch` failed: the group goes down (once per epoch)."""
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.reconciler.observe(RankLost(key, epoch, reason[:500]), self.clock()):
            log.warning("group_lost", group=str(key), epoch=epoch, error=reason[:300])

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def reconcile(self) -> None:
        """Learn of deaths, then act until nothing is due now (a formation in backoff
        waits for a later call). Raises `GroupFailure` once the intensity is exceeded."""
        self.raise_if_failed()
        for key, group in self.groups.items():
            if self.serving(key):
                deaths = group.deaths()
                if deaths:
                    self.lost(key, group.epoch, "; ".join(f"rank {d.rank}: {d.reason}"
                                                          for d in deaths))
        self._advance_formations()
        for key in self.reconciler.widen_due(self.clock()):
            group, missing = self.groups[key], self.reconciler.narrow().get(key, 0)
            if missing and group.room_for(missing):
                log.warning("capacity_back", group=str(key), epoch=group.epoch, width=group.dp,
                            desired=group.dp + missing)
                self.reconciler.observe(CapacityBack(key, group.epoch), self.clock())
        while (actions := self.reconciler.actions(self.clock())):
            for action in actions:
                if isinstance(action, Fence):
                    self._fence(action.key, action.planned)
                elif isinstance(action, Form):
                    self._form(action)
                elif isinstance(action, Resume):
                    self._note("resumed", action.key, action.epoch, "")
                    self.on_resume(action.key)
                elif isinstance(action, GiveUp):
                    self._give_up(action)

    def wait_hint(self, default_s: float) -> float:
        """How long a poll may sleep: until the next deferred formation at most."""
        due = self.reconciler.next_due()
        return default_s if due is None else max(0.0, min(default_s, due - self.clock()))

    def _fence(self, key: Hashable, planned: bool = False) -> None:
        group = self.groups[key]
        if not group.actors or planned:  # torn down already, or nothing died
            deaths = []
        elif self.reconciler.budget_left(self.clock()) == 0:
            # The end of the line: name every rank's end (survivors leave their
            # collectives within the deadline) for the error the caller will get.
            deaths = group.wait_for_failure(min(group.deadline_s + 5.0, 30.0))
        else:
            deaths = group.deaths()
            end = self.clock() + NAME_DEATH_S
            while not any(d.reason == "process died" for d in deaths) and self.clock() < end:
                deaths = group.deaths(timeout_s=0.1)
        self.deaths[key] = self.deaths.get(key, []) + deaths
        log.warning("group_fenced", group=str(key), epoch=group.epoch,
                    deaths=[(d.rank, d.reason[:120]) for d in deaths])
        self._note("fenced", key, group.epoch, "; ".join(f"rank {d.rank}: {d.reason[:80]}"
                                                        for d in deaths))
        self._forming.pop(key, None)
        group.shutdown()  # a formation under way too
        self.on_fence(key)

    def _form(self, action: Form) -> None:
        """Begin the formation; `_advance_formations` reports its outcome."""
        group = self.groups[action.key]
        log.warning("group_reforming", group=str(action.key), width=action.width,
                    attempt=action.attempt, planned=action.planned, why=action.why[:200])
        self._forming[action.key] = (action, self.clock())
        try:
            group.begin_form(action.epoch, dp=action.width, placement_timeout_s=self.replace_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to form is the next event
            self._form_failed(action, e)

    def _advance_formations(self) -> None:
        """Take every formation under way as far as it goes without blocking; a formed
        group is the event `Formed`, a failed one `FormFailed`."""
        for key, (action, started) in list(self._forming.items()):
            group = self.groups[key]
            try:
                if not group.advance_form():
                    continue
            except Exception as e:  # noqa: BLE001 - any failure to form is the next event
                self._form_failed(action, e)
                continue
            del self._forming[key]
            self.formed[key] += 1
            self.deaths.pop(key, None)  # named for a give-up since it last served
            log.warning("group_reformed", group=str(key), epoch=group.epoch, width=group.dp,
                        attempt=action.attempt, seconds=round(self.clock() - started, 2))
            self._note("formed", key, group.epoch,
                       f"width {group.dp} in {self.clock() - started:.2f} s")
            self.reconciler.observe(Formed(key, group.epoch), self.clock())

    def _form_failed(self, action: Form, e: Exception) -> None:
        self._forming.pop(action.key, None)
        group = self.groups[action.key]
        log.warning("group_form_failed", group=str(action.key), epoch=group.epoch,
                    attempt=action.attempt, width=action.width, error=repr(e)[:300])
        self._note("form_failed", action.key, group.epoch, repr(e)[:200])
        self.reconciler.observe(FormFailed(action.key, group.epoch, repr(e)[:500],
                                           short=isinstance(e, CapacityShort)), self.clock())

    def _give_up(self, action: GiveUp) -> None:
        deaths = [d for ds in self.deaths.values() for d in ds]
        epoch = max(g.epoch for g in self.groups.values())
        self.failure = GroupFailure(epoch, deaths or [RankDeath(-1, epoch, r)
                                                      for r in action.reasons[-3:]])
        log.error("recovery_gave_up", restarts=action.restarts, error=str(self.failure)[:300])
        raise self.failure

    def _note(self, what: str, key: Hashable, epoch: int, why: str) -> None:
        self.events.append((time.time(), what, str(key), epoch, why))
        del self.events[:-256]
