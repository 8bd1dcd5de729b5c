"""Drive a multi-rank group (TP or DP×EP) from the caller's process.

Requests go to the DP leaders (round-robin unless told otherwise); outputs are polled
from all of them. If any rank fails or dies, the caller gets a `GroupFailure` naming the
rank and the epoch, within the collective deadline: never a hang.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Optional, Sequence

import ray
from ray.exceptions import RayActorError

from .supervisor import GroupFailure, GroupSupervisor, ensure_ray
from ..config import EngineConfig
from ..engine.outputs import StepOutput
from ..engine.rank_engine import RankFailure
from ..engine.sampling_params import SamplingParams

POLL_S = 0.05
VIEW_TIMEOUT_S = 10.0  # stats / held prefixes / node ids: answered off the step loop


def _node_id(actor_self) -> str:
    return ray.get_runtime_context().get_node_id()


def actor_nodes(actors: Sequence) -> list[str]:
    """The Ray node id (hex) each actor runs on, in the order given."""
    return ray.get([a.__ray_call__.remote(_node_id) for a in actors], timeout=VIEW_TIMEOUT_S)


class GroupClient:
    """Submit / poll / abort over the leaders of one group; `close()` stops it."""

    def __init__(self, config: EngineConfig, tp: int, dp: int, deadline_s: float,
                 ray_address: Optional[str] = None, actor_cls=None) -> None:
        ensure_ray(num_cpus=max(8, 2 * tp * dp), address=ray_address)
        self.supervisor = GroupSupervisor(config, tp, dp, deadline_s, actor_cls=actor_cls)
        self.supervisor.form()
        self._rr = itertools.count()
        self.place: Callable[[str], int] = lambda rid: next(self._rr) % dp
        self._where: dict[str, int] = {}
        self._pending: dict = {}  # outstanding poll call -> leader index

    @property
    def epoch(self) -> int:
        return self.supervisor.epoch

    def submit(self, request_id: str, tokens: Sequence[int], params: SamplingParams) -> None:
        dp_rank = self.place(request_id)
        leader = self.supervisor.leaders[dp_rank]
        self._call(lambda: ray.get(leader.submit.remote(request_id, list(tokens), params)))
        self._where[request_id] = dp_rank

    def abort(self, request_id: str) -> None:
        dp_rank = self._where.pop(request_id, None)
        if dp_rank is not None:
            self.supervisor.leaders[dp_rank].abort.remote(request_id)

    def poll(self) -> list[StepOutput]:
        """Outputs of whichever leaders have some, waiting at most ~`POLL_S`.

        One poll call stays outstanding per leader; as soon as any returns, its outputs
        are taken and its call re-issued, so a quiet leader never delays a busy one."""
        leaders = self.supervisor.leaders
        for i, leader in enumerate(leaders):
            if i not in self._pending.values():
                self._pending[leader.poll.remote(POLL_S)] = i
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=2 * POLL_S)
        if ready:  # take every call that has finished by now, not just the first
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        outs = []
        for ref in ready:
            self._pending.pop(ref)
            outs.append(self._call(lambda: ray.get(ref)))
        # Fencing: a result of another epoch never reaches the caller.
        merged = [o for batch in outs for o in batch if o.epoch == self.epoch]
        for o in merged:
            if o.finished:
                self._where.pop(o.request_id, None)
        return merged

    def _call(self, fn):
        try:
            return fn()
        except (RankFailure, RayActorError) as e:
            raise self._failure() from e

    def _failure(self) -> GroupFailure:
        """Collect what the supervisor learns within the deadline (plus slack)."""
        deadline = time.monotonic() + self.supervisor.deadline_s + 5.0
        deaths = self.supervisor.deaths()
        while time.monotonic() < deadline and len(deaths) < self.supervisor.world_size:
            time.sleep(0.05)
            deaths = self.supervisor.deaths()
        return GroupFailure(self.epoch, deaths)

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
        """`{"decode": [engine stats of each DP leader, by DP rank], "prefill": []}`.
        A dead rank raises `GroupFailure`; a leader that does not answer within
        `VIEW_TIMEOUT_S` raises TimeoutError (the caller may simply try again later)."""
        leaders = self.supervisor.leaders
        stats = self._call(lambda: ray.get([a.stats.remote() for a in leaders],
                                           timeout=VIEW_TIMEOUT_S))
        return {"decode": stats, "prefill": []}

    def held_prefixes(self) -> dict:
        """`{"decode": [page hashes each DP leader's KV pool holds], "prefill": []}`
        (errors as `leader_stats`)."""
        leaders = self.supervisor.leaders
        held = self._call(lambda: ray.get([a.held_prefix_hashes.remote() for a in leaders],
                                          timeout=VIEW_TIMEOUT_S))
        return {"decode": held, "prefill": []}

    def rank_nodes(self) -> dict:
        """`{"decode": [Ray node id of each rank, by rank], "prefill": []}`."""
        return {"decode": actor_nodes(self.supervisor.actors), "prefill": []}

    def close(self) -> None:
        self.supervisor.shutdown()
