"""Replays a trace through a `Router` against a simulated prefix cache per DP group, and
measures what the placement achieved (tests and `bench/router.py`; not used when serving).

The simulated cache of a group (`SimulatedKV`) is an LRU set of page chain hashes with a
fixed capacity, like a block pool whose pages all sit cached: a prompt hits the longest
run of its pages, from the first, that the chosen group still holds. That — not the
router's own tree — is what the hit rate counts. A request occupies its group from its
arrival through its prefill (uncached tokens at a fixed rate; then `prefill_done`) and
its answer (`duration_s`); then the group caches prompt + answer, the record gets its
tokens and the router is told `finish`. Every `refresh_every` arrivals each group reports
the hashes it holds (`Router.refresh_prefixes`).

Loads are the router's view (`Router.load`, as `load_tokens`): at every decision, after
routing, the spread `max - min` over the groups is recorded; `work` counts, per group, the
prompt tokens it had to compute (misses), over the whole run.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

from ..policies import load_tokens
from .prefix_tree import page_hashes
from .request import RequestRecord
from .request_table import RequestTable
from .router import Router
from .trace import TraceRequest


class SimulatedKV:
    """One group's prefix cache: at most `capacity_pages` page hashes, LRU-evicted."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = capacity_pages
        self._pages: OrderedDict[int, None] = OrderedDict()

    def match_pages(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._pages:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> list[int]:
        """Caches a chain, most recent; leaves are touched first so they go first.
        Returns the hashes it evicted, oldest first."""
        pages = self._pages
        for h in reversed(hashes[:self.capacity_pages]):
            pages[h] = None
            pages.move_to_end(h)
        evicted = []
        while len(pages) > self.capacity_pages:
            evicted.append(pages.popitem(last=False)[0])
        return evicted

    def held(self) -> set[int]:
        return set(self._pages)


@dataclass(slots=True)
class ReplayResult:
    """What one replay measured (see the module docstring)."""

    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    estimated_hit_tokens: int = 0
    decision_ns: list[int] = field(default_factory=list)  # Router.route, hashes given
    hash_ns: list[int] = field(default_factory=list)  # Router.prepare: hashing the prompt
    decision_tokens: list[int] = field(default_factory=list)  # tokens routed, per decision
    spreads: list[int] = field(default_factory=list)
    work: dict[Hashable, int] = field(default_factory=dict)
    routed: dict[Hashable, int] = field(default_factory=dict)
    after_removal: dict[Hashable, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def estimated_hit_rate(self) -> float:
        return self.estimated_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_spread(self) -> int:
        return max(self.spreads, default=0)

    def summary(self) -> dict:
        work = list(self.work.values())
        both = [a + b for a, b in zip(self.decision_ns, self.hash_ns)]
        return dict(
            policy=self.policy, requests=self.requests, prompt_tokens=self.prompt_tokens,
            hit_rate=self.hit_rate, router_estimated_hit_rate=self.estimated_hit_rate,
            **_speed("decision", self.decision_ns, "decisions_per_s"),
            **_speed("hash", self.hash_ns, "hashes_per_s"),
            **_speed("hash_and_decision", both, "hash_and_decisions_per_s"),
            max_load_spread=self.max_spread,
            mean_load_spread=sum(self.spreads) / len(self.spreads) if self.spreads else 0.0,
            work_tokens={str(g): w for g, w in self.work.items()},
            work_max_over_min=max(work) / max(1, min(work)) if work else 0.0,
            work_max_minus_min=max(work) - min(work) if work else 0,
            routed={str(g): n for g, n in self.routed.items()})


def _speed(name: str, ns: list[int], rate_key: str) -> dict[str, float]:
    """p50 and p99 (us) of the times `ns`, and (`rate_key`) how many fit in a second."""
    ns = sorted(ns)
    total_s = sum(ns) / 1e9
    return {rate_key: len(ns) / total_s if total_s else 0.0,
            f"p50_{name}_us": ns[len(ns) // 2] / 1e3 if ns else 0.0,
            f"p99_{name}_us": ns[min(len(ns) - 1, int(0.99 * len(ns)))] / 1e3 if ns else 0.0}


def replay(router: Router, trace: Iterable[TraceRequest], *, kv_pages: int,
           refresh_every: int = 64, prefill_tokens_per_s: float = 20000.0,
           running_cost_tokens: int = 256, remove_at: Optional[dict[int, Hashable]] = None,
           policy: str = "") -> ReplayResult:
    """Runs `trace` through `router` (its groups already added).

    A request's prefill takes `uncached tokens / prefill_tokens_per_s` (then
    `Router.prefill_done`); its answer ends at `arrival + prefill + duration` (then
    `Router.finish`). Spreads are of `load_tokens(load, running_cost_tokens)`.
    `remove_at` maps an arrival number to a group removed just before that arrival is
    routed; its in-flight requests are requeued and routed again from their resume
    tokens, as after a fault.
    """
    ps = router.decode.tree.page_size
    groups = list(router.groups)
    sim = _Sim(router, {g: SimulatedKV(kv_pages) for g in groups}, ps, prefill_tokens_per_s)
    res = ReplayResult(policy=policy or router.decode.policy_name,
                       work={g: 0 for g in groups}, routed={g: 0 for g in groups})
    clock = time.perf_counter_ns
    for i, req in enumerate(trace):
        sim.advance(req.arrival_s)
        if remove_at and i in remove_at:
            sim.remove_group(remove_at[i], req.arrival_s, res)
        rec = sim.table.create(req.request_id, req.prompt)
        sim.trace_of[req.request_id] = req
        t0 = clock()
        router.prepare(rec)  # admission: the prompt's pages hashed once, onto the record
        t1 = clock()
        router.route(rec)
        res.decision_ns.append(clock() - t1)
        res.hash_ns.append(t1 - t0)
        res.decision_tokens.append(len(req.prompt))
        sim.start(rec, req.arrival_s, res)
        loads = [load_tokens(router.load(x), running_cost_tokens) for x in router.groups]
        res.spreads.append(max(loads) - min(loads))
        if refresh_every and (i + 1) % refresh_every == 0:
            for x in router.groups:
                router.refresh_prefixes(x, sim.kv[x].held(), as_of=router.prefix_clock)
    sim.advance(float("inf"))
    res.estimated_hit_tokens = router.decode.stats.matched_tokens
    return res


class _Sim:
    """The simulated cluster of one replay: caches, records, and pending events."""

    def __init__(self, router: Router, kv: dict[Hashable, SimulatedKV], page_size: int,
                 prefill_tokens_per_s: float = 20000.0) -> None:
        self.router, self.kv, self.ps = router, kv, page_size
        self.rate = prefill_tokens_per_s
        self.table = RequestTable()
        self.trace_of: dict[str, TraceRequest] = {}
        self.events: list[tuple[float, int, str, str, int]] = []  # time, seq, kind, id, gen
        self.seq = 0
        self.removed = False

    def _push(self, t: float, kind: str, rec: RequestRecord) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, rec.request_id, rec.recoveries))

    def start(self, rec: RequestRecord, now: float, res: ReplayResult) -> None:
        """Accounts the hit on the chosen group's cache and schedules the request."""
        g, req = rec.dp_group, self.trace_of[rec.request_id]
        tokens = rec.resume_tokens()
        hashes = page_hashes(tokens, self.ps)
        hit = self.kv[g].match_pages(hashes) * self.ps
        self.kv[g].insert(hashes)
        res.requests += 1
        res.prompt_tokens += len(tokens)
        res.hit_tokens += hit
        res.work[g] += len(tokens) - hit
        res.routed[g] += 1
        if self.removed:
            res.after_removal[g] = res.after_removal.get(g, 0) + 1
        t_prefill = now + (len(tokens) - hit) / self.rate
        left = len(req.output) - rec.next_index
        self._push(t_prefill, "prefill_done", rec)
        self._push(t_prefill + req.duration_s * left / len(req.output), "finish", rec)

    def advance(self, now: float) -> None:
        """Runs every event due by `now`."""
        while self.events and self.events[0][0] <= now:
            _, _, kind, rid, gen = heapq.heappop(self.events)
            rec = self.table.find(rid)
            if rec is None or rec.recoveries != gen:
                continue  # an event of a placement the request has left
            if kind == "prefill_done":
                self.router.prefill_done(rec)
            else:
                self._finish(rec)

    def _finish(self, rec: RequestRecord) -> None:
        req = self.trace_of.pop(rec.request_id)
        rec.accept(0, req.output, finished=True, finish_reason="stop")
        self.kv[rec.dp_group].insert(page_hashes(rec.resume_tokens(), self.ps))
        self.router.finish(rec)
        self.table.remove(rec.request_id)

    def remove_group(self, group: Hashable, now: float, res: ReplayResult) -> None:
        """Takes `group` away; its requests resume elsewhere (first half of the answer
        already streamed, as if it died mid-decode)."""
        self.removed = True
        for rid in self.router.remove_group(group):
            rec = self.table.get(rid)
            req = self.trace_of[rid]
            half = len(req.output) // 2
            rec.accept(rec.next_index, req.output[rec.next_index:half])
            rec.requeue()
            self.router.route(rec)
            self.start(rec, now, res)


__all__ = ["ReplayResult", "SimulatedKV", "replay"]
