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
from .disagg_recovery import (CALL_ERRORS, DECODE, DecodeLost, DisaggRecovery, is_decode_key,
                              prefill_key)
from .disagg_placement import DisaggPlacement
from .disagg_views import DisaggViews
from .cluster import ANYWHERE, Placement
from .dp_groups import DPGroups
from .ep_control import EPControl, upstream_demand
from .held_reports import HeldReports
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
    dp_rank: int = -1  # the global decode DP rank it is placed on
    dkey: Optional[str] = None  # the decode group that DP rank lives in (None: not placed)
    local: int = -1  # its DP rank in that group
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


class DisaggClient(DisaggPlacement, DisaggRecovery, DisaggViews):
    """Submit / poll / abort over a disaggregated deployment; `close()` stops it."""

    def __init__(self, prefill_config: EngineConfig, decode_config: EngineConfig,
                 layout: DisaggConfig, deadline_s: float, ray_address: Optional[str] = None) -> None:
        world = layout.prefill_tp * layout.prefill_instances + layout.decode_dp * layout.decode_tp
        prefill_config = with_staging(prefill_config, layout.decode_dp * layout.decode_tp)
        decode_config = with_staging(decode_config, layout.prefill_tp * layout.prefill_instances)
        ensure_ray(num_cpus=max(8, 2 * world), address=ray_address)
        self.layout, self.config = layout, decode_config
        self.decodes = DPGroups(lambda n: GroupSupervisor(decode_config, layout.decode_tp, n,
                                                          deadline_s, actor_cls=RemoteDecodeRank),
                                layout.decode_dp, layout.decode_tp,
                                decode_config.parallel.ep_width.groups, DECODE)
        self.prefill = [GroupSupervisor(prefill_config, layout.prefill_tp, 1, deadline_s,
                                        actor_cls=RemotePrefillRank)
                        for _ in range(layout.prefill_instances)]
        try:
            for group in [*self.decodes.supervisors, *self.prefill]:
                group.form()
        except Exception:
            self.close()
            raise
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
        groups = {**self.decodes.by_key, **{prefill_key(i): g for i, g in enumerate(self.prefill)}}
        self.recovery = Recovery(groups, intensity_of(decode_config), on_fence=self._on_fence,
                                 on_resume=self._on_resume,
                                 narrowable=tuple(self.decodes.keys) if layout.decode_dp > 1 else (),
                                 replace_timeout_s=decode_config.parallel.replace_timeout_s,
                                 pools={prefill_key(i): "prefill" for i in range(len(self.prefill))},
                                 retired=self.decodes.retired())
        self._kv: dict[str, list] = {}  # decode key -> its ranks' KV receivers, by rank
        self._dst_layout: dict = {}  # decode key -> its KV layout
        self._decode_pages = 0
        for key in self.decodes.active():
            self._learn_decode_layout(key)
        self.ep = EPControl(decode_config, layout.decode_tp, layout.decode_dp, self._decode_pages)

    @property
    def decode(self) -> GroupSupervisor:
        """The first decode group's supervisor (the only one in a one-group layout)."""
        return self.decodes.supervisors[0]

    @property
    def side(self) -> DPGroups:
        """The DP×EP groups the EP width applies to: the decode side's."""
        return self.decodes

    @property
    def decode_groups(self) -> list[GroupSupervisor]:
        return self.decodes.supervisors

    @property
    def recoveries(self) -> int:
        """Prefill instances re-formed so far."""
        return sum(n for key, n in self.recovery.formed.items() if not is_decode_key(key))

    @property
    def decode_recoveries(self) -> int:
        """Decode groups re-formed so far (faults and layout changes)."""
        return sum(n for key, n in self.recovery.formed.items() if is_decode_key(key))

    @property
    def reshapes(self) -> int:
        return self.recovery.reshapes

    def _learn_decode_layout(self, key: str) -> None:
        """Decode group `key`'s KV receivers and layout (after each formation)."""
        info = sorted(self.decodes.by_key[key].start_info, key=lambda i: i["rank"])
        self._kv[key] = [tuple(i["kv_address"]) for i in info]
        self._dst_layout[key] = info[0]["kv_layout"]
        self._decode_pages = self.decodes.fewest_pages(
            lambda k: k in self._kv and self.recovery.serving(k), self._decode_pages)

    def _decode_serving(self) -> list[str]:
        return [k for k in self.decodes.active() if self.recovery.serving(k)]

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
        elif req.dkey is None or not self.recovery.serving(req.dkey):
            return  # its pages and gates go with the decode group's epoch
        elif req.state == "prefill":  # taken apart by the polls: never waits on a rank
            self._aborting[request_id] = self._abort_cleanup(req)
        else:
            self._decode_leader(req).abort.remote(request_id)

    def _pump(self) -> None:
        """Start queued prefills, a batch of up to `PUMP_BATCH` at a time with one round
        of calls per batch (not per request): each DP leader reserves its requests' pages
        in arrival order and takes none after one that does not fit; a batch that starts
        nothing ends the pump until the next poll."""
        while self._queue and self._decode_serving() and self._serving_instances():
            batch = [self._reqs[rid] for rid in itertools.islice(self._queue, PUMP_BATCH)]
            started = self._start_prefills(batch)
            if not started:
                return
            self._queue = deque(rid for rid in self._queue
                                if self._reqs[rid].state == "queued")

    # -- outputs ---------------------------------------------------------------------
    def poll(self) -> list[StepOutput]:
        """Tokens of any request since the last poll, waiting at most ~`POLL_S`."""
        self.maintain()
        try:
            self._advance_aborts()
        except DecodeLost as e:  # its fence (next poll) puts the requests back in the queue
            log.warning("decode_group_lost", error=str(e))
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
            log.warning("decode_group_lost", error=str(e))
        out, self._out = self._out, []
        return out

    def maintain(self) -> None:
        """Recovery and layout work due now (a death to fence, a narrow group to widen,
        the EP-width policy's turn for the decode side); `GroupFailure` once the layout
        gave up."""
        self.recovery.reconcile()
        if self.ep.due() and len(self._decode_serving()) == len(self.decodes.active()):
            try:
                stats = self.leader_stats()["decode"]
            except TimeoutError:
                return
            decision = self.ep.decide(stats, self.decodes.layout, self._upstream(len(stats)))
            if decision.changed:
                self.reshape(decision.layout)
            self.recovery.reconcile()

    def _upstream(self, ranks: int) -> list[tuple[int, int]]:
        """Per decode DP rank, the requests bound for it that its engine does not count
        yet (queued here or in a prefill) and their prompt tokens: without them the
        policy sees a busy prefill side as an idle decode side and narrows."""
        return upstream_demand(((r.placement.dp_group, len(r.tokens)) for r in self._reqs.values()
                                if r.state != "decode"), ranks)

    def reshape(self, layout) -> None:
        """Serve the decode side with `layout` (an `EPLayout`): every decode group whose
        width changes is fenced and formed at its new width (planned); its requests
        start again on the group their DP rank lives in. Prefill instances stay."""
        before = self.decodes.layout
        widths = self.decodes.reshape(layout)
        log.warning("ep_layout_change", side="decode", before=str(before), after=str(layout))
        self.recovery.reshape(widths)

    def _issue_polls(self) -> None:
        waiting = set(self._pending.values())
        for i, group in enumerate(self.prefill):
            if not self.recovery.serving(prefill_key(i)):
                continue
            for r, actor in enumerate(group.actors):
                tag = ("prefill", i, r, group.epoch)
                if tag not in waiting:
                    self._pending[actor.poll_events.remote(POLL_S)] = tag
        for key in self._decode_serving():
            sup = self.decodes.by_key[key]
            for d, leader in enumerate(sup.leaders):
                tag = ("decode", key, d, sup.epoch)
                if tag not in waiting:
                    self._pending[leader.poll.remote(POLL_S)] = tag

    def _take(self, ref, tag) -> None:
        side, index, _, epoch = tag
        if side == "decode":
            if epoch != self.decodes.by_key[index].epoch:
                return  # fencing: a result of a replaced group never counts
            for o in self._decode_call(index, lambda: ray.get(ref)):
                req = self._reqs.get(o.request_id)
                if (o.epoch != epoch or req is None or req.state != "decode"
                        or req.dkey != index):
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
                               o.num_cached_tokens, self.decodes.by_key[req.dkey].epoch,
                               index=req.base, logprobs=o.logprobs,
                               prompt_logprobs=o.prompt_logprobs, queued_s=o.queued_s,
                               prefill_s=o.prefill_s)
        if len(req.emitted) == req.base:  # a re-prefill samples the same token: emit it once
            req.emitted.extend(req.first.new_token_ids)
            self._out.append(req.first)

    # -- operations ------------------------------------------------------------------
    def stats(self) -> dict:
        self.recovery.raise_if_failed()
        return {"decode": ray.get([a.stats.remote() for g in self.decode_groups for a in g.actors]),
                "prefill": [ray.get([a.stats.remote() for a in g.actors]) for g in self.prefill],
                "prefill_epochs": [g.epoch for g in self.prefill],
                "decode_epoch": self.decode.epoch,
                "decode_epochs": [g.epoch for g in self.decode_groups],
                "recoveries": self.recoveries, "decode_recoveries": self.decode_recoveries}

    def close(self) -> None:
        getattr(self, "_aborting", {}).clear()  # their groups go now (also after a failed start)
        self.decodes.close()
        for group in self.prefill:
            if group.actors:
                group.shutdown()
