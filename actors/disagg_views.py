"""Read-only views of the disaggregated layout for a router and for operators, mixed
into `DisaggClient` (state lives there): topology, the leaders' stats, held prefixes,
where each rank runs. Views never change a request's state; a decode failure met while
asking is recovered like any other (`DisaggRecovery`)."""

from __future__ import annotations

import ray

from .disagg_recovery import CALL_ERRORS, DecodeLost
from .group_views import VIEW_TIMEOUT_S, actor_nodes


class DisaggViews:
    """View methods of `DisaggClient`."""

    def topology(self) -> dict:
        """What a router places over: `dp` decode DP groups, `prefill_instances`, the
        page size of each side and the fewest KV pages of a leader on each side."""
        pre = [g.start_info[0].get("num_pages", 0) for g in self.prefill if g.start_info]
        return {"dp": self.layout.decode_dp, "prefill_instances": len(self.prefill),
                "page_size": self.config.cache.page_size,
                "prefill_page_size": self.prefill[0].config.cache.page_size,
                "num_pages": self.decodes.fewest_pages(lambda key: True, 0),
                "prefill_num_pages": min(pre, default=0)}

    def leader_stats(self) -> dict:
        """`{"decode": [stats of each decode DP leader], "prefill": [stats of each prefill
        instance's leader, {} while it is being replaced], "queued": requests waiting
        for decode pages, "recoveries": groups re-formed so far}`. A decode failure raises
        `GroupFailure`; a leader that does not answer within `VIEW_TIMEOUT_S` raises
        TimeoutError."""
        decode = self._decode_view("stats")
        return {"decode": decode, "prefill": self._prefill_view("stats", {}),
                "queued": len(self._queue), "aborting": len(self._aborting),
                "recoveries": self.recoveries + self.decode_recoveries - self.reshapes,
                "width": sum(g.dp for g in self.decode_groups),
                "desired_width": self.layout.decode_dp,
                "prefill_width": len(self._serving_instances()),
                "reshardings": self.reshapes, **self.ep.snapshot(self.decodes.layout)}

    def held_prefixes(self) -> dict:
        """`{"decode": [per decode DP leader: the page hashes it holds, or {"evicted":
        [hashes evicted since its last report]}], "prefill": [the same per prefill
        instance's leader; [] while it is being replaced]}` (`held_reports`)."""
        reports = self._held
        reports.next_round()
        since = lambda key, epoch: (reports.since(key, epoch),)  # noqa: E731
        epochs = [(k, self.decodes.by_key[k].epoch) for k in self.decodes.active()
                  for _ in range(self.decodes.by_key[k].dp)]  # per DP leader, global order
        decode = self._decode_view("held_prefix_changes",
                                   lambda g: since(("decode", g), epochs[g]))
        prefill = self._prefill_view("held_prefix_changes", None,
                                     lambda i: since(("prefill", i), self.prefill[i].epoch))
        return {"decode": [reports.take(("decode", g), epochs[g], r)
                           for g, r in enumerate(decode)],
                "prefill": [[] if r is None else reports.take(("prefill", i), self.prefill[i].epoch, r)
                            for i, r in enumerate(prefill)]}

    def _decode_view(self, method: str, args_of=lambda g: ()) -> list:
        """`method(*args_of(g))` of each decode DP leader g (global order, group by
        group); TimeoutError while a group is down (ask again later), `GroupFailure`
        once the layout gave up."""
        self.recovery.raise_if_failed()
        out: list = []
        for key in self.decodes.active():
            leaders, base = self.decodes.by_key[key].leaders, len(out)
            try:
                out += self._decode_call(key, lambda: ray.get(
                    [getattr(a, method).remote(*args_of(base + g)) for g, a in enumerate(leaders)],
                    timeout=VIEW_TIMEOUT_S))
            except DecodeLost as e:
                raise TimeoutError(f"a decode group is down or being re-formed ({e}); "
                                   "ask again") from e
        return out

    def _prefill_view(self, method: str, missing, args_of=lambda i: ()):
        """`method(*args_of(i))` of each prefill instance i's leader; `missing` for a
        failed one (its recovery is `poll`'s business)."""
        refs = [getattr(g.leaders[0], method).remote(*args_of(i))
                if g.actors and self.recovery.serving(("prefill", i)) else None
                for i, g in enumerate(self.prefill)]
        out = []
        for ref in refs:
            try:
                out.append(missing if ref is None else ray.get(ref, timeout=VIEW_TIMEOUT_S))
            except CALL_ERRORS:
                out.append(missing)
        return out

    def rank_nodes(self) -> dict:
        """`{"decode": [Ray node id of each decode rank], "prefill": [[... of each rank
        of each prefill instance]]}`."""
        return {"decode": actor_nodes([a for g in self.decode_groups for a in g.actors]),
                "prefill": [actor_nodes(g.actors) for g in self.prefill]}

