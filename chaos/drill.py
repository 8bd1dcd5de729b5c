"""A kill drill: streamed load through an SDK client while rank processes are SIGKILLed
from outside at seeded random moments, then every stream checked against a fault-free
reference (Jepsen-style: each stream's text must equal the reference's, so no token is
lost, repeated, reordered or changed; an error is allowed only where the drill expects
the service to give up, and then only as a clean 503).

    plan = [Kill(role="decode"), Kill(during_formation=True), Kill(during_formation=True)]
    report = await run_drill(client, requests, references, plan, seed=3)

`client`: an `AsyncClient` or `LocalClient` (anything with `stream(prompt, **params)`).
The killer runs on its own thread and finds its victims through Ray's state
(`ranks.rank_processes`); a `during_formation` kill waits for rank processes that did
not exist before (a group being re-formed: its new ranks are loading or meeting) and
kills one of them at once or after a short random delay.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .ranks import RankProcess, rank_processes, sigkill

__all__ = ["Kill", "StreamResult", "DrillReport", "Killer", "run_drill", "percentile",
           "streamed_requests"]


@dataclass(frozen=True, slots=True)
class Kill:
    """One step of a kill plan: `count` rank processes of `role` ("group", "prefill",
    "decode"; None: any; a tuple: one of each) after a random delay in `delay_s`, or
    (`during_formation`) among ranks that appear after this step starts."""

    role: Optional[str | tuple[str, ...]] = None
    count: int = 1
    delay_s: tuple[float, float] = (0.0, 0.3)
    during_formation: bool = False
    wait_s: float = 60.0  # the longest a during_formation step waits for new ranks


@dataclass(slots=True)
class StreamResult:
    text: str = ""
    chunks: int = 0
    times: list = field(default_factory=list)  # arrival of each chunk (time.time())
    error: Optional[Any] = None  # the APIError that ended it, if any

    @property
    def stall_s(self) -> float:
        """The longest gap between two chunks of the stream."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return max(gaps, default=0.0)


@dataclass(slots=True)
class DrillReport:
    streams: int = 0
    identical: int = 0
    mismatched: list = field(default_factory=list)  # indexes of streams whose text differs
    errors: list = field(default_factory=list)  # (index, status, code)
    kills: list = field(default_factory=list)  # (time.time(), pid, class, step, note)
    stalls: list = field(default_factory=list)  # per stream, seconds
    seconds: float = 0.0
    killer_error: str = ""
    resumed_s: Optional[float] = None  # last kill -> the next chunk of any stream
    arrivals: list = field(default_factory=list)  # every chunk's arrival, sorted

    def summary(self) -> dict:
        return {"streams": self.streams, "identical": self.identical,
                "mismatched": self.mismatched, "errors": self.errors, "kills": len(self.kills),
                "stall_p50_s": percentile(self.stalls, 50), "stall_p99_s": percentile(self.stalls, 99),
                "seconds": round(self.seconds, 2), "resumed_s": self.resumed_s,
                "killer_error": self.killer_error}


def streamed_requests(n: int, vocab: int, max_tokens: int, rng: random.Random
                      ) -> list[tuple[list[int], dict]]:
    """`n` (prompt token ids, request body) pairs: prompts of 4-60 random tokens,
    `max_tokens` each with `ignore_eos`; even ones greedy, odd ones sampled at
    temperature 0.8 with a seed of their own (the body's keys are `SamplingParams`
    fields too, so a reference run takes `SamplingParams(**body)`)."""
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab - 8) for _ in range(rng.randint(4, 60))]
        body = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        if i % 2:
            body.update(temperature=0.8, seed=rng.randrange(1 << 30))
        out.append((prompt, body))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))], 3)


