"""Forms a group of rank actors under an epoch and learns of their deaths from Ray.

A group is gang-scheduled with one placement group (a TP group packed on one node;
DP×EP groups packed where possible). Every formation is a new epoch with a new
rendezvous; actors of an older epoch are never reused. The supervisor watches each
rank's `wait()` call: it returns when the rank's loop ends (with the failure message,
if any) and raises `RayActorError` when the process died.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import EngineConfig
from ..log import get_logger
from .formation import Formation, Wait, gather
from .rank.spec import RankSpec
from .rank_actor import MAX_CONCURRENCY, RemoteRank

log = get_logger(__name__)

START_TIMEOUT_S = 300.0
# Rank actors are named in this Ray namespace, so that a tool outside the server's
# process (the chaos drill) can reach one by name (`chaos.ranks.RANK_NAMESPACE`).
RANK_NAMESPACE = "phalanx-ranks"


@dataclasses.dataclass(frozen=True, slots=True)
class RankDeath:
    rank: int
    epoch: int
    reason: str  # "process died" or the rank's failure message


class GroupFailure(RuntimeError):
    """A group lost a rank (or a rank failed); no token of the faulted step was published."""

    def __init__(self, epoch: int, deaths: list[RankDeath]) -> None:
        dead = ", ".join(f"rank {d.rank}: {d.reason}" for d in deaths)
        super().__init__(f"group epoch {epoch} failed: {dead}")
        self.epoch, self.deaths = epoch, deaths

    def __reduce__(self):
        return (GroupFailure, (self.epoch, self.deaths))

    @property
    def dead_ranks(self) -> list[int]:
        return [d.rank for d in self.deaths if d.reason == "process died"]


class CapacityShort(RuntimeError):
    """A formation's placement found no room within its deadline (a node left, no free
    CPU/GPU): the group may form narrower."""


class GroupSupervisor:
    """Starts, watches and stops the rank actors of one TP or DP×EP group."""

    def __init__(self, config: EngineConfig, tp: int, dp: int, deadline_s: float,
                 actor_cls=None) -> None:
        """`actor_cls`: the Ray actor class of a rank (default `RemoteRank`; benchmarks
        and tests pass a `ray.remote` subclass of `RankActor`)."""
        self.config, self.tp, self.dp, self.deadline_s = config, tp, dp, deadline_s
        self.actor_cls = actor_cls if actor_cls is not None else RemoteRank
        self.epoch = 0
        self.actors: list = []
        self._waits: dict = {}
        self._pgs: list = []
        self.start_info: list[dict] = []
        self._formation: Optional[Formation] = None  # one under way (`begin_form`)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def leaders(self) -> list:
        return self.actors[::self.tp]

    def form(self, min_epoch: int = 0, dp: Optional[int] = None,
             placement_timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every rank of a new epoch (at least `min_epoch`); returns once all have
        met and loaded. The first failure of any rank's call (its process died, its
        rendezvous or load failed) raises at once, without waiting for the others.
        `dp`: form with this many DP ranks from now on (experts re-sharded over them);
        `CapacityShort` when the placement groups find no room within
        `placement_timeout_s`. A formation that failed leaves nothing behind.

        The rendezvous port is bound by rank 0's actor when it names the address
        (`comm.rendezvous.held_address`) and held until rank 0 joins, so no other
        socket can take it in between."""
        self.begin_form(min_epoch, dp, placement_timeout_s)
        self._drive(lambda f: f.run())

    def begin_form(self, min_epoch: int = 0, dp: Optional[int] = None,
                   placement_timeout_s: float = START_TIMEOUT_S) -> None:
        """`form`, started: its calls are made and `advance_form` takes it further
        without blocking. A formation under way is abandoned first."""
        self.shutdown()
        self.epoch = max(self.epoch, min_epoch - 1)
        self.dp = self.dp if dp is None else dp
        self._drive(lambda f: None, lambda: Formation(self._steps(placement_timeout_s)))

    def advance_form(self) -> bool:
        """True once the formation begun has formed (or none is under way); raises its
        error (the formation then left nothing behind)."""
        if self._formation is None:
            return True
        return self._drive(lambda f: f.advance())

    def _drive(self, step, start=None):
        """`step(formation)` on the formation under way (or the one `start()` makes)."""
        try:
            if start is not None:
                self._formation = start()
            out = step(self._formation)
        except BaseException:
            self.shutdown()  # nothing of a formation that failed stays behind
            raise
        if self._formation.done:
            self._formation = None
        return out

    def _steps(self, placement_timeout_s: float):
        """The formation's steps (`Formation`): placement, actors, rendezvous, configure,
        start."""
        self.epoch += 1
        gpu = self.config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        # One placement group per TP group, strictly packed on one node (TP stays inside
        # a node's fast links); DP groups may land on different nodes.
        self._pgs = [placement_group([bundle] * self.tp, strategy="STRICT_PACK") for _ in range(self.dp)]
        yield Wait([pg.ready() for pg in self._pgs], placement_timeout_s, lambda: CapacityShort(
            f"no room for {self.dp} placement group(s) of {self.tp} {'GPU' if gpu else 'CPU'} "
            f"rank(s) within {placement_timeout_s} s"))
        env = {"runtime_env": {"env_vars": env_vars}} if (env_vars := self._env_vars()) else {}
        tag = uuid.uuid4().hex[:12]  # names are unique in the namespace, as Ray wants
        self.actors = [
            self.actor_cls.options(
                name=f"rank-{tag}-e{self.epoch}-r{r}", namespace=RANK_NAMESPACE,
                num_cpus=1, num_gpus=1 if gpu else 0, max_concurrency=MAX_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pgs[r // self.tp], placement_group_bundle_index=r % self.tp),
                **env,
            ).remote(None) for r in range(self.world_size)]
        (address,) = yield Wait([self.actors[0].rendezvous_address.remote()], START_TIMEOUT_S)
        specs = [RankSpec(r, self.tp, self.dp, self.epoch, address, self.deadline_s, self.config)
                 for r in range(self.world_size)]
        yield Wait([a.configure.remote(s) for a, s in zip(self.actors, specs)], START_TIMEOUT_S)
        self.start_info = yield Wait([a.start.remote() for a in self.actors], START_TIMEOUT_S)
        self._waits = {a.wait.remote(): r for r, a in enumerate(self.actors)}
        log.info("group_formed", epoch=self.epoch, tp=self.tp, dp=self.dp, address=address)

    def _env_vars(self) -> dict[str, str]:
        """The rank processes' environment. GPU: Ray leaves every GPU of the node
        visible (the rank picks the one Ray assigned it: `RankActor.gpu_index`), since
        CUDA IPC and NVSHMEM map a peer's memory only from a process that sees the
        peer's GPU. CPU with the peer exchange: its kernels run under Triton's
        interpreter, which Triton reads from its environment when first imported."""
        if self.config.device.startswith("cuda"):
            return {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
        if self.config.parallel.ep_exchange == "peer" and self.dp > 1:
            return {"TRITON_INTERPRET": "1"}
        return {}

    def deaths(self, timeout_s: float = 0.0) -> list[RankDeath]:
        """Ranks whose loop has ended since formation (dead processes first)."""
        ready, _ = ray.wait(list(self._waits), num_returns=len(self._waits), timeout=timeout_s)
        out = []
        for ref in ready:
            rank = self._waits[ref]
            try:
                message = ray.get(ref)
            except RayActorError:
                out.append(RankDeath(rank, self.epoch, "process died"))
                continue
            if message is not None:
                out.append(RankDeath(rank, self.epoch, message))
        return sorted(out, key=lambda d: (d.reason != "process died", d.rank))

    def wait_for_failure(self, timeout_s: float) -> list[RankDeath]:
        """Waits until every rank's loop has ended or `timeout_s` passed."""
        end = time.monotonic() + timeout_s
        deaths = self.deaths()
        while len(deaths) < self.world_size and time.monotonic() < end:
            time.sleep(0.05)
            deaths = self.deaths()
        return deaths

    def room_for(self, groups: int) -> bool:
        """Whether `groups` more TP groups of this one's shape (each packed on one node)
        would find room now, from the resources Ray reports free per node."""
        kind = "GPU" if self.config.device.startswith("cuda") else "CPU"
        per_node = ray._private.state.available_resources_per_node()
        fits = sum(int(res.get(kind, 0.0) // self.tp) for res in per_node.values())
        return fits >= groups

    @property
    def pids(self) -> list[int]:
        """Each rank's process id, by rank (once formed)."""
        return [int(info["pid"]) for info in sorted(self.start_info, key=lambda i: i["rank"])]

    def shutdown(self) -> None:
        """Kill every actor of this epoch and free its placement groups (never raises:
        some of them may be dead or half made)."""
        for a in self.actors:
            _quietly(lambda: a.stop.remote())
        for a in self.actors:
            _quietly(lambda: ray.kill(a, no_restart=True))
        for pg in self._pgs:
            _quietly(lambda: remove_placement_group(pg))
        self.actors, self._waits, self._pgs, self.start_info = [], {}, [], []
        if self._formation is not None:
            self._formation.close()
            self._formation = None

    def failure(self, timeout_s: float = 0.0) -> Optional[GroupFailure]:
        deaths = self.deaths(timeout_s)
        return GroupFailure(self.epoch, deaths) if deaths else None


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - tearing down what may already be gone
        log.debug("teardown_step_failed", error=repr(e)[:200])


def settle(refs, timeout_s: float = 2.0) -> None:
    """Retrieve the results of calls made on a replaced group (their errors are
    expected) so that Ray does not log each as an unhandled error when it is dropped."""
    refs = list(refs)
    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - the group is gone; its answers do not matter
            pass


def ensure_ray(num_cpus: Optional[int] = None, address: Optional[str] = None) -> None:
    """Join `address`, or start a new local Ray with enough logical CPUs for the ranks
    (never silently attach to another cluster already running on this machine)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


__all__ = ["CapacityShort", "GroupSupervisor", "GroupFailure", "RankDeath", "ensure_ray", "gather", "settle",
           "GetTimeoutError"]
