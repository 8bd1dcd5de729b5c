"""Admission at the router: past saturation, requests wait here, not in a group's queue,
and a group with room takes the waiting request it serves best.

Why: a request routed at once to a saturated group waits there, and while it waits the
group's prefix cache turns over; the match the router saw is gone by the time its
prefill starts (with little cache per group, a conversation's pages rarely survive a
queue). Held here, a request is placed when a group can start it soon, on what the
groups hold then, and the group that frees up takes the request that loses least by
going there: its own conversations first, then requests no group holds more of, then
the others' (only after they have waited).

Contract:
- `hold(record)` queues a prepared record (`Router.prepare`); `drop(request_id)` takes
  it back (an abort). A held request has no placement and no load anywhere.
- A DP group has room while the router's own accounting (`PlacementPool.routed`: routed
  and not finished; uncached prompt tokens not yet prefilled) is under both
  `max_requests` and `max_queued_tokens`. With `max_requests = 0` every group always
  has room: `place` routes everything at once, in arrival order (no hold).
- `place()` routes held requests while some group has room, and returns them with their
  group, in the order they were placed. Each pick looks at the `window` oldest held
  requests; a request's preference for the groups with room is
  `page_size * (best match among them - best match among the others) +
  wait_tokens_per_s * seconds held`; the request with the largest goes first (ties: the
  oldest), and the routing policy chooses its group among the groups with room. A request
  whose preference is below `-move_tokens` (it would lose more of its prefix than that
  plus its wait's worth) is not placed: it waits for a group that holds it, or until it
  has waited long enough.
- The caller calls `place()` after anything that can make room (a request finished, a
  prefill done, a load report, a group added) and after `hold`.
- Pure logic, one thread (like the router).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from itertools import islice
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from .pool import PlacementPool
from .request import RequestRecord
from .router import Router


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """When requests wait at the router (see the module docstring); the default holds none."""

    max_requests: int = 0  # requests a DP group may hold (0: no hold)
    max_queued_tokens: int = 2048  # uncached prompt tokens a group may have queued
    window: int = 1024  # held requests looked at per pick, the oldest
    wait_tokens_per_s: float = 128.0  # a second held counts as this many matched tokens
    move_tokens: int = 1024  # cached tokens a held request may lose by going elsewhere

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_queued_tokens", "window", "move_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"AdmissionConfig.{name} must be an integer >= 0, got {v!r}")
        if self.window < 1:
            raise ValueError(f"AdmissionConfig.window must be at least 1, got {self.window}")
        if self.max_requests and self.max_queued_tokens < 1:
            raise ValueError("AdmissionConfig.max_queued_tokens must be at least 1 when "
                             "requests are held")
        w = self.wait_tokens_per_s
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0:
            raise ValueError(f"AdmissionConfig.wait_tokens_per_s must be >= 0, got {w!r}")

    @property
    def holds(self) -> bool:
        return self.max_requests > 0


class Admission:
    """Requests held before routing (see the module docstring)."""

    def __init__(self, router: Router, config: AdmissionConfig = AdmissionConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router, self.config, self._clock = router, config, clock
        self._held: OrderedDict[str, tuple[RequestRecord, float]] = OrderedDict()
        self.placed = 0  # requests placed by `place`
        self.wait_s = 0.0  # their seconds held, summed
        self.picks = 0  # picks among held requests (holding only)
        self.pick_s = 0.0  # seconds those picks took (time.perf_counter), summed

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def hold(self, record: RequestRecord) -> None:
        rid = record.request_id
        if rid in self._held:
            raise ValueError(f"request {rid!r} is already held")
        if record.state.terminal:
            raise ValueError(f"request {rid!r} has ended; it cannot be held")
        self._held[rid] = (record, self._clock())

    def drop(self, request_id: str) -> Optional[RequestRecord]:
        entry = self._held.pop(request_id, None)
        return entry[0] if entry else None

    def drop_all(self) -> list[RequestRecord]:
        """Takes back every held request (stop, failure), oldest first."""
        records = [record for record, _ in self._held.values()]
        self._held.clear()
        return records

    def has_room(self, group: Hashable) -> bool:
        cfg = self.config
        if not cfg.holds:
            return True
        requests, tokens = self.router.decode.routed(group)
        return requests < cfg.max_requests and tokens < cfg.max_queued_tokens

    def place(self) -> list[tuple[RequestRecord, Hashable]]:
        out: list[tuple[RequestRecord, Hashable]] = []
        pool = self.router.decode
        while self._held:
            groups = pool.targets
            room = [g for g in groups if self.has_room(g)]
            if not room:
                break
            if self.config.holds:
                t0 = time.perf_counter()
                rid = self._pick(pool, room)
                self.picks += 1
                self.pick_s += time.perf_counter() - t0
                if rid is None:
                    break
            else:
                rid = next(iter(self._held))
            record, since = self._held.pop(rid)
            full = [g for g in groups if g not in room]
            group = self.router.route(record, exclude=full)
            self.placed += 1
            self.wait_s += self._clock() - since
            out.append((record, group))
        return out

    def _pick(self, pool: PlacementPool, room: list[Hashable]) -> Optional[str]:
        """The held request (of the `window` oldest) that the groups in `room` serve best;
        None if every one of them would rather wait."""
        cfg, tree = self.config, pool.tree
        ps, now, per_s = tree.page_size, self._clock(), cfg.wait_tokens_per_s
        match, page_hashes, room = tree.match_pages, self.router.page_hashes, set(room)
        best_rid, best = None, -float(cfg.move_tokens) - 1e-9
        # One plain loop per held request (a pick scans up to `window` of them): the
        # longest match among the groups with room (inside) and among the others.
        for rid, (record, since) in islice(self._held.items(), cfg.window):
            inside = outside = 0
            for g, n in match(page_hashes(record, pool)).items():
                if g in room:
                    if n > inside:
                        inside = n
                elif n > outside:
                    outside = n
            score = ps * (inside - outside) + per_s * (now - since)
            if score > best:
                best_rid, best = rid, score
        return best_rid


__all__ = ["Admission", "AdmissionConfig"]