class Killer(threading.Thread):
    """Carries out a kill plan once `go` is set; `kills` records what it did."""

    def __init__(self, plan: Sequence[Kill], seed: int, poll_s: float = 0.02) -> None:
        super().__init__(name="phalanx-killer", daemon=True)
        self.plan, self.rng, self.poll_s = list(plan), random.Random(seed), poll_s
        self.go, self.stop = threading.Event(), threading.Event()
        self.kills: list[tuple[float, int, str, int, str]] = []  # (time.time(), ...)
        self.error = ""
        self._seen: set[int] = set()

    def run(self) -> None:
        try:
            self.go.wait()
            self._seen = {r.pid for r in rank_processes()}
            for i, step in enumerate(self.plan):
                self._carry_out(i, step)
                if self.stop.is_set() or self.error:
                    return
        except Exception as e:  # noqa: BLE001 - reported in the drill's result
            self.error = f"{type(e).__name__}: {e}"

    def _carry_out(self, i: int, step: Kill) -> None:
        """Kill the step's victims; a victim already gone (its group's fence killed it
        first) is chosen again among those alive."""
        note = "during formation" if step.during_formation else "serving"
        while not self.stop.is_set():
            victims = self._victims(step)
            if not victims:
                if not self.stop.is_set():
                    self.error = f"step {i}: no rank process of role {step.role!r} to kill"
                return
            self._sleep(self.rng.uniform(*step.delay_s))
            killed = [v for v in victims if sigkill(v.pid)]
            now = time.time()
            self.kills += [(now, v.pid, v.class_name, i, note) for v in killed]
            if killed:
                return

    def _sleep(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def _victims(self, step: Kill) -> list[RankProcess]:
        end = time.monotonic() + step.wait_s
        while not self.stop.is_set() and time.monotonic() < end:
            alive = rank_processes()
            pool = [r for r in alive if r.pid not in self._seen] if step.during_formation else alive
            self._seen.update(r.pid for r in alive)
            chosen = self._choose(pool, step)
            if chosen:
                return chosen
            self._sleep(self.poll_s)
        return []

    def _choose(self, pool: list[RankProcess], step: Kill) -> list[RankProcess]:
        roles = step.role if isinstance(step.role, tuple) else (step.role,) * step.count
        picked: list[RankProcess] = []
        for role in roles:
            left = [r for r in pool if (role is None or r.role == role) and r not in picked]
            if not left:
                return []
            picked.append(self.rng.choice(left))
        return picked


def _resumed_after(results: Sequence[StreamResult], kills: Sequence[float]) -> Optional[float]:
    if not kills:
        return None
    last = max(kills)
    after = [t for r in results for t in r.times if t > last]
    return round(min(after) - last, 3) if after else None


async def _stream(client: Any, prompt: Any, params: dict, result: StreamResult,
                  first: threading.Event) -> None:
    try:
        async for chunk in client.stream(prompt, **params):
            result.text += chunk.text
            result.chunks += 1
            result.times.append(time.time())
            first.set()
    except Exception as e:  # noqa: BLE001 - the checker judges it
        result.error = e


async def run_drill(client: Any, requests: Sequence[tuple[Any, dict]],
                    references: Sequence[str], plan: Sequence[Kill], seed: int,
                    timeout_s: float = 300.0) -> DrillReport:
    """Stream every request at once, kill as `plan` says once the first chunk arrived,
    and check each stream against its reference text."""
    killer = Killer(plan, seed)
    killer.start()
    results = [StreamResult() for _ in requests]
    t0 = time.monotonic()
    go = killer.go
    try:
        await asyncio.wait_for(asyncio.gather(*(
            _stream(client, prompt, params, r, go) for (prompt, params), r in zip(requests, results))),
            timeout_s)
    finally:
        killer.stop.set()
        go.set()
        killer.join(5.0)
    report = DrillReport(streams=len(requests), seconds=time.monotonic() - t0,
                         kills=list(killer.kills), killer_error=killer.error)
    report.resumed_s = _resumed_after(results, [k[0] for k in killer.kills])
    report.arrivals = sorted(t for r in results for t in r.times)
    for i, (r, ref) in enumerate(zip(results, references)):
        report.stalls.append(r.stall_s)
        if r.error is not None:
            report.errors.append((i, getattr(r.error, "status", None),
                                  getattr(r.error, "code", repr(r.error)[:120])))
        elif r.text == ref:
            report.identical += 1
        else:
            report.mismatched.append(i)
    return report
