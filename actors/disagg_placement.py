"""Where the disaggregated layout's requests go, mixed into `DisaggClient` (state lives
there): a queued request is placed on the decode group its global DP rank lives in
(`DPGroups.target`) and on a serving prefill instance; its decode pages are reserved and
gates opened before any prefill rank streams to them (`_start_on`), and once every
prefill rank's batches are acked it is handed over to its decode DP rank
(`_hand_over_on`). Each step is one round of calls per decode group; a failed decode call
raises `DecodeLost`, whose fence (`DisaggRecovery`) takes the group's requests back."""

from __future__ import annotations

import dataclasses

import ray

from ..log import get_logger
from .disagg_recovery import CALL_ERRORS, DecodeLost, prefill_key
from .rank.prefill_role import KVDestination

log = get_logger(__name__)


class DisaggPlacement:
    """Start and hand-over methods of `DisaggClient`."""

    def _serving_instances(self) -> list[int]:
        return [i for i in range(len(self.prefill)) if self.recovery.serving(prefill_key(i))]

    def _instance_for(self, req) -> int:
        """The placement's prefill instance, or the next serving one while it is down."""
        chosen, serving = req.placement.prefill_instance, self._serving_instances()
        return chosen if chosen in serving else min(serving, key=lambda i: (i - chosen) % len(self.prefill))

    def _decode_ranks(self, req) -> list:
        tp = self.layout.decode_tp
        return self.decodes.by_key[req.dkey].actors[req.local * tp:(req.local + 1) * tp]

    def _decode_leader(self, req):
        return self.decodes.by_key[req.dkey].leaders[req.local]

    def _start_prefills(self, batch: list) -> list:
        """Place each request on the decode group its DP rank lives in (those whose group
        is down wait in the queue), then start each group's share (`_start_on`); the
        requests that started."""
        by_key: dict[str, list] = {}
        for req in batch:
            if req.dkey is None:
                req.dp_rank = req.placement.dp_group % self.layout.decode_dp
                req.dkey, req.local = self.decodes.target(req.dp_rank)
            if self.recovery.serving(req.dkey):
                by_key.setdefault(req.dkey, []).append(req)
        started = []
        for key, reqs in by_key.items():
            try:
                started += self._start_on(key, reqs)
            except DecodeLost as e:  # the group's fence takes its requests back
                log.warning("decode_group_lost", group=key, error=str(e))
        return started

    def _start_on(self, key: str, batch: list) -> list:
        """Reserve decode pages on group `key`, open the gates, tell every prefill rank
        where each request's KV goes, then submit them to their instances' leaders; the
        requests that started (state "prefill": a failed instance puts its own back in
        the queue)."""
        sup = self.decodes.by_key[key]
        by_dp: dict[int, list] = {}
        for req in batch:
            by_dp.setdefault(req.local, []).append(req)
        refs = [sup.leaders[dp].reserve_many.remote([(r.request_id, r.tokens, r.params.prefix_root)
                                                     for r in reqs])
                for dp, reqs in by_dp.items()]
        reserved = []
        for reqs, results in zip(by_dp.values(), self._decode_call(key, lambda: ray.get(refs))):
            reserved += [(req, got) for req, got in zip(reqs, results) if got is not None]
        if not reserved:
            return []
        reserved.sort(key=lambda item: item[0].arrival)
        for req, _ in reserved:
            req.attempt += 1
            req.transfer_id = f"{req.request_id}#{req.attempt}"
        self._decode_call(key, lambda: ray.get([rank.open_gate.remote(req.transfer_id)
                                                for req, _ in reserved
                                                for rank in self._decode_ranks(req)]))
        by_instance: dict[int, list[tuple]] = {}
        tp = self.layout.decode_tp
        for req, (pages, cached) in reserved:
            req.instance, req.key = self._instance_for(req), next(self._keys)
            req.state, req.sent, req.first = "prefill", set(), None
            dest = KVDestination(req.request_id, req.transfer_id,
                                 tuple(self._kv[key][req.local * tp:(req.local + 1) * tp]),
                                 self._dst_layout[key], tuple(pages), len(req.tokens),
                                 req.dp_rank, start=cached)
            by_instance.setdefault(req.instance, []).append((req, dest))
        for index, items in by_instance.items():
            self._send_to_instance(index, items)
        return [req for req, _ in reserved if req.state == "prefill"]

    def _send_to_instance(self, index: int, items: list[tuple]) -> None:
        """Every rank of instance `index` learns where each request's KV goes, then its
        leader starts them. A failed prefill rank reports the instance lost; a rank that
        cannot reach a decode rank (its connection fails) reports the decode group lost:
        either group's fence takes the requests back."""
        group = self.prefill[index]
        epoch = group.epoch
        try:
            ray.get([a.expect.remote(req.key, dest) for req, dest in items for a in group.actors],
                    timeout=group.deadline_s + 5.0)
            ray.get([group.leaders[0].submit_prefill.remote(req.request_id, req.tokens,
                                                            req.params, req.key)
                     for req, _ in items], timeout=group.deadline_s + 5.0)
        except CALL_ERRORS as e:
            self.recovery.lost(prefill_key(index), epoch, e)
        except Exception as e:  # noqa: BLE001 - e.g. TransferError: a decode rank unreachable
            log.warning("kv_destination_unreachable", instance=index, error=str(e)[:300])
            for key in {req.dkey for req, _ in items}:
                self.recovery.lost(key, self.decodes.by_key[key].epoch, e)


    def _hand_over(self, reqs: list) -> None:
        """Every prefill rank's batches of `reqs` are acked: free their prefill pages,
        close their gates, and continue them on their decode ranks (or finish those that
        ended at the first token), one round of calls per decode group."""
        by_key: dict[str, list] = {}
        for req in reqs:
            by_key.setdefault(req.dkey, []).append(req)
        for key, mine in by_key.items():
            try:
                self._hand_over_on(key, mine)
            except DecodeLost as e:  # its fence puts them back in the queue
                log.warning("decode_group_lost", group=key, error=str(e))

    def _hand_over_on(self, key: str, reqs: list) -> None:
        for req in reqs:
            if self.recovery.serving(prefill_key(req.instance)):
                self.prefill[req.instance].leaders[0].release.remote(req.request_id)
        self._decode_call(key, lambda: ray.get([rank.close_gate.remote(req.transfer_id)
                                                for req in reqs
                                                for rank in self._decode_ranks(req)]))
        ended = [req for req in reqs if req.first.finished]
        refs = [self._decode_leader(req).unreserve.remote(req.request_id) for req in ended]
        by_dp: dict[int, list[tuple]] = {}
        for req in reqs:
            if not req.first.finished:
                by_dp.setdefault(req.local, []).append(
                    (req.request_id, req.tokens, req.first.new_token_ids[0],
                     dataclasses.replace(req.params, prompt_logprobs=None)))
        leaders = self.decodes.by_key[key].leaders
        refs += [leaders[dp].admit_many.remote(items) for dp, items in by_dp.items()]
        self._decode_call(key, lambda: ray.get(refs))
        for req in reqs:
            if req.first.finished:
                self._reqs.pop(req.request_id, None)
            else:
                req.state = "decode"
