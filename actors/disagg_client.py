"""Drive the disaggregated layout from the caller's process: prefill TP instances stream
each prompt's KV to one decode DP×EP group, which continues the request (ARCHITECTURE §2).

A request's life: queued → prefill (decode pages reserved, gates open, prefill streams
and samples the first token) → decode (admitted once every prefill rank reports all its
batches acked) → finished. Each prefill attempt has its own transfer id. If a prefill
instance fails (a rank dies mid-transfer), its requests are abandoned cleanly (gates
closed before their decode pages are given back), the instance is re-formed under a new
epoch, and the requests are prefilled again: greedy or seeded sampling gives the same
first token, which the caller has at most once. A request aborted while prefilling is
taken apart the same way, in stages that the polls move on (`abort_cleanup`), so `abort`
never waits on a rank. If the decode group loses a rank, it is
re-formed too and its requests resume from prompt + the tokens already delivered
(`disagg_recovery`); every output carries its index, so the caller sees each token once.
Every failure goes to one recovery loop (`Recovery`, run at the top of each `poll`):
deaths during a re-formation, or in two groups at once, only form again, until the
restart intensity is exceeded (`GroupFailure`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import ray

from ..config import DisaggConfig, EngineConfig
from ..engine.outputs import StepOutput
from ..engine.prompt_check import check_prompt
from ..engine.sampling_params import SamplingParams
from ..kv_transfer.transport.staging_memory import staging_bytes
from ..log import get_logger
from .abort_cleanup import AbortCleanup
from .disagg_recovery import (CALL_ERRORS, DECODE, DecodeLost, DisaggRecovery,
                              prefill_key)
from .disagg_views import DisaggViews
from .cluster import ANYWHERE, Placement
from .held_reports import HeldReports
from .rank.prefill_role import KVDestination
from .rank_actor import RemoteDecodeRank, RemotePrefillRank
from .recovery import Recovery, intensity_of
from .supervisor import GroupSupervisor, ensure_ray

log = get_logger(__name__)

POLL_S = 0.05
PUMP_BATCH = 64  # queued requests started per round of calls


@dataclass(slots=True)
class _Request:
    request_id: str
    tokens: list[int]
    params: SamplingParams
    state: str = "queued"  # queued | prefill | decode
    attempt: int = 0
    dp_rank: int = -1
    instance: int = -1
    key: int = 0
    transfer_id: str = ""
    first: Optional[StepOutput] = None  # the prefill's first token, once sampled
    sent: set = field(default_factory=set)  # prefill ranks whose batches are all acked
    arrival: int = 0
    prompt: list[int] = field(default_factory=list)  # as submitted
    params_in: Optional[SamplingParams] = None  # as submitted (with its seed)
    emitted: list[int] = field(default_factory=list)  # tokens the caller has, in order
    base: int = 0  # output index of this run's first token (> 0 after a resume)
    placement: Placement = ANYWHERE  # as submitted


def with_staging(config: EngineConfig, connections: int) -> EngineConfig:
    """`config` whose KV pool leaves room for the staging buffers of a rank holding
    `connections` KV connections (a prefill rank: one per decode rank; a decode rank: one
    per prefill rank), unless `kv_staging_bytes` was given."""
    if config.cache.kv_staging_bytes:
        return config
    cache = dataclasses.replace(config.cache,
                                kv_staging_bytes=staging_bytes(connections, config.device))
    return dataclasses.replace(config, cache=cache)


class DisaggClient(DisaggRecovery, DisaggViews):
    """Submit / poll / abort over a disaggregated deployment; `close()` stops it."""

    def __init__(self, prefill_config: EngineConfig, decode_config: EngineConfig,
                 layout: DisaggConfig, deadline_s: float, ray_address: Optional[str] = None) -> None:
        world = layout.prefill_tp * layout.prefill_instances + layout.decode_dp * layout.decode_tp
        prefill_config = with_staging(prefill_config, layout.decode_dp * layout.decode_tp)
        decode_config = with_staging(decode_config, layout.prefill_tp * layout.prefill_instances)
        ensure_ray(num_cpus=max(8, 2 * world), address=ray_address)
        self.layout, self.config = layout, decode_config
        self.decode = GroupSupervisor(decode_config, layout.decode_tp, layout.decode_dp,
                                      deadline_s, actor_cls=RemoteDecodeRank)
        self.prefill = [GroupSupervisor(prefill_config, layout.prefill_tp, 1, deadline_s,
                                        actor_cls=RemotePrefillRank)
                        for _ in range(layout.prefill_instances)]
        try:
            for group in [self.decode, *self.prefill]:
                group.form()
        except Exception:
            self.close()
            raise
        self._learn_decode_layout()
        self._rr, self._rr_prefill = itertools.count(), itertools.count()
        self._reqs: dict[str, _Request] = {}
        self._queue: deque[str] = deque()
        self._keys = itertools.count(1)
        self._pending: dict = {}  # outstanding poll call -> (side, index, rank, epoch)
        self._out: list[StepOutput] = []
        self._seeds = random.Random(decode_config.seed)
        self._arrivals = itertools.count()
        self._held = HeldReports()
        self._aborting: dict[str, AbortCleanup] = {}  # aborted while prefilling, by id
        groups = {DECODE: self.decode, **{prefill_key(i): g for i, g in enumerate(self.prefill)}}
        self.recovery = Recovery(groups, intensity_of(decode_config), on_fence=self._on_fence,
                                 on_resume=self._on_resume,
                                 narrowable=(DECODE,) if layout.decode_dp > 1 else (),
                                 replace_timeout_s=decode_config.parallel.replace_timeout_s,
                                 pools={prefill_key(i): "prefill" for i in range(len(self.prefill))})

    @property
    def recoveries(self) -> int:
        """Prefill instances re-formed so far."""
        return sum(n for key, n in self.recovery.formed.items() if key != DECODE)

    @property
    def decode_recoveries(self) -> int:
        """Decode groups re-formed so far."""
        return self.recovery.formed[DECODE]

    def _learn_decode_layout(self) -> None:
        """The decode ranks' KV receivers and layout (after each formation)."""
        info = sorted(self.decode.start_info, key=lambda i: i["rank"])
        self._kv_addresses = [tuple(i["kv_address"]) for i in info]
        self._dst_layout = info[0]["kv_layout"]
        self._decode_pages = min(i["num_pages"] for i in info[::self.layout.decode_tp])

    @property
    def epoch(self) -> int:
        return self.decode.epoch

    # -- requests --------------------------------------------------------------------
    def submit(self, request_id: str, tokens: Sequence[int], params: SamplingParams,
               placement: Placement = ANYWHERE) -> None:
        """Queue a request for `placement`'s decode DP group and prefill instance (-1:
        round robin; ValueError naming what is wrong with it, checked here without a
        call to a rank); the next `poll` starts it, with every request queued meanwhile
        in one round of calls."""
        self.recovery.raise_if_failed()
        if request_id in self._reqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if request_id in self._aborting:
            raise ValueError(f"request_id {request_id!r} is still being aborted")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        tokens = check_prompt(tokens, params, self.config, self._decode_pages)
        if not params.greedy and params.seed is None:  # both sides must draw the same stream
            params = params.with_seed(self._seeds.getrandbits(63))
        placement = Placement(
            placement.dp_group if placement.dp_group >= 0 else next(self._rr),
            placement.prefill_instance if placement.prefill_instance >= 0
            else next(self._rr_prefill) % len(self.prefill))
        self._reqs[request_id] = _Request(request_id, tokens, params, arrival=next(self._arrivals),
                                          prompt=list(tokens), params_in=params,
                                          placement=placement)
        self._queue.append(request_id)  # the next poll starts it, with all queued meanwhile


    def abort(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        if req.state == "queued":
            self._queue.remove(request_id)
        elif not self.recovery.serving(DECODE):
            return  # its pages and gates go with the decode group's epoch
        elif req.state == "prefill":  # taken apart by the polls: never waits on a rank
            self._aborting[request_id] = self._abort_cleanup(req)
        else:
            self.decode.leaders[req.dp_rank].abort.remote(request_id)

    def _pump(self) -> None:
        """Start queued prefills, a batch of up to `PUMP_BATCH` at a time with one round
        of calls per batch (not per request): each DP leader reserves its requests' pages
        in arrival order and takes none after one that does not fit; a batch that starts
        nothing ends the pump until the next poll."""
        while self._queue and self.recovery.serving(DECODE) and self._serving_instances():
            batch = [self._reqs[rid] for rid in itertools.islice(self._queue, PUMP_BATCH)]
            try:
                started = self._start_prefills(batch)
            except DecodeLost:  # the group was replaced; try again on the next poll
                return
            if not started:
                return
            self._queue = deque(rid for rid in self._queue
                                if self._reqs[rid].state == "queued")

    def _serving_instances(self) -> list[int]:
        return [i for i in range(len(self.prefill)) if self.recovery.serving(prefill_key(i))]

    def _instance_for(self, req: _Request) -> int:
        """The placement's prefill instance, or the next serving one while it is down."""
        chosen, serving = req.placement.prefill_instance, self._serving_instances()
        return chosen if chosen in serving else min(serving, key=lambda i: (i - chosen) % len(self.prefill))

    def _decode_ranks(self, dp_rank: int) -> list:
        tp = self.layout.decode_tp
        return self.decode.actors[dp_rank * tp:(dp_rank + 1) * tp]

    def _start_prefills(self, batch: list[_Request]) -> list[_Request]:
        """Reserve decode pages, open the gates, tell every prefill rank where each
        request's KV goes, then submit them to their instances' leaders; the requests
        that started (state "prefill": a failed instance puts its own back in the queue)."""
        by_dp: dict[int, list[_Request]] = {}
        for req in batch:
            if req.dp_rank < 0:  # % the decode group's width: fewer DP ranks while narrow
                req.dp_rank = req.placement.dp_group % self.decode.dp
            by_dp.setdefault(req.dp_rank, []).append(req)
        refs = [self.decode.leaders[dp].reserve_many.remote([(r.request_id, r.tokens) for r in reqs])
                for dp, reqs in by_dp.items()]
        reserved = []
        for reqs, results in zip(by_dp.values(), self._decode_call(lambda: ray.get(refs))):
            reserved += [(req, got) for req, got in zip(reqs, results) if got is not None]
        if not reserved:
            return []
        reserved.sort(key=lambda item: item[0].arrival)
        for req, _ in reserved:
            req.attempt += 1
            req.transfer_id = f"{req.request_id}#{req.attempt}"
        self._decode_call(lambda: ray.get([rank.open_gate.remote(req.transfer_id)
                                           for req, _ in reserved
                                           for rank in self._decode_ranks(req.dp_rank)]))
        by_instance: dict[int, list[tuple[_Request, KVDestination]]] = {}
        tp = self.layout.decode_tp
        for req, (pages, cached) in reserved:
            req.instance, req.key = self._instance_for(req), next(self._keys)
            req.state, req.sent, req.first = "prefill", set(), None
            dp = req.dp_rank
            dest = KVDestination(req.request_id, req.transfer_id,
                                 tuple(self._kv_addresses[dp * tp:(dp + 1) * tp]),
                                 self._dst_layout, tuple(pages), len(req.tokens), dp,
                                 start=cached)
            by_instance.setdefault(req.instance, []).append((req, dest))
        for index, items in by_instance.items():
            self._send_to_instance(index, items)
        return [req for req, _ in reserved if req.state == "prefill"]

    def _send_to_instance(self, index: int, items: list[tuple[_Request, KVDestination]]) -> None:
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
            self.recovery.lost(DECODE, self.decode.epoch, e)

    # -- outputs ---------------------------------------------------------------------
    def poll(self) -> list[StepOutput]:
        """Tokens of any request since the last poll, waiting at most ~`POLL_S`."""
        self.recovery.reconcile()
        try:
            self._advance_aborts()
        except DecodeLost as e:  # its fence (next poll) puts the requests back in the queue
            log.warning("decode_group_lost", epoch=self.decode.epoch, error=str(e))
        self._pump()
        self._issue_polls()
        if not self._pending:  # every group is down, re-forming after a backoff
            time.sleep(self.recovery.wait_hint(POLL_S))
            return []
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=2 * POLL_S)
        if ready:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        try:
            for ref in ready:
                tag = self._pending.pop(ref, None)
                if tag is not None:
                    self._take(ref, tag)
            self._hand_over([r for r in self._reqs.values() if r.state == "prefill"
                             and r.first is not None and len(r.sent) == self.layout.prefill_tp])
        except DecodeLost as e:  # its fence (next poll) puts the requests back in the queue
            log.warning("decode_group_lost", epoch=self.decode.epoch, error=str(e))
        out, self._out = self._out, []
        return out

    def maintain(self) -> None:
        """Recovery work due while no request is polled (a death to fence, a narrow
        group to widen); `GroupFailure` once the layout gave up."""
        self.recovery.reconcile()

    def _issue_polls(self) -> None:
        waiting = set(self._pending.values())
        for i, group in enumerate(self.prefill):
            if not self.recovery.serving(prefill_key(i)):
                continue
            for r, actor in enumerate(group.actors):
                tag = ("prefill", i, r, group.epoch)
                if tag not in waiting:
                    self._pending[actor.poll_events.remote(POLL_S)] = tag
        for d, leader in enumerate(self.decode.leaders if self.recovery.serving(DECODE) else ()):
            tag = ("decode", d, 0, self.decode.epoch)
            if tag not in waiting:
                self._pending[leader.poll.remote(POLL_S)] = tag

    def _take(self, ref, tag) -> None:
        side, index, _, epoch = tag
        if side == "decode":
            if epoch != self.decode.epoch:
                return  # fencing: a result of a replaced group never counts
            for o in self._decode_call(lambda: ray.get(ref)):
                req = self._reqs.get(o.request_id)
                if o.epoch != self.decode.epoch or req is None or req.state != "decode":
                    continue
                if o.index >= 0:
                    o.index += req.base
                req.emitted.extend(o.new_token_ids)
                self._out.append(o)
                if o.finished:
                    self._reqs.pop(o.request_id, None)
            return
        if epoch != self.prefill[index].epoch or not self.recovery.serving(prefill_key(index)):
            return  # fencing: a result of a replaced instance never counts
        try:
            outs, events = ray.get(ref)
        except CALL_ERRORS as e:
            self.recovery.lost(prefill_key(index), epoch, e)
            return
        for o in outs:
            self._on_first_token(index, o)
        for e in events:
            req = self._reqs.get(e.request_id)
            if req is None or req.transfer_id != e.transfer_id or req.state != "prefill":
                continue
            if e.ok:
                req.sent.add(e.rank)
            else:
                self._abandon(req, instance_alive=True)

    def _on_first_token(self, index: int, o: StepOutput) -> None:
        req = self._reqs.get(o.request_id)
        if req is None or req.state != "prefill" or req.instance != index:
            return
        final = (o.finish_reason == "stop" or req.params.max_tokens == 1
                 or len(req.tokens) + 1 >= self.config.max_model_len)
        reason = ("stop" if o.finish_reason == "stop" else "length") if final else None
        req.first = StepOutput(req.request_id, list(o.new_token_ids), final, reason,
                               o.num_cached_tokens, self.decode.epoch, index=req.base)
        if len(req.emitted) == req.base:  # a re-prefill samples the same token: emit it once
            req.emitted.extend(req.first.new_token_ids)
            self._out.append(req.first)

    def _hand_over(self, reqs: list[_Request]) -> None:
        """Every prefill rank's batches of `reqs` are acked: free their prefill pages,
        close their gates, and continue them on their decode ranks (or finish those that
        ended at the first token), one round of calls for all of them."""
        if not reqs:
            return
        for req in reqs:
            if self.recovery.serving(prefill_key(req.instance)):
                self.prefill[req.instance].leaders[0].release.remote(req.request_id)
        self._decode_call(lambda: ray.get([rank.close_gate.remote(req.transfer_id)
                                           for req in reqs
                                           for rank in self._decode_ranks(req.dp_rank)]))
        ended = [req for req in reqs if req.first.finished]
        refs = [self.decode.leaders[req.dp_rank].unreserve.remote(req.request_id) for req in ended]
        by_dp: dict[int, list[tuple]] = {}
        for req in reqs:
            if not req.first.finished:
                by_dp.setdefault(req.dp_rank, []).append(
                    (req.request_id, req.tokens, req.first.new_token_ids[0], req.params))
        refs += [self.decode.leaders[dp].admit_many.remote(items) for dp, items in by_dp.items()]
        self._decode_call(lambda: ray.get(refs))
        for req in reqs:
            if req.first.finished:
                self._reqs.pop(req.request_id, None)
            else:
                req.state = "decode"

    # -- operations ------------------------------------------------------------------
    def stats(self) -> dict:
        self.recovery.raise_if_failed()
        return {"decode": ray.get([a.stats.remote() for a in self.decode.actors]),
                "prefill": [ray.get([a.stats.remote() for a in g.actors]) for g in self.prefill],
                "prefill_epochs": [g.epoch for g in self.prefill],
                "decode_epoch": self.decode.epoch, "recoveries": self.recoveries,
                "decode_recoveries": self.decode_recoveries}

    def close(self) -> None:
        getattr(self, "_aborting", {}).clear()  # their groups go now (also after a failed start)
        for group in [self.decode, *self.prefill]:
            if group.actors:
                group.shutdown()
