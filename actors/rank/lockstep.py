"""`Lockstep`: one rank's share of its group's step, every rank of the group in the same
order, each step under the group's epoch (ARCHITECTURE §3, §5).

A step:
1. the leader of each DP group (TP rank 0) has scheduled a batch (or none);
2. it shares the plan with its TP followers (`plan`);
3. with several DP groups, all ranks agree in one small all-reduce whether anyone has
   work (or is stopping), on the largest batch, on whether any must run eager and on the
   last step's time (the slowest rank's); a DP group without work runs a dummy step so
   the MoE all-to-alls still match; every rank's micro-batch policy decides from those
   whether the step runs as two overlapped micro-batches (`MicrobatchControl`);
4. every rank runs the forward (a captured group graph where `GroupGraphs` fits), ends
   the step's peer exchanges within the deadline, and the leader samples and updates.
Any collective error or deadline raises out of `step`; the rank's loop then ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from threading import Event
from typing import Optional

import torch

from ...comm.dispatch import EPDispatcher
from ...comm.group_comm import GroupComm
from ...comm.peer_exchange import PeerExchange, open_moe_channels
from ...engine.compile_watch import keep_compiled_kernels
from ...engine.lanes import Lanes
from ...engine.llm_engine import LLMEngine
from ...engine.outputs import StepOutput
from ...log import get_logger
from ...models.parallel import ExpertParallel
from . import plan as planmod
from .group_graphs import GroupGraphs
from .microbatch_control import MicrobatchControl
from .role import RankRole
from .spec import RankSpec, shard_for, tensor_channel_bytes

__all__ = ["Lockstep"]

log = get_logger(__name__)

WAKE_POLL_S = 1e-3  # how often an idle rank of a group looks at its peers' wake counters


class Lockstep:
    """The communicators, engine, MoE exchanges and group graphs of one rank."""

    def __init__(self, spec: RankSpec, fault_point: Callable[[str], None]) -> None:
        self.spec = spec
        self.is_leader = spec.tp_rank == 0
        self.fault_point = fault_point
        self.comm: Optional[GroupComm] = None
        self.engine: Optional[LLMEngine] = None
        self.steps = 0
        self._padded: Optional[EPDispatcher] = None  # its padded exchange is sized per step
        self._dispatcher: Optional[EPDispatcher] = None  # told per step whether to overlap
        self.microbatch = MicrobatchControl(spec.config.parallel.microbatch, spec.world_size,
                                            enabled=spec.dp > 1)
        self._exchanges: tuple[PeerExchange, ...] = ()  # ep_exchange "peer": its channels
        self._peers = None
        self.graphs: Optional[GroupGraphs] = None  # the group's decode steps, captured
        self._plan_channel = False  # plans through shared memory (GroupComm.open_tp_channel)

    # -- formation -------------------------------------------------------------------
    def open(self, gpu_index: Callable[[], Optional[int]]) -> None:
        """Meet the peers (within the deadline), load the shard, open the exchanges."""
        s = self.spec
        torch.set_num_threads(max(1, torch.get_num_threads() // max(1, s.world_size)))
        config = s.config
        if config.device.startswith("cuda"):
            # One GPU per rank (under Ray: the one it assigned, every GPU of the node
            # visible, so peers can map each other's memory). Multi-rank steps run eager
            # (our NCCL deadline loop polls from the host, which a CUDA graph cannot),
            # except a peer-exchange group's decode steps (GroupGraphs).
            index = torch.device(config.device).index
            if index is None:
                index = gpu_index()
            torch.cuda.set_device(index if index is not None else s.rank % torch.cuda.device_count())
            config = dataclasses.replace(config, enforce_eager=True)
            keep_compiled_kernels()  # before the peer channels compile theirs
        self.comm = GroupComm.init(s.rank, s.world_size, s.tp, s.init_method, s.epoch,
                                   s.deadline_s, device=config.device)
        sch = config.scheduler
        self._plan_channel = s.tp > 1 and self.comm.open_tp_channel(planmod.max_words(
            sch.max_num_batched_tokens, sch.max_num_seqs,
            -(-config.max_model_len // config.cache.page_size)))
        self.comm.open_tensor_channels(*tensor_channel_bytes(s))
        shard, placement = shard_for(s, s.config.model.num_experts)
        ep = None
        if placement is not None:
            ep = ExpertParallel(EPDispatcher(self.comm, s.config.model.num_experts, placement[0],
                                             placement[1]), before_dispatch=self.fault_point)
        self.use_exchange(ep)
        self.engine = LLMEngine(config, shard, self.comm, ep)
        self.engine.warm_grammars()
        self.use_graphs(ep)

    def use_exchange(self, ep: Optional[ExpertParallel]) -> None:
        """Use the MoE exchange `ParallelConfig.ep_exchange` picks (padded and peer:
        sized per step from the token count the ranks agree on; peer: through the
        world's symmetric memory, collective)."""
        mode = self.spec.config.parallel.ep_exchange
        self._dispatcher = None if ep is None else ep.dispatcher
        self._padded = ep.dispatcher if ep is not None and mode in ("padded", "peer") else None
        if ep is not None and mode == "peer":
            self._exchanges = self._open_peer_exchanges(ep.dispatcher)

    def use_graphs(self, ep: Optional[ExpertParallel]) -> None:
        """The runner's lanes where the peer channels have two (micro-batches over the
        peer exchange), then capture the group's decode steps where `GroupGraphs.wanted`
        (the spec's config not eager; after the engine and the exchanges exist)."""
        s = self.spec
        if ep is not None and ep.dispatcher.peer_lanes == 2:
            self.engine.runner.lanes = Lanes(ep.dispatcher, s.config.model.num_experts_per_tok,
                                             self._exchanges[0].device)
        if ep is not None and GroupGraphs.wanted(s.config, s.tp, self._exchanges):
            self.graphs = GroupGraphs(self.engine, ep.dispatcher, self._exchanges,
                                      self.fault_point)
            log.info("group_graphs_captured", rank=s.rank, epoch=s.epoch,
                     sizes=self.graphs.graphs.sizes)

    def _open_peer_exchanges(self, dispatcher: EPDispatcher) -> tuple[PeerExchange, ...]:
        """The dispatch and combine channels, sized for decode steps: up to
        `max_num_seqs` tokens per DP rank (split over its TP ranks), top-k rows each; a
        second pair (lane) for two micro-batches unless the micro-batch policy is off."""
        s, cfg = self.spec, self.spec.config
        device = torch.device(cfg.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self._peers, channels = open_moe_channels(
            self.comm, device, -(-cfg.scheduler.max_num_seqs // s.tp),
            cfg.model.num_experts_per_tok, cfg.model.hidden_size,
            getattr(torch, cfg.torch_dtype_name), s.epoch, s.deadline_s,
            lanes=2 if self.microbatch.enabled and cfg.parallel.microbatch.policy != "off" else 1)
        dispatcher.use_peer_exchanges(*channels)
        return channels

    # -- the step --------------------------------------------------------------------
    def step(self, status: int, planned, role: RankRole) -> tuple[int, list[StepOutput]]:
        """One lockstep step from the leader's `status` and `planned` (batch, inputs)
        (followers: IDLE, None); the group's status and the leader's outputs."""
        s, engine = self.spec, self.engine
        batch, inputs = planned if planned is not None else (None, None)
        if s.tp > 1:
            status, inputs = self.share_plan(status, inputs)
        tokens = 0 if inputs is None else int(inputs.host["input_ids"].shape[0])
        eager = int(inputs is not None and not inputs.decode_only)
        if s.dp > 1:
            status, tokens, eager, last_us = self.comm.all_reduce_world_max(
                status, tokens, eager, self.microbatch.outgoing())
            self.microbatch.observe(last_us)
        if status != planmod.WORK:
            return status, []
        size = None if self.graphs is None else self.graphs.size(tokens, eager)
        hook = None if inputs is None else role.layer_hook(inputs)
        splittable = hook is None and (size is None or self.graphs.can_split(size))
        n = self.microbatch.decide(tokens, bool(eager), splittable)
        self.microbatch.start()
        if size is not None:
            logits = self.graphs.replay(inputs, size, split=n == 2)
        elif self._padded is not None:  # the most rows any rank's MoE layers dispatch
            self._padded.step_tokens = -(-tokens // s.tp)
        if self._dispatcher is not None:  # two micro-batches not on lanes: exchange thread
            lanes = engine.runner.lanes
            self._dispatcher.overlap = n == 2 and not (lanes is not None and lanes.ready())
        if inputs is None:
            if size is None:
                engine.runner.dummy_forward(n)
            self._settle_exchanges()
            self.microbatch.finish(tokens, bool(eager), n)
            return status, []
        if size is None:
            logits = engine.execute(inputs, hook, microbatches=n)
        self._settle_exchanges()
        self.microbatch.finish(tokens, bool(eager), n)
        role.after_forward(inputs)
        self.steps += 1
        return status, self.finish(batch, inputs, logits) if self.is_leader else []

    def share_plan(self, status: int, inputs):
        return planmod.share(self.comm, self.is_leader, self.spec.epoch, status, inputs,
                             self._plan_channel)

    def finish(self, batch, inputs, logits) -> list[StepOutput]:
        """The leader's sampling and scheduler update; outputs carry the epoch."""
        outputs = self.engine.update(batch, inputs, logits)
        for o in outputs:
            o.epoch = self.spec.epoch
        return outputs

    def _settle_exchanges(self) -> None:
        """End a step's peer exchanges within the deadline (CollectiveError if one of
        them failed): before anything reads what the step computed."""
        for ex in self._exchanges:
            ex.settle(self.spec.deadline_s)

    def idle_wait(self, wake: Event, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, until `wake` is set or a peer of one machine says it
        has work (`wake_peers`, watched every `WAKE_POLL_S`)."""
        seen = self.comm.wake_count() if self.spec.world_size > 1 else None
        if seen is None:
            wake.wait(timeout_s)
            return
        end = time.monotonic() + timeout_s
        while not wake.wait(min(WAKE_POLL_S, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end or self.comm.wake_count() != seen:
                return

    def close(self) -> None:
        """The loop ended: the exchange thread goes with it."""
        if self._dispatcher is not None:
            self._dispatcher.close()

    def stats(self) -> dict:
        out = {"steps": self.steps, **self.microbatch.stats()}
        if self._exchanges:
            out["peer_exchanges"] = sum(ex.exchanges for ex in self._exchanges)
            out["peer_exchanges_by_lane"] = [sum(ex.exchanges for ex in self._exchanges[i:i + 2])
                                             for i in range(0, len(self._exchanges), 2)]
        if self.graphs is not None:
            out["graph_replays"] = self.graphs.replays
            out["graph_split_replays"] = self.graphs.split_replays
        return out
