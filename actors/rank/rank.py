"""`Rank`: one rank of a multi-rank group, composed of a mailbox, a lockstep part and a
role. A plain class (no Ray): the actors in `actors/` wrap it, tests drive it directly.

One thread (the loop) owns the engine: it takes the mailbox's items, lets the leader
schedule, steps in lockstep with the group, publishes the leader's outputs and services
the role. Every other method runs on callers' threads and only posts to the mailbox or
reads state. Any error on the loop ends it; later calls raise `RankFailure`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch

from ...engine.expert_timing import time_experts
from ...engine.llm_engine import LLMEngine
from ...engine.kv_memory import torch_dtype
from ...engine.sampling_params import SamplingParams
from ...log import get_logger
from . import plan as planmod
from .fault_points import FaultPoints
from .lockstep import Lockstep
from .mailbox import Mailbox
from .role import RankRole
from .spec import RankFailure, RankSpec

__all__ = ["Rank"]

log = get_logger(__name__)

IDLE_SLEEP_MIN_S = 0.001
IDLE_SLEEP_MAX_S = 0.02
CALL_TIMEOUT_S = 30.0


class Rank:
    """A rank's mailbox, lockstep part and role, and the loop that runs them."""

    def __init__(self, spec: Optional[RankSpec] = None, role: Optional[RankRole] = None,
                 gpu_index: Callable[[], Optional[int]] = lambda: None) -> None:
        self.role = role if role is not None else RankRole()
        self.mailbox = Mailbox()
        self.faults = FaultPoints()
        self.lockstep: Optional[Lockstep] = None
        self.spec: Optional[RankSpec] = None
        self._gpu_index = gpu_index
        self._thread: Optional[threading.Thread] = None
        if spec is not None:
            self.configure(spec)

    # -- life cycle ------------------------------------------------------------------
    def configure(self, spec: RankSpec) -> None:
        """Set the spec before `start` (actors learn the rendezvous after creation)."""
        if self.lockstep is not None and self.lockstep.comm is not None:
            raise RuntimeError("configure after start")
        self.spec = spec
        self.faults.rank, self.faults.epoch = spec.rank, spec.epoch
        self.lockstep = Lockstep(spec, self.faults.passed)

    @property
    def is_leader(self) -> bool:
        return self.lockstep is not None and self.lockstep.is_leader

    @property
    def engine(self) -> Optional[LLMEngine]:
        return None if self.lockstep is None else self.lockstep.engine

    @property
    def comm(self):
        return None if self.lockstep is None else self.lockstep.comm

    def start(self) -> dict:
        """Meet the peers, load the shard, start the loop, then the role."""
        s, lockstep = self.spec, self.lockstep
        lockstep.open(self._gpu_index)
        if s.world_size > 1:
            self.mailbox.on_post = lockstep.comm.wake_peers
        self._thread = threading.Thread(target=self._run, name=f"rank{s.rank}-loop", daemon=True)
        self._thread.start()
        log.info("rank_started", rank=s.rank, epoch=s.epoch, tp_rank=s.tp_rank, dp_rank=s.dp_rank,
                 role=self.role.name, cuda_collectives_relayed=lockstep.comm.relay)
        cuda = s.config.device.startswith("cuda")
        info = {"rank": s.rank, "epoch": s.epoch, "pid": os.getpid(),
                "gpu": torch.cuda.current_device() if cuda else None,
                "num_params": sum(p.numel() for p in self.engine.model.parameters()),
                "num_pages": self.engine.num_pages}
        info.update(self.role.start(self))
        return info

    def stop(self) -> None:
        self.mailbox.stop()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[str]:
        """Block until the loop ends; the failure message, or None after a clean stop."""
        self.mailbox.done.wait(timeout_s)
        failure = self.mailbox.failure
        return None if failure is None else str(failure)

    # -- requests (DP leaders) -------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Validate now (ValueError to the caller), admit on the loop thread."""
        self.enqueue("add", request_id, prompt_token_ids, params)

    def enqueue(self, kind: str, request_id: str, prompt_token_ids: Sequence[int],
                params: SamplingParams, *extra) -> None:
        """Validate a new request in the caller's thread and queue it as inbox `kind`."""
        self._require_leader()
        self.engine.validate_prompt(prompt_token_ids, params)
        self.mailbox.admit(request_id, kind,
                           (request_id, list(prompt_token_ids), params, *extra))

    def abort(self, request_id: str) -> None:
        self.mailbox.abort(request_id)

    def poll(self, timeout_s: float = 0.1):
        """Outputs published since the last poll (waits up to `timeout_s` for some)."""
        return self.mailbox.poll(timeout_s)

    def run_on_loop(self, fn: Callable[[LLMEngine], Any], timeout_s: float = CALL_TIMEOUT_S):
        """Run `fn(engine)` on the loop thread (DP leaders) and return its result; its
        exception is raised here. TimeoutError if the loop does not get to it in time."""
        self._require_leader()
        return self.mailbox.call(fn, timeout_s, f"rank {self.spec.rank}")

    def _require_leader(self) -> None:
        if not self.is_leader:
            raise ValueError(f"rank {self.spec.rank} is not a DP leader")

    # -- fault injection (chaos drills) ----------------------------------------------
    def arm_fault(self, point: str, after: int = 0, stall_s: float = 0.0,
                  drop: bool = False) -> None:
        self.faults.arm(point, after, stall_s, drop)

    def fault_point(self, point: str) -> bool:
        """True: an armed drop fired (the caller drops what it was about to do)."""
        return self.faults.passed(point)

    # -- the loop --------------------------------------------------------------------
    def _run(self) -> None:
        idle = IDLE_SLEEP_MIN_S
        try:
            with torch.inference_mode():
                while True:
                    self.mailbox.wake.clear()  # an item posted from here on is seen by the step or wakes the wait
                    status = self._step()
                    self.role.service()
                    if status == planmod.STOP:
                        break
                    idle = min(idle * 2, IDLE_SLEEP_MAX_S) if status == planmod.IDLE else IDLE_SLEEP_MIN_S
                    if status == planmod.IDLE:
                        self.lockstep.idle_wait(self.mailbox.wake, idle)
        except Exception as e:  # noqa: BLE001 - every loop error is reported, none is lost
            self.mailbox.fail(RankFailure(self.spec.rank, self.spec.epoch,
                                          f"{type(e).__name__}: {e}"))
            log.error("rank_failed", rank=self.spec.rank, epoch=self.spec.epoch, error=str(e))
        finally:
            self.lockstep.close()
            self.mailbox.done.set()

    def _step(self) -> int:
        """One loop iteration: the leader takes its inbox and schedules, then the group
        steps in lockstep; returns the group's status (IDLE, WORK or STOP)."""
        self.fault_point("step")
        status, planned = planmod.IDLE, None
        if self.is_leader:
            if self._drain_inbox():
                status = planmod.STOP
            else:
                planned = self.engine.schedule()
                status = planmod.IDLE if planned is None else planmod.WORK
        status, outputs = self.lockstep.step(status, planned, self.role)
        self.mailbox.publish(outputs)
        return status

    def _drain_inbox(self) -> bool:
        items, stop = self.mailbox.take()
        for kind, item in items:
            self._handle(kind, item)
        return stop

    def _handle(self, kind: str, item) -> None:
        """Apply one inbox item on the loop thread (the role's kinds first)."""
        engine = self.engine
        if self.role.handle(kind, item):
            return
        if kind == "add":
            engine.add_request(*item)
        elif kind == "abort":
            engine.abort_request(item)
        elif kind == "call":
            fn, reply = item
            try:
                reply.append((True, fn(engine)))
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                reply.append((False, e))
        else:
            raise ValueError(f"unknown inbox item {kind!r}")

    # -- reports ---------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"rank": self.spec.rank, "epoch": self.spec.epoch,
               "failed": self.mailbox.failure is not None}
        out.update(self.lockstep.stats())
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

    def expert_costs(self, reps: int) -> tuple:
        """This rank's expert grid (`engine.expert_timing.time_experts`: its model's
        expert shapes, its device and dtype), measured on the calling thread, not the
        loop: the group's idle agreement keeps its deadline meanwhile."""
        if self.engine is None:
            raise RuntimeError(f"rank {self.spec.rank} has not started")
        engine = self.engine
        device = next(engine.model.parameters()).device
        on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
        with torch.inference_mode(), on_device:
            return time_experts(engine.config.model, device,
                                torch_dtype(engine.config.torch_dtype_name), reps)

    def held_prefix_changes(self, since: int) -> dict:
        """DP leaders (and prefill instance leaders): what the router needs to reconcile
        its prefix tree of this rank's group with the KV pool, given the eviction count
        `since` of its last report (-1: none): `{"seq": n, "evicted": [hashes that left
        the pool since]}`, or `{"seq": n, "full": [every held hash]}` when `since` is -1
        or the pool's eviction log no longer reaches back to it."""
        if self.engine is None:
            return {"seq": -1, "full": []}
        pool = self.engine.pool
        if since >= 0:
            seq, evicted = pool.evicted_since(since)
            if evicted is not None:
                return {"seq": seq, "evicted": evicted}
        seq = pool.evictions  # read first: a later eviction shows up in the next report
        return {"seq": seq, "full": pool.held_hashes()}
