"""Drive the colocated layout (TP or DP×EP groups of ranks) from the caller's process.

The layout's `dp` DP ranks are split evenly into `groups` DP×EP groups (the EP-width
policy may change how many while serving: `EPControl`); the router places a request on
a global DP rank, which lives in group `dp_rank // (dp / groups)`. Requests go to the DP
leaders; outputs are polled from all of them. If any rank fails or dies, the failure is
reported to the recovery loop (`Recovery`, over the reconciler of ARCHITECTURE §5),
which re-forms that group under a new epoch at the next poll: the requests it held
resume from prompt + the tokens the caller already has (`resume`), so the caller sees
each token once and the same tokens as without the fault. A layout change is the same
path, planned: every group whose width changes is fenced and formed at its new width,
and its requests resume on the group their DP rank now lives in. Past the restart
intensity (`max_recoveries` re-formations within `recovery_window_s`), the caller gets a
`GroupFailure` naming the ranks and the epoch instead: never a hang.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ..config import EngineConfig
from ..engine.outputs import StepOutput
from ..engine.prompt_check import check_prompt
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from ..policies.ep_width import EPLayout
from .cluster import ANYWHERE, Placement
from .dp_groups import DPGroups
from .ep_control import EPControl
from .group_views import VIEW_TIMEOUT_S, GroupViews
from .rank.spec import RankFailure
from .recovery import Recovery, intensity_of
from .resume import resume_from
from .supervisor import GroupSupervisor, ensure_ray, settle

log = get_logger(__name__)

POLL_S = 0.05
CALL_ERRORS = (RankFailure, RayActorError, GetTimeoutError)  # a call into a rank that failed


@dataclass(slots=True)
class _Live:
    """A request the client holds: enough to resume it on a re-formed group."""

    prompt: list[int]
    params: SamplingParams  # as submitted, with the seed it samples with
    arrival: int
    emitted: list[int] = field(default_factory=list)  # tokens the caller has, in order
    base: int = 0  # caller's output index of the current run's first token
    dp_group: int = 0  # the global DP rank it was placed on
    group: Optional[str] = None  # the group it runs on now (None: held)
    leader: int = -1  # its DP leader in that group


class GroupClient(GroupViews):
    """Submit / poll / abort over the leaders of the layout's groups; `close()` stops
    them. `recoveries`: re-formations after faults; `reshapes`: layout changes;
    `max_recoveries` (default: the config's) within the config's `recovery_window_s`."""

    def __init__(self, config: EngineConfig, tp: int, dp: int, deadline_s: float,
                 ray_address: Optional[str] = None, actor_cls=None,
                 max_recoveries: Optional[int] = None, ep_control: Optional[EPControl] = None
                 ) -> None:
        ensure_ray(num_cpus=max(8, 2 * tp * dp), address=ray_address)
        self.config, self.tp, self.dp = config, tp, dp
        self.side = DPGroups(lambda n: GroupSupervisor(config, tp, n, deadline_s,
                                                       actor_cls=actor_cls),
                             dp, tp, config.parallel.ep_width.groups, "group")
        self.groups = self.side.by_key  # every group a layout may have, by key
        self.side.form()
        self.recovery = Recovery(self.groups, intensity_of(config, max_recoveries),
                                 on_fence=self._on_fence, on_resume=self._on_resume,
                                 narrowable=tuple(self.side.keys) if dp > 1 else (),
                                 replace_timeout_s=config.parallel.replace_timeout_s,
                                 retired=self.side.retired())
        self._pages = self.side.fewest_pages(lambda key: True, 0)
        self._rr = itertools.count()
        self._live: dict[str, _Live] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self._pending: dict = {}  # outstanding poll call -> (group key, leader index, epoch)
        self.ep = ep_control if ep_control is not None else EPControl(config, tp, dp, self._pages)
        super().__init__()

    # -- the layout ------------------------------------------------------------------
    @property
    def supervisor(self) -> GroupSupervisor:
        """The first group's supervisor (the only one in a one-group layout)."""
        return self.side.supervisors[0]

    @property
    def supervisors(self) -> list[GroupSupervisor]:
        """The supervisors of the groups in the layout, in global DP order."""
        return self.side.supervisors

    @property
    def epoch(self) -> int:
        return self.supervisor.epoch

    @property
    def recoveries(self) -> int:
        return self.recovery.recoveries

    @property
    def reshapes(self) -> int:
        return self.recovery.reshapes

    @property
    def layout(self) -> EPLayout:
        return self.side.layout

    @property
    def layout_groups(self) -> int:
        return self.side.groups

    def active(self) -> list[str]:
        """The keys of the groups in the desired layout, in global DP order."""
        return self.side.active()

    def _fewest_pages(self) -> int:
        """The fewest KV pages of a serving DP leader (what a prompt must fit)."""
        return self.side.fewest_pages(self.recovery.serving, self._pages)

    # -- requests --------------------------------------------------------------------
    def submit(self, request_id: str, tokens: Sequence[int], params: SamplingParams,
               placement: Placement = ANYWHERE) -> None:
        """Start a request on `placement.dp_group` (-1: round robin; ValueError naming
        what is wrong with it, checked here); while its group re-forms it waits, and
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
        self._live[request_id] = _Live(list(tokens), params, next(self._arrivals), dp_group=group)
        self._place_held()

    def _place_held(self) -> None:
        """Start every held request whose group serves, in arrival order, from its
        prompt + the tokens the caller already has; one round of calls per group. A
        failed call reports the group lost (its requests stay held)."""
        by_group: dict[str, list] = {}
        held = sorted((kv for kv in self._live.items() if kv[1].group is None),
                      key=lambda kv: kv[1].arrival)
        for request_id, live in held:
            key, leader = self.side.target(live.dp_group)
            if self.recovery.serving(key):
                by_group.setdefault(key, []).append((request_id, live, leader))
        for key, items in by_group.items():
            sup, refs = self.groups[key], []
            for request_id, live, leader in items:
                tokens, params, live.base = resume_from(live.prompt, live.params, live.emitted)
                live.group, live.leader = key, leader
                refs.append(sup.leaders[leader].submit.remote(request_id, tokens, params))
            try:
                ray.get(refs, timeout=VIEW_TIMEOUT_S)
            except CALL_ERRORS as e:
                self.recovery.lost(key, sup.epoch, e)

    def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None and live.group is not None and self.recovery.serving(live.group):
            self.groups[live.group].leaders[live.leader].abort.remote(request_id)

    def poll(self) -> list[StepOutput]:
        """Outputs of whichever leaders have some, waiting at most ~`POLL_S`.

        One poll call stays outstanding per leader; as soon as any returns, its outputs
        are taken and its call re-issued, so a quiet leader never delays a busy one. Each
        output's index is the caller's (it continues across a recovery)."""
        self.maintain()
        serving = [k for k in self.active() if self.recovery.serving(k)]
        if not serving:  # forming again after a backoff
            time.sleep(self.recovery.wait_hint(POLL_S))
            return []
        for key in serving:
            sup = self.groups[key]
            for i, leader in enumerate(sup.leaders):
                if (key, i, sup.epoch) not in self._pending.values():
                    self._pending[leader.poll.remote(POLL_S)] = (key, i, sup.epoch)
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=2 * POLL_S)
        if ready:  # take every call that has finished by now, not just the first
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        got = []
        for ref in ready:
            key, _, at = self._pending.pop(ref)
            try:
                got.append((key, at, ray.get(ref)))
            except CALL_ERRORS as e:
                self.recovery.lost(key, at, e)
        return self._take(got)

    def _take(self, got: list[tuple[str, int, list[StepOutput]]]) -> list[StepOutput]:
        """The outputs the caller gets: of groups still serving the epoch that produced
        them (fencing), for requests still placed there; indices made the caller's."""
        merged = []
        for key, at, batch in got:
            if not self.recovery.serving(key) or self.groups[key].epoch != at:
                continue  # the group went down meanwhile: its requests run again elsewhere
            for o in batch:
                live = self._live.get(o.request_id)
                if o.epoch != at or live is None or live.group != key:
                    continue
                if o.index >= 0:
                    o.index += live.base
                live.emitted.extend(o.new_token_ids)
                if o.finished:
                    del self._live[o.request_id]
                merged.append(o)
        return merged

    def maintain(self) -> None:
        """Recovery and layout work due now (a death to fence, a narrow group to widen,
        the EP-width policy's turn, held requests to start); `GroupFailure` once the
        layout gave up."""
        self.recovery.reconcile()
        if self.ep.due() and all(self.recovery.serving(k) for k in self.active()):
            self._ask_policy()
            self.recovery.reconcile()
        self._place_held()

    def _ask_policy(self) -> None:
        try:
            stats = self.leader_stats()["decode"]
        except TimeoutError:
            return
        decision = self.ep.decide(stats, self.layout)
        if decision.changed:
            self.reshape(decision.layout)

    def reshape(self, layout: EPLayout) -> None:
        """Serve with `layout` from now on: every group whose width changes is fenced
        and formed at its new width by the reconciler (planned, outside the restart
        intensity); requests resume on the group their DP rank lives in then."""
        before = self.layout
        widths = self.side.reshape(layout)
        log.warning("ep_layout_change", before=str(before), after=str(layout))
        self.recovery.reshape(widths)

    def _on_fence(self, key: str) -> None:
        """`key`'s epoch is gone: its answers are void, its requests held."""
        mine = {ref: tag for ref, tag in self._pending.items() if tag[0] == key}
        settle(mine)
        for ref in mine:
            self._pending.pop(ref, None)
        for live in self._live.values():
            if live.group == key:
                live.group, live.leader = None, -1

    def _on_resume(self, key: str) -> None:
        """`key` serves again: held requests whose DP rank lives there start on it; the
        EP-width policy waits for the layout's steady state (`EPControl.settle`)."""
        self.ep.settle()
        self._pages = self._fewest_pages()
        self._place_held()

    def close(self) -> None:
        self.side.close()
