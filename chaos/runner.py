"""A chaos drill against a serving phalanx: a reference pass without faults, then a
closed-loop streamed workload for `duration_s` while the schedule's faults are injected
from outside, every stream checked against its reference as it ends.

    drill = Drill(client, DrillConfig(duration_s=60, faults=(parse_fault("kill-rank:every=15s"),)),
                  stats=backend_stats)
    references = await drill.reference()
    result = await drill.run(references)

`client`: an SDK `AsyncClient` (a server's URL) or `LocalClient`; `stats()`: the server's
serving stats (`recoveries`, `healthy`, ...: `/metrics` or the backend's), polled every
second for the timeline's recovery marks and to learn whether the service gave up (then,
and only then, a clean 503 passes the check). The faults run on their own thread
(`FaultThread`): time-tied ones at their planned moments, `at=recovery` ones on the ranks
of a group being re-formed (rank actors that appear during the drill; not on the
re-formation such a fault itself causes, so they do not chain).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .checker import Verdict, check_stream
from .faults import FaultSpec
from .injectors import Injected, Injectors, NoVictim
from .schedule import planned
from .workload import ChaosRequest, StreamRecord, make_requests, stream_request

__all__ = ["Drill", "DrillConfig", "DrillResult", "FaultThread"]

STATS_EVERY_S = 1.0
VICTIM_WAIT_S = 10.0  # a planned fault with no victim at its time is tried this long
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class DrillConfig:
    duration_s: float = 60.0
    faults: tuple[FaultSpec, ...] = ()
    seed: int = 0
    requests: int = 48  # distinct requests; the workload cycles through them
    concurrency: int = 8

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.requests < 1 or self.concurrency < 1:
            raise ValueError("duration_s must be > 0, requests and concurrency >= 1")


@dataclass(slots=True)
class DrillResult:
    config: DrillConfig
    started: float = 0.0
    seconds: float = 0.0
    records: list = field(default_factory=list)  # StreamRecord per finished stream
    verdicts: list = field(default_factory=list)  # Verdict per record
    injected: list = field(default_factory=list)  # Injected
    skipped: list = field(default_factory=list)  # (time, spec, why): nothing to apply it to
    marks: list = field(default_factory=list)  # (time, "re-forming" | "recovered" | "width", note)
    service_gave_up: bool = False
    fault_errors: list = field(default_factory=list)  # injector failures (not NoVictim)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts) and not self.fault_errors


class FaultThread(threading.Thread):
    """Injects the drill's faults from `go` on; `stop` ends it."""

    def __init__(self, faults: Sequence[FaultSpec], duration_s: float, seed: int,
                 result: DrillResult) -> None:
        super().__init__(name="phalanx-chaos-faults", daemon=True)
        self.plan = planned(faults, duration_s, seed)
        self.on_recovery = [f for f in faults if "recovery" in f.at_events]
        self.injectors = Injectors(seed)
        self.result = result
        self.go, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        self.go.wait()
        t0 = time.time()
        watching = bool(self.plan or self.on_recovery)  # new ranks: a group re-forming
        chained = False
        known = self._ranks()
        pending = list(self.plan)
        while not self.stop.is_set():
            while pending and time.time() - t0 >= pending[0].t:
                due = pending.pop(0)
                late = time.time() - t0 - due.t
                if not self._inject(due.spec, final=late >= VICTIM_WAIT_S):
                    pending.insert(0, due)  # tried again next round
                    break
            if watching:
                fresh = self._ranks() - known
                if fresh:
                    known |= fresh
                    self.result.marks.append((time.time(), "re-forming", f"{len(fresh)} new rank(s)"))
                    if chained:  # the re-formation an at=recovery fault itself caused
                        chained = False
                    elif self.on_recovery:
                        chained = True
                        for spec in self.on_recovery:
                            self._inject(spec, fresh)
            self.stop.wait(0.2)
        self.injectors.resume_all()

    def _ranks(self) -> set[str]:
        if not (self.plan or self.on_recovery):
            return set()
        from .ranks import rank_processes
        return {r.actor_id for r in rank_processes()}

    def _inject(self, spec: FaultSpec, only: Optional[set[str]] = None,
                final: bool = True) -> bool:
        """Apply `spec`; False when there was no victim and it may be tried again
        (`final` False: a planned fault waits up to `VICTIM_WAIT_S` for one, e.g. while
        the group it needs is being re-formed)."""
        try:
            self.result.injected.append(self.injectors.inject(spec, only))
        except NoVictim as e:
            if not final:
                return False
            self.result.skipped.append((time.time(), spec.text, str(e)))
        except Exception as e:  # noqa: BLE001 - reported: the drill then fails
            self.result.fault_errors.append((time.time(), spec.text, f"{type(e).__name__}: {e}"))
        return True


