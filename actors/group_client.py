"""Drive a multi-rank group (TP or DP×EP) from the caller's process.

Requests go to the DP leaders (round-robin unless told otherwise); outputs are polled
from all of them. If any rank fails or dies, every survivor leaves its collective within
the deadline and the group is re-formed under a new epoch (ARCHITECTURE §5): the
requests it held resume from prompt + the tokens the caller already has (`resume`), so
the caller sees each token once and the same tokens as without the fault. Past
`max_recoveries` replacements (or with 0), the caller gets a `GroupFailure` naming the
ranks and the epoch instead: never a hang.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import ray
from ray.exceptions import RayActorError

from .supervisor import GroupFailure, GroupSupervisor, ensure_ray, settle
from ..config import EngineConfig
from ..engine.outputs import StepOutput
from ..engine.rank_spec import RankFailure
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from .held_reports import HeldReports
from .resume import resume_from

log = get_logger(__name__)

POLL_S = 0.05
VIEW_TIMEOUT_S = 10.0  # stats / held prefixes / node ids: answered off the step loop


def _node_id(actor_self) -> str:
    return ray.get_runtime_context().get_node_id()


class GroupReformed(RuntimeError):
    """The group failed during a call and was replaced; the call's work is void (the
    requests it held were resumed on the new group)."""


def actor_nodes(actors: Sequence) -> list[str]:
    """The Ray node id (hex) each actor runs on, in the order given."""
    return ray.get([a.__ray_call__.remote(_node_id) for a in actors], timeout=VIEW_TIMEOUT_S)


@dataclass(slots=True)
class _Live:
    """A request the group holds: enough to resume it on a re-formed group."""

    prompt: list[int]
    params: SamplingParams  # as submitted, with the seed it samples with
    arrival: int
    emitted: list[int] = field(default_factory=list)  # tokens the caller has, in order
    base: int = 0  # caller's output index of the current run's first token
    dp_rank: int = -1


class GroupClient:
    """Submit / poll / abort over the leaders of one group; `close()` stops it.
    `recoveries`: groups re-formed so far; `max_recoveries` (default: the config's): the
    most it re-forms."""

    def __init__(self, config: EngineConfig, tp: int, dp: int, deadline_s: float,
                 ray_address: Optional[str] = None, actor_cls=None,
                 max_recoveries: Optional[int] = None) -> None:
        ensure_ray(num_cpus=max(8, 2 * tp * dp), address=ray_address)
        self.supervisor = GroupSupervisor(config, tp, dp, deadline_s, actor_cls=actor_cls)
        self.supervisor.form()
        self._rr = itertools.count()
        self.place: Callable[[str], int] = lambda rid: next(self._rr) % dp
        self._live: dict[str, _Live] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._pending: dict = {}  # outstanding poll call -> leader index
        self.recoveries = 0
        self.max_recoveries = (config.parallel.max_recoveries if max_recoveries is None
                               else max_recoveries)
        self._held = HeldReports()

    @property
    def epoch(self) -> int:
        return self.supervisor.epoch

    def submit(self, request_id: str, tokens: Sequence[int], params: SamplingParams) -> None:
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not params.greedy and params.seed is None:  # a resumed run must draw the same
            params = params.with_seed(self._seeds.getrandbits(63))
        live = _Live(list(tokens), params, next(self._arrivals))
        while True:
            try:
                self._start(request_id, live, list(tokens), params)
                return
            except GroupReformed:  # the new group holds everything else; add this one
                continue

    def _start(self, request_id: str, live: _Live, tokens: list[int],
               params: SamplingParams) -> None:
        dp_rank = self.place(request_id)
        leader = self.supervisor.leaders[dp_rank]
        self._call(lambda: ray.get(leader.submit.remote(request_id, tokens, params)))
        live.dp_rank = dp_rank
        self._live[request_id] = live

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None and live.dp_rank >= 0:
            self.supervisor.leaders[live.dp_rank].abort.remote(request_id)

    def poll(self) -> list[StepOutput]:
        """Outputs of whichever leaders have some, waiting at most ~`POLL_S`.

        One poll call stays outstanding per leader; as soon as any returns, its outputs
        are taken and its call re-issued, so a quiet leader never delays a busy one. Each
        output's index is the caller's (it continues across a recovery)."""
        leaders = self.supervisor.leaders
        for i, leader in enumerate(leaders):
            if i not in self._pending.values():
                self._pending[leader.poll.remote(POLL_S)] = i
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=2 * POLL_S)
        if ready:  # take every call that has finished by now, not just the first
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        outs = []
        try:
            for ref in ready:
                self._pending.pop(ref)
                outs.append(self._call(lambda: ray.get(ref)))
        except GroupReformed:
            return []  # this poll's outputs are void; the new group continues the requests
        # Fencing: a result of another epoch never reaches the caller.
        merged = [o for batch in outs for o in batch if o.epoch == self.epoch]
        for o in merged:
            live = self._live.get(o.request_id)
            if live is None:
                continue
            if o.index >= 0:
                o.index += live.base
            live.emitted.extend(o.new_token_ids)
            if o.finished:
                del self._live[o.request_id]
        return merged

    def _call(self, fn):
        """Run a call on the group. On a rank failure: re-form the group and raise
        `GroupReformed`, or past `max_recoveries` raise `GroupFailure`."""
        try:
            return fn()
        except (RankFailure, RayActorError) as e:
            failure = self._failure()
            if self.recoveries >= self.max_recoveries:
                raise failure from e
            self._recover(failure)
            raise GroupReformed(str(failure)) from e

    def _failure(self) -> GroupFailure:
        """Collect what the supervisor learns within the deadline (plus slack)."""
        deaths = self.supervisor.wait_for_failure(self.supervisor.deadline_s + 5.0)
        return GroupFailure(self.epoch, deaths)

    def _recover(self, failure: GroupFailure) -> None:
        """Replace the group (new epoch); resume what it held, in arrival order."""
        log.warning("group_recovery", epoch=self.epoch, tp=self.supervisor.tp,
                    dp=self.supervisor.dp, deaths=[(d.rank, d.reason[:120]) for d in failure.deaths])
        self.supervisor.shutdown()
        settle(self._pending)
        self._pending = {}
        self.supervisor.form()
        self.recoveries += 1
        # Every held request stays in `_live` until restarted: a failure in this loop
        # recovers again (nested) and resumes all of them from what the caller has.
        held = sorted(self._live.items(), key=lambda kv: kv[1].arrival)
        for request_id, live in held:
            tokens, params, live.base = resume_from(live.prompt, live.params, live.emitted)
            try:
                self._start(request_id, live, tokens, params)
            except GroupReformed:  # failed again meanwhile: that recovery resumed the rest
                return

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.supervisor.actors])

    # -- read-only views for a router (serving) --------------------------------------
    def topology(self) -> dict:
        """What a router places over: `dp` groups (index = DP rank), no prefill
        instances, the KV page size and the fewest KV pages of a DP leader."""
        sup = self.supervisor
        page_size = sup.config.cache.page_size
        pages = [info.get("num_pages", 0) for info in sup.start_info[::sup.tp]]
        return {"dp": sup.dp, "prefill_instances": 0, "page_size": page_size,
                "prefill_page_size": page_size, "num_pages": min(pages, default=0),
                "prefill_num_pages": 0}

    def leader_stats(self) -> dict:
        """`{"decode": [engine stats of each DP leader, by DP rank], "prefill": [],
        "recoveries": groups re-formed so far}`.
        A group lost past `max_recoveries` raises `GroupFailure`; a leader that does not answer within
        `VIEW_TIMEOUT_S`, or a group re-formed meanwhile, raises TimeoutError (the caller
        may simply try again later)."""
        stats = self._view(lambda leaders: ray.get([a.stats.remote() for a in leaders],
                                                   timeout=VIEW_TIMEOUT_S))
        return {"decode": stats, "prefill": [], "recoveries": self.recoveries}

    def held_prefixes(self) -> dict:
        """`{"decode": [per DP leader: the page hashes its KV pool holds, or
        {"evicted": [hashes it evicted since its last report]}], "prefill": []}`
        (`held_reports`; errors as `leader_stats`)."""
        reports, epoch = self._held, self.epoch
        reports.next_round()

        def ask(leaders):
            return ray.get([a.held_prefix_changes.remote(reports.since(g, epoch))
                            for g, a in enumerate(leaders)], timeout=VIEW_TIMEOUT_S)

        replies = self._view(ask)
        return {"decode": [reports.take(g, epoch, r) for g, r in enumerate(replies)],
                "prefill": []}

    def _view(self, ask):
        """`ask(leaders)`; a group re-formed meanwhile is a TimeoutError (ask again)."""
        leaders = self.supervisor.leaders
        try:
            return self._call(lambda: ask(leaders))
        except GroupReformed as e:
            raise TimeoutError(f"the group was re-formed ({e}); ask again") from e

    def rank_nodes(self) -> dict:
        """`{"decode": [Ray node id of each rank, by rank], "prefill": []}`."""
        return {"decode": actor_nodes(self.supervisor.actors), "prefill": []}

    def close(self) -> None:
        self.supervisor.shutdown()
