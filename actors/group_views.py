"""Read-only views of the colocated layout for a router and for operators (the part of
`GroupClient` the server's driver reads every second or two), answered off the step
loop. DP ranks are listed in global order: group by group, leader by leader."""

from __future__ import annotations

from typing import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from .held_reports import HeldReports
from .rank.spec import RankFailure

VIEW_TIMEOUT_S = 10.0  # stats / held prefixes / node ids: answered off the step loop


def _node_id(actor_self) -> str:
    return ray.get_runtime_context().get_node_id()


def actor_nodes(actors: Sequence) -> list[str]:
    """The Ray node id (hex) each actor runs on, in the order given."""
    return ray.get([a.__ray_call__.remote(_node_id) for a in actors], timeout=VIEW_TIMEOUT_S)


class GroupViews:
    """Mixed into `GroupClient`: needs its `groups`, `active()`, `recovery`, `ep`,
    `layout`, `tp` and `dp`."""

    def __init__(self) -> None:
        self._held = HeldReports()

    def stats(self) -> list[dict]:
        actors = [a for k in self.active() for a in self.groups[k].actors]
        return ray.get([a.stats.remote() for a in actors])

    def topology(self) -> dict:
        """What a router places over: `dp` DP ranks (every layout has the same), no
        prefill instances, the KV page size and the fewest KV pages of a DP leader."""
        page_size = self.config.cache.page_size
        return {"dp": self.dp, "prefill_instances": 0, "page_size": page_size,
                "prefill_page_size": page_size, "num_pages": self._fewest_pages(),
                "prefill_num_pages": 0}

    def leader_stats(self) -> dict:
        """`{"decode": [engine stats of each DP leader, global order], "prefill": [],
        "recoveries": n, "width": DP ranks serving, "desired_width": n, EP width...}`.
        A layout lost past `max_recoveries` raises `GroupFailure`; a leader that does not
        answer within `VIEW_TIMEOUT_S`, or a group re-formed meanwhile, raises
        TimeoutError (the caller may simply try again later)."""
        stats = self._view(lambda key, leaders: ray.get([a.stats.remote() for a in leaders],
                                                        timeout=VIEW_TIMEOUT_S))
        return {"decode": stats, "prefill": [], "recoveries": self.recoveries,
                "width": sum(self.groups[k].dp for k in self.active()),
                "desired_width": self.dp, "reshardings": self.reshapes,
                **self.ep.snapshot(self.layout)}

    def held_prefixes(self) -> dict:
        """`{"decode": [per DP leader: the page hashes its KV pool holds, or
        {"evicted": [hashes it evicted since its last report]}], "prefill": []}`
        (`held_reports`; errors as `leader_stats`). A DP rank's report is keyed with its
        group and epoch: a re-formed or re-shaped group starts over."""
        reports = self._held
        reports.next_round()
        base = {k: sum(self.groups[j].dp for j in self.active()[:i])
                for i, k in enumerate(self.active())}

        def ask(key, leaders):
            epoch = (key, self.groups[key].epoch)
            replies = ray.get([a.held_prefix_changes.remote(reports.since(base[key] + g, epoch))
                               for g, a in enumerate(leaders)], timeout=VIEW_TIMEOUT_S)
            return [reports.take(base[key] + g, epoch, r) for g, r in enumerate(replies)]

        return {"decode": self._view(ask), "prefill": []}

    def _view(self, ask) -> list:
        """`ask(key, leaders)` for each group of the layout, concatenated; a group down
        or re-formed meanwhile is a TimeoutError (ask again later); a failed layout (past
        the intensity) raises its `GroupFailure`."""
        self.recovery.raise_if_failed()
        out = []
        for key in self.active():
            if not self.recovery.serving(key):
                raise TimeoutError(f"{key} is being re-formed; ask again")
            sup = self.groups[key]
            epoch = sup.epoch
            try:
                out += ask(key, sup.leaders)
            except (RankFailure, RayActorError) as e:
                self.recovery.lost(key, epoch, e)
                raise TimeoutError(f"{key} lost a rank ({e}); ask again") from e
            except GetTimeoutError as e:
                raise TimeoutError(str(e)) from e
        return out

    def rank_nodes(self) -> dict:
        """`{"decode": [Ray node id of each rank, global order], "prefill": []}`."""
        return {"decode": actor_nodes([a for k in self.active() for a in self.groups[k].actors]),
                "prefill": []}
