"""One rank of a multi-rank group: its shard, its communicators and its step loop.

A plain class (no Ray): `actors.RankActor` wraps it, tests drive it directly. One thread
owns the engine and runs the loop; the other methods only enqueue work and read state.

Every loop iteration is lockstep across the group:
1. the leader of each DP group (TP rank 0) schedules a batch (or none);
2. it broadcasts the plan to its TP followers (`engine.plan`);
3. with several DP groups, all ranks agree in one small all-reduce whether anyone has
   work (or is stopping); a DP group without work runs a dummy step so that the MoE
   all-to-alls still match;
4. every rank runs the forward; the leader samples, updates its scheduler and publishes
   the step's outputs in one batch.
Any collective error or deadline ends the loop; `poll` then raises `RankFailure`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Optional, Sequence as Seq

import torch

from ..comm.group_comm import GroupComm
from ..comm.dispatch import EPDispatcher
from ..comm.peer_exchange import PeerExchange, open_moe_channels
from ..log import get_logger
from ..models.parallel import ExpertParallel
from . import plan as planmod
from .group_graphs import GroupGraphs
from .llm_engine import LLMEngine
from .outputs import StepOutput
from .rank_spec import RankFailure, RankSpec, shard_for, tensor_channel_bytes
from .sampling_params import SamplingParams

log = get_logger(__name__)

IDLE_SLEEP_MIN_S = 0.001
IDLE_SLEEP_MAX_S = 0.02
WAKE_POLL_S = 1e-3  # how often an idle rank of a group looks at its peers' wake counters


class RankEngine:
    """A rank's engine plus the loop that steps it in lockstep with its peers."""

    def __init__(self, spec: Optional[RankSpec] = None) -> None:
        self.spec = spec
        self.is_leader = spec is not None and spec.tp_rank == 0
        self.comm: Optional[GroupComm] = None
        self.engine: Optional[LLMEngine] = None
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._wake = threading.Event()  # set with every inbox item: an idle loop takes it now
        self._outbox: list[StepOutput] = []
        self._live: set[str] = set()  # submitted, not yet finished or aborted
        self._failure: Optional[RankFailure] = None
        self._stop = False
        self._done = threading.Event()
        self._faults: dict[str, tuple[int, float]] = {}  # point -> (passes left, stall_s)
        self._thread: Optional[threading.Thread] = None
        self._padded: Optional[EPDispatcher] = None  # its padded exchange is sized per step
        self._exchanges: tuple[PeerExchange, ...] = ()  # ep_exchange "peer": its channels
        self._peers = None
        self._graphs: Optional[GroupGraphs] = None  # the group's decode steps, captured
        self._plan_channel = False  # plans through shared memory (GroupComm.open_tp_channel)
        self.steps = 0

    # -- life cycle ------------------------------------------------------------------
    def configure(self, spec: RankSpec) -> None:
        """Set the spec before `start` (actors learn the rendezvous after creation)."""
        if self.comm is not None:
            raise RuntimeError("configure after start")
        self.spec = spec
        self.is_leader = spec.tp_rank == 0

    def start(self) -> dict:
        """Meet the peers (within the deadline), load the shard, start the loop."""
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
                index = self.gpu_index()
            torch.cuda.set_device(index if index is not None else s.rank % torch.cuda.device_count())
            config = dataclasses.replace(config, enforce_eager=True)
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
        self.use_graphs(ep)
        self._thread = threading.Thread(target=self._run, name=f"rank{s.rank}-loop", daemon=True)
        self._thread.start()
        log.info("rank_started", rank=s.rank, epoch=s.epoch, tp_rank=s.tp_rank, dp_rank=s.dp_rank,
                 cuda_collectives_relayed=self.comm.relay)
        return {"rank": s.rank, "epoch": s.epoch, "pid": os.getpid(),
                "gpu": torch.cuda.current_device() if config.device.startswith("cuda") else None,
                "num_params": sum(p.numel() for p in self.engine.model.parameters()),
                "num_pages": self.engine.num_pages}

    def gpu_index(self) -> Optional[int]:
        """The CUDA index this rank runs on when its config names none: None here (rank
        modulo the visible GPUs); the Ray actor answers with the GPU Ray assigned it."""
        return None

    def use_exchange(self, ep: Optional[ExpertParallel]) -> None:
        """Use the MoE exchange `ParallelConfig.ep_exchange` picks (padded and peer:
        sized per step from the token count the ranks agree on; peer: through the
        world's symmetric memory, collective)."""
        mode = self.spec.config.parallel.ep_exchange
        self._padded = ep.dispatcher if ep is not None and mode in ("padded", "peer") else None
        if ep is not None and mode == "peer":
            self._exchanges = self._open_peer_exchanges(ep.dispatcher)

    def use_graphs(self, ep: Optional[ExpertParallel]) -> None:
        """Capture the group's decode steps where `GroupGraphs.wanted` (the spec's config
        not eager; after the engine and the exchanges exist)."""
        s = self.spec
        if ep is not None and GroupGraphs.wanted(s.config, s.tp, self._exchanges):
            self._graphs = GroupGraphs(self.engine, ep.dispatcher, self._exchanges,
                                       self.fault_point)
            log.info("group_graphs_captured", rank=s.rank, epoch=s.epoch,
                     sizes=self._graphs.graphs.sizes)

    def _open_peer_exchanges(self, dispatcher: EPDispatcher) -> tuple[PeerExchange, ...]:
        """The dispatch and combine channels, sized for decode steps: up to
        `max_num_seqs` tokens per DP rank (split over its TP ranks), top-k rows each."""
        s, cfg = self.spec, self.spec.config
        device = torch.device(cfg.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self._peers, channels = open_moe_channels(
            self.comm, device, -(-cfg.scheduler.max_num_seqs // s.tp),
            cfg.model.num_experts_per_tok, cfg.model.hidden_size,
            getattr(torch, cfg.torch_dtype_name), s.epoch, s.deadline_s)
        dispatcher.use_peer_exchanges(*channels)
        return channels

    def _settle_exchanges(self) -> None:
        """End a step's peer exchanges within the deadline (CollectiveError if one of
        them failed): before anything reads what the step computed."""
        for ex in self._exchanges:
            ex.settle(self.spec.deadline_s)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
        self._wake.set()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[str]:
        """Block until the loop ends; the failure message, or None after a clean stop."""
        self._done.wait(timeout_s)
        return None if self._failure is None else str(self._failure)

    # -- requests (DP leaders) -------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Validate now (ValueError to the caller), admit on the loop thread."""
        self._enqueue_request("add", request_id, prompt_token_ids, params)

    def _enqueue_request(self, kind: str, request_id: str, prompt_token_ids: Seq[int],
                         params: SamplingParams, *extra) -> None:
        """Validate a new request in the caller's thread and queue it as inbox `kind`."""
        if not self.is_leader:
            raise ValueError(f"rank {self.spec.rank} is not a DP leader")
        self.engine.validate_prompt(prompt_token_ids, params)
        with self._lock:
            self._raise_if_failed()
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._live.add(request_id)
            self._post(kind, (request_id, list(prompt_token_ids), params, *extra))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._post("abort", request_id)

    def _post(self, kind: str, item) -> None:
        """Queue an inbox item for the loop thread (the lock held) and wake it, and its
        idle peers, whose next round it needs."""
        self._inbox.append((kind, item))
        self._wake.set()
        if self.comm is not None and self.spec.world_size > 1:
            self.comm.wake_peers()

    def poll(self, timeout_s: float = 0.1) -> list[StepOutput]:
        """Outputs published since the last poll (waits up to `timeout_s` for some)."""
        with self._lock:
            if not self._outbox and self._failure is None:
                self._lock.wait(timeout_s)
            self._raise_if_failed()
            out, self._outbox = self._outbox, []
        return out

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    # -- fault injection (chaos drills) ----------------------------------------------
    def arm_fault(self, point: str, after: int = 0, stall_s: float = 0.0) -> None:
        """At the `after`-th next pass through `point`: exit the process, or (`stall_s`
        > 0) hold the passing thread that long, once (a rank that stalls mid-step)."""
        if after < 0 or stall_s < 0:
            raise ValueError(f"after and stall_s must be >= 0, got {after}, {stall_s}")
        self._faults[point] = (after, stall_s)

    def fault_point(self, point: str) -> None:
        armed = self._faults.get(point)
        if armed is None:
            return
        left, stall_s = armed
        if left > 0:
            self._faults[point] = (left - 1, stall_s)
            return
        log.warning("fault_injected", rank=self.spec.rank, epoch=self.spec.epoch, point=point,
                    stall_s=stall_s)
        if not stall_s:
            os._exit(17)
        del self._faults[point]
        time.sleep(stall_s)

    # -- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        idle = IDLE_SLEEP_MIN_S
        try:
            with torch.inference_mode():
                while True:
                    self._wake.clear()  # an item posted from here on is seen by the step or wakes the wait
                    status = self._step()
                    self._service()
                    if status == planmod.STOP:
                        break
                    idle = min(idle * 2, IDLE_SLEEP_MAX_S) if status == planmod.IDLE else IDLE_SLEEP_MIN_S
                    if status == planmod.IDLE:
                        self._idle_wait(idle)
        except Exception as e:  # noqa: BLE001 - every loop error is reported, none is lost
            with self._lock:
                self._failure = RankFailure(self.spec.rank, self.spec.epoch, f"{type(e).__name__}: {e}")
                self._lock.notify_all()
            log.error("rank_failed", rank=self.spec.rank, epoch=self.spec.epoch, error=str(e))
        finally:
            self._done.set()

    def _idle_wait(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, until this rank's inbox gets an item or a peer of
        one machine says it has one (`wake_peers`, watched every `WAKE_POLL_S`)."""
        seen = self.comm.wake_count() if self.spec.world_size > 1 else None
        if seen is None:
            self._wake.wait(timeout_s)
            return
        end = time.monotonic() + timeout_s
        while not self._wake.wait(min(WAKE_POLL_S, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end or self.comm.wake_count() != seen:
                return

    def _drain_inbox(self) -> bool:
        with self._lock:
            items, self._inbox = self._inbox, []
            stop = self._stop
        for kind, item in items:
            self._handle(kind, item)
        return stop

    def _handle(self, kind: str, item) -> None:
        """Apply one inbox item on the loop thread (subclasses add kinds)."""
        if kind == "add":
            self.engine.add_request(*item)
        elif kind == "abort":
            self.engine.abort_request(item)
        elif kind == "call":
            fn, reply = item
            try:
                reply.append((True, fn(self.engine)))
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                reply.append((False, e))
        else:
            raise ValueError(f"unknown inbox item {kind!r}")

    def run_on_loop(self, fn, timeout_s: float = 30.0):
        """Run `fn(engine)` on the loop thread (DP leaders) and return its result; its
        exception is raised here. TimeoutError if the loop does not get to it in time."""
        if not self.is_leader:
            raise ValueError(f"rank {self.spec.rank} is not a DP leader")
        reply: list = []
        with self._lock:
            self._raise_if_failed()
            self._post("call", (fn, reply))
        end = time.monotonic() + timeout_s
        while not reply:
            if time.monotonic() > end:
                raise TimeoutError(f"rank {self.spec.rank}: loop busy for {timeout_s} s")
            with self._lock:
                self._raise_if_failed()
            time.sleep(0.0005)
        ok, value = reply[0]
        if not ok:
            raise value
        return value

    # -- extension points (disaggregated roles) --------------------------------------
    def _layer_hook(self, inputs):
        """A `layer_done(i)` callback for this step's forward, or None."""
        return None

    def _after_forward(self, inputs) -> None:
        """Runs on every rank after a real forward (before sampling)."""

    def _service(self) -> None:
        """Runs once per loop iteration, work or not (e.g. to reap finished transfers)."""

    def _step(self) -> int:
        """One lockstep iteration; returns the group's status (IDLE, WORK or STOP)."""
        self.fault_point("step")
        s, engine = self.spec, self.engine
        batch, inputs, status = None, None, planmod.IDLE
        if self.is_leader:
            if self._drain_inbox():
                status = planmod.STOP
            else:
                planned = engine.schedule()
                if planned is not None:
                    (batch, inputs), status = planned, planmod.WORK
        if s.tp > 1:
            status, inputs = self._share_plan(status, inputs)
        tokens = 0 if inputs is None else int(inputs.host["input_ids"].shape[0])
        eager = int(inputs is not None and not inputs.decode_only)
        if s.dp > 1:
            status, tokens, eager = self.comm.all_reduce_world_max(status, tokens, eager)
        if status != planmod.WORK:
            return status
        size = None if self._graphs is None else self._graphs.size(tokens, eager)
        if size is not None:
            logits = self._graphs.replay(inputs, size)
        elif self._padded is not None:  # the most rows any rank's MoE layers dispatch
            self._padded.step_tokens = -(-tokens // s.tp)
        if inputs is None:
            if size is None:
                self.engine.model.dummy_forward()
            self._settle_exchanges()
            return status
        if size is None:
            logits = engine.execute(inputs, self._layer_hook(inputs))
        self._settle_exchanges()
        self._after_forward(inputs)
        self.steps += 1
        if self.is_leader:
            self._finish(batch, inputs, logits)
        return status

    def _share_plan(self, status: int, inputs):
        return planmod.share(self.comm, self.is_leader, self.spec.epoch, status, inputs,
                             self._plan_channel)

    def _finish(self, batch, inputs, logits) -> None:
        outputs = self.engine.update(batch, inputs, logits)
        for o in outputs:
            o.epoch = self.spec.epoch
        if outputs:
            with self._lock:
                self._outbox.extend(outputs)
                self._live.difference_update(o.request_id for o in outputs if o.finished)
                self._lock.notify_all()

    def stats(self) -> dict:
        out = {"rank": self.spec.rank, "epoch": self.spec.epoch, "steps": self.steps,
               "failed": self._failure is not None}
        if self._exchanges:
            out["peer_exchanges"] = sum(ex.exchanges for ex in self._exchanges)
        if self._graphs is not None:
            out["graph_replays"] = self._graphs.replays
        if self.is_leader and self.engine is not None:
            out.update(self.engine.stats())
            out["prefix_query_tokens"] = self.engine.pool.query_tokens
        return out

    def kv_check(self) -> dict:
        """DP leaders: the KV pool's invariants checked on the loop thread
        (AssertionError if one is broken) and its page counts: `{"pages": n, "free": n,
        "cached": n}` (free pages may still hold cached prefixes)."""
        def check(engine) -> dict:
            pool = engine.pool
            pool.check_integrity()
            return {"pages": pool.num_pages, "free": pool.num_free_pages,
                    "cached": len(pool.cached)}
        return self.run_on_loop(check)

    def held_prefix_changes(self, since: int) -> dict:
        """DP leaders (and prefill instance leaders): what the router needs to reconcile
        its prefix tree of this rank's group with the KV pool, given the
        eviction count `since` of its last report (-1: none): `{"seq": n, "evicted":
        [hashes that left the pool since]}`, or `{"seq": n, "full": [every held hash]}`
        when `since` is -1 or the pool's eviction log no longer reaches back to it."""
        if self.engine is None:
            return {"seq": -1, "full": []}
        pool = self.engine.pool
        if since >= 0:
            seq, evicted = pool.evicted_since(since)
            if evicted is not None:
                return {"seq": seq, "evicted": evicted}
        seq = pool.evictions  # read first: a later eviction shows up in the next report
        return {"seq": seq, "full": pool.held_hashes()}
