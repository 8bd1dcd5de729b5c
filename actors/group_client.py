"""Drive a multi-rank group (TP or DP×EP) from the caller's process.

Requests go to the DP leaders (round-robin unless told otherwise); outputs are polled
from all of them. If any rank fails or dies, the failure is reported to the recovery
loop (`Recovery`, over the reconciler of ARCHITECTURE §5), which re-forms the group
under a new epoch at the next poll: the requests it held resume from prompt + the
tokens the caller already has (`resume`), so the caller sees each token once and the
same tokens as without the fault. A death while the group re-forms forms it again.
Past the restart intensity (`max_recoveries` re-formations within `recovery_window_s`),
the caller gets a `GroupFailure` naming the ranks and the epoch instead: never a hang.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from .supervisor import GroupSupervisor, ensure_ray, settle
from ..config import EngineConfig
from ..engine.outputs import StepOutput
from ..engine.prompt_check import check_prompt
from .rank.spec import RankFailure
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from .cluster import ANYWHERE, Placement
from .held_reports import HeldReports
from .recovery import Recovery, intensity_of
from .resume import resume_from

log = get_logger(__name__)

POLL_S = 0.05
VIEW_TIMEOUT_S = 10.0  # stats / held prefixes / node ids: answered off the step loop
GROUP = "group"  # the one group's key in the reconciler
CALL_ERRORS = (RankFailure, RayActorError, GetTimeoutError)  # a call into a rank that failed


def _node_id(actor_self) -> str:
    return ray.get_runtime_context().get_node_id()


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
    dp_group: int = 0  # where it was placed (wraps around a narrower group's width)
    dp_rank: int = -1  # -1: not on the current group (yet)


class GroupClient:
    """Submit / poll / abort over the leaders of one group; `close()` stops it.
    `recoveries`: re-formations so far; `max_recoveries` (default: the config's) within
    the config's `recovery_window_s`: the restart intensity."""

    def __init__(self, config: EngineConfig, tp: int, dp: int, deadline_s: float,
                 ray_address: Optional[str] = None, actor_cls=None,
                 max_recoveries: Optional[int] = None) -> None:
        ensure_ray(num_cpus=max(8, 2 * tp * dp), address=ray_address)
        self.config = config
        self.supervisor = GroupSupervisor(config, tp, dp, deadline_s, actor_cls=actor_cls)
        self.supervisor.form()
        self.recovery = Recovery({GROUP: self.supervisor}, intensity_of(config, max_recoveries),
                                 on_fence=lambda key: self._on_fence(),
                                 on_resume=lambda key: self._on_resume(),
                                 narrowable=(GROUP,) if tp * dp > 1 and dp > 1 else (),
                                 replace_timeout_s=config.parallel.replace_timeout_s)
        self._pages = min(i["num_pages"] for i in self.supervisor.start_info[::tp])
        self._rr = itertools.count()
        self._live: dict[str, _Live] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._pending: dict = {}  # outstanding poll call -> (leader index, epoch)
        self._held = HeldReports()

    @property
    def epoch(self) -> int:
        return self.supervisor.epoch

    @property
    def recoveries(self) -> int:
        return self.recovery.recoveries

    def submit(self, request_id: str, tokens: Sequence[int], params: SamplingParams,
               placement: Placement = ANYWHERE) -> None:
        """Start a request on `placement.dp_group` (-1: round robin; ValueError naming
        what is wrong with it, checked here); while the group re-forms it waits, and
        starts with the others it held."""
        self.recovery.raise_if_failed()
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        tokens = check_prompt(tokens, params, self.config, self._pages)
        if not params.greedy and params.seed is None:  # a resumed run must draw the same
            params = params.with_seed(self._seeds.getrandbits(63))
        group = placement.dp_group if placement.dp_group >= 0 else next(self._rr)
        live = _Live(list(tokens), params, next(self._arrivals), dp_group=group)
        self._live[request_id] = live
        if self.recovery.serving(GROUP):
            self._start([(request_id, live, list(tokens), params)])

    def _start(self, items: list[tuple[str, _Live, list[int], SamplingParams]]) -> None:
        """Submit each to its DP leader, in one round of calls; a failed call reports
        the group lost (its requests stay held, to start on the re-formed group)."""
        leaders, epoch, refs = self.supervisor.leaders, self.epoch, []
        for request_id, live, tokens, params in items:
            live.dp_rank = live.dp_group % self.supervisor.dp  # narrower: fewer
            refs.append(leaders[live.dp_rank].submit.remote(request_id, tokens, params))
        try:
            ray.get(refs, timeout=VIEW_TIMEOUT_S)
        except CALL_ERRORS as e:
            self.recovery.lost(GROUP, epoch, e)

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None and live.dp_rank >= 0 and self.recovery.serving(GROUP):
            self.supervisor.leaders[live.dp_rank].abort.remote(request_id)

    def poll(self) -> list[StepOutput]:
        """Outputs of whichever leaders have some, waiting at most ~`POLL_S`.

        One poll call stays outstanding per leader; as soon as any returns, its outputs
        are taken and its call re-issued, so a quiet leader never delays a busy one. Each
        output's index is the caller's (it continues across a recovery)."""
        self.recovery.reconcile()
        if not self.recovery.serving(GROUP):  # forming again after a backoff
            time.sleep(self.recovery.wait_hint(POLL_S))
            return []
        epoch = self.epoch
        for i, leader in enumerate(self.supervisor.leaders):
            if (i, epoch) not in self._pending.values():
                self._pending[leader.poll.remote(POLL_S)] = (i, epoch)
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=2 * POLL_S)
        if ready:  # take every call that has finished by now, not just the first
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        outs = []
        for ref in ready:
            _, at = self._pending.pop(ref)
            try:
                outs.append(ray.get(ref))
            except CALL_ERRORS as e:
                self.recovery.lost(GROUP, at, e)
        if not self.recovery.serving(GROUP):
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

    def maintain(self) -> None:
        """Recovery work due while no request is polled (a death to fence, a narrow
        group to widen); `GroupFailure` once the layout gave up."""
        self.recovery.reconcile()

    def _on_fence(self) -> None:
        """The group's epoch is gone: its answers are void, its requests held."""
        settle(self._pending)
        self._pending = {}
        for live in self._live.values():
            live.dp_rank = -1

    def _on_resume(self) -> None:
        """Restart every held request on the re-formed group, in arrival order, from
        its prompt + the tokens the caller already has."""
        self._pages = min(i["num_pages"] for i in self.supervisor.start_info[::self.supervisor.tp])
        items = []
        for request_id, live in sorted(self._live.items(), key=lambda kv: kv[1].arrival):
            tokens, params, live.base = resume_from(live.prompt, live.params, live.emitted)
            items.append((request_id, live, tokens, params))
        if items:
            self._start(items)

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
        return {"decode": stats, "prefill": [], "recoveries": self.recoveries,
                "width": self.supervisor.dp, "desired_width": self.recovery.reconciler.groups[GROUP].desired}

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
        """`ask(leaders)`; a group down or re-formed meanwhile is a TimeoutError (ask
        again later); a failed one (past the intensity) raises its `GroupFailure`."""
        self.recovery.raise_if_failed()
        if not self.recovery.serving(GROUP):
            raise TimeoutError("the group is being re-formed; ask again")
        epoch = self.epoch
        try:
            return ask(self.supervisor.leaders)
        except (RankFailure, RayActorError) as e:
            self.recovery.lost(GROUP, epoch, e)
            raise TimeoutError(f"the group lost a rank ({e}); ask again") from e
        except GetTimeoutError as e:
            raise TimeoutError(str(e)) from e

    def rank_nodes(self) -> dict:
        """`{"decode": [Ray node id of each rank, by rank], "prefill": []}`."""
        return {"decode": actor_nodes(self.supervisor.actors), "prefill": []}

    def close(self) -> None:
        self.supervisor.shutdown()