class Drill:
    """One drill (see the module doc)."""

    def __init__(self, client: Any, config: DrillConfig,
                 stats: Optional[Callable[[], Awaitable[dict]]] = None,
                 progress: Callable[[str], None] = lambda line: None) -> None:
        self.client, self.config, self.stats, self.say = client, config, stats, progress
        self.requests: list[ChaosRequest] = make_requests(config.requests, config.seed)

    async def reference(self) -> list[list[int]]:
        """Every request's tokens without faults (the server before the drill); a
        failing request here is the server's problem, not the drill's: RuntimeError."""
        sem = asyncio.Semaphore(self.config.concurrency)

        async def one(i: int, req: ChaosRequest) -> list[int]:
            async with sem:
                rec = await stream_request(self.client, i, req, cut=False)
            if rec.error is not None:
                raise RuntimeError(f"reference request {i} failed without faults: {rec.error}")
            return [t for c in rec.chunks for t in c]

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(self.requests))))

    async def run(self, references: Sequence[Sequence[int]]) -> DrillResult:
        cfg = self.config
        result = DrillResult(cfg, started=time.time())
        faults = FaultThread(cfg.faults, cfg.duration_s, cfg.seed, result)
        faults.start()
        end = time.monotonic() + cfg.duration_s
        order = itertools.count()
        in_flight = [0]

        async def worker() -> None:
            while time.monotonic() < end:
                i = next(order) % len(self.requests)
                in_flight[0] += 1
                rec = await stream_request(self.client, i, self.requests[i])
                in_flight[0] -= 1
                result.records.append(rec)
                result.verdicts.append(self._verdict(rec, references[i], result))

        watch = asyncio.create_task(self._watch(result, in_flight, end))
        faults.go.set()
        try:
            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        finally:
            faults.stop.set()
            faults.join(10.0)
            watch.cancel()
        await self._poll_stats(result)
        result.seconds = time.time() - result.started
        # a stream that ended with a 503 before the service was seen giving up is
        # judged again now that the drill knows
        result.verdicts = [self._verdict(r, references[r.request], result) for r in result.records]
        return result

    def _verdict(self, rec: StreamRecord, reference: Sequence[int], result: DrillResult) -> Verdict:
        return check_stream(reference, rec.chunks, rec.error, rec.cut_off, result.service_gave_up)

    async def _watch(self, result: DrillResult, in_flight: list, end: float) -> None:
        last_say = time.monotonic()
        while True:
            await self._poll_stats(result)
            if time.monotonic() - last_say >= PROGRESS_EVERY_S:
                last_say = time.monotonic()
                self.say(_progress_line(result, in_flight[0], max(0.0, end - time.monotonic())))
            await asyncio.sleep(STATS_EVERY_S)

    async def _poll_stats(self, result: DrillResult) -> None:
        if self.stats is None:
            return
        try:
            stats = await self.stats()
        except Exception:  # noqa: BLE001 - a server busy re-forming may not answer at once
            return
        seen = getattr(self, "_recoveries", None)
        now = float(stats.get("recoveries", 0.0))
        if seen is not None and now > seen:
            result.marks.append((time.time(), "recovered", f"recoveries {seen:g} -> {now:g}"))
        self._recoveries = now
        width, before = stats.get("width"), getattr(self, "_width", None)
        if width is not None and before is not None and width != before:
            result.marks.append((time.time(), "width", f"DP width {before:g} -> {width:g}"))
        self._width = width if width is not None else before
        if float(stats.get("healthy", 1.0)) == 0.0:
            result.service_gave_up = True


def _progress_line(result: DrillResult, in_flight: int, left_s: float) -> str:
    bad = sum(not v.passed for v in result.verdicts)
    tokens = sum(r.tokens for r in result.records)
    elapsed = max(1e-9, time.time() - result.started)
    return (f"  {elapsed:5.0f} s  streams {len(result.records)} done, {bad} failing, "
            f"{in_flight} in flight; faults {len(result.injected)} "
            f"(+{len(result.skipped)} skipped); {tokens / elapsed:.0f} tok/s; {left_s:.0f} s left")
