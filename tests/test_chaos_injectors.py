"""The chaos injectors on a real two-node Ray cluster of this machine, against stand-in
rank actors (the class name and namespace the chaos tool looks for): SIGKILL, SIGSTOP
then SIGCONT, ray.kill by name, arming a fault point, and removing a node (its raylet
killed: the node and the actor on it are gone)."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from phalanx.chaos.faults import parse_fault
from phalanx.chaos.injectors import Injectors, NoVictim
from phalanx.chaos.ranks import RANK_NAMESPACE, rank_processes

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=1)
class RankActor:  # the name the tool looks for in Ray's actor table
    def __init__(self) -> None:
        self.armed = []

    def arm_fault(self, point: str, after: int = 0, stall_s: float = 0.0,
                  drop: bool = False) -> None:
        self.armed.append((point, after, stall_s, drop))

    def faults(self) -> list:
        return self.armed

    def pid(self) -> int:
        import os
        return os.getpid()


def _state(pid: int) -> str:
    """The process's state letter (T: stopped)."""
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("State:"))


def _wait_state(pid: int, ok, within_s: float) -> bool:
    """Whether the process's state satisfies `ok` at some moment within `within_s`."""
    end = time.monotonic() + within_s
    while not ok(_state(pid)):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = c.add_node(num_cpus=2, resources={"worker": 1})
    ray.init(address=c.address, log_to_driver=False)
    yield c, worker
    ray.shutdown()
    c.shutdown()


def _ranks(n: int, **options) -> list:
    actors = [RankActor.options(name=f"rank-test-{time.monotonic_ns()}-{i}",
                                namespace=RANK_NAMESPACE, **options).remote() for i in range(n)]
    ray.get([a.pid.remote() for a in actors])
    return actors


def test_every_injector_reaches_its_victim(cluster):
    c, worker = cluster
    (a,) = _ranks(1)
    inj = Injectors(seed=0)
    pid = ray.get(a.pid.remote())

    done = inj.inject(parse_fault("fault-point:point=step:at=1s"))
    assert "step armed" in done.note and ray.get(a.faults.remote()) == [("step", 0, 0.0, False)]
    inj.inject(parse_fault("kv-delay:at=1s:for=2s:role=group"))
    assert ray.get(a.faults.remote())[-1] == ("kv_send", 0, 2.0, False)
    inj.inject(parse_fault("kv-drop:at=1s:role=group"))
    assert ray.get(a.faults.remote())[-1] == ("kv_send", 0, 0.0, True)

    paused = inj.inject(parse_fault("pause-rank:at=1s:for=3s"))
    assert str(pid) in paused.target
    # SIGSTOP lands when the kernel next handles the victim's signals: on a loaded machine
    # /proc may still say R for a moment; the injector resumes it 3 s after the stop.
    assert _wait_state(pid, lambda s: s == "T", 3.0), "stopped"
    with pytest.raises(NoVictim):  # the one rank is paused: nothing else to pause
        inj.inject(parse_fault("pause-rank:at=1s:for=1s"))
    assert _wait_state(pid, lambda s: s != "T", 30.0), "continued"
    assert ray.get(a.pid.remote()) == pid, "still serving"

    inj.inject(parse_fault("kill-actor:at=1s"))
    with pytest.raises(ray.exceptions.RayActorError):  # ray.kill lands asynchronously
        for _ in range(60):
            ray.get(a.pid.remote(), timeout=30)
            time.sleep(0.5)

    (b,) = _ranks(1)
    killed = inj.inject(parse_fault("kill-rank:at=1s"))
    assert "RankActor" in killed.target
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(b.pid.remote(), timeout=30)
    with pytest.raises(NoVictim):
        inj.inject(parse_fault("kill-rank:at=1s:role=decode"))


def test_remove_node_kills_a_worker_nodes_raylet(cluster):
    c, worker = cluster
    (on_worker,) = _ranks(1, resources={"worker": 1})
    removed = Injectors(seed=0).inject(parse_fault("remove-node:at=1s"))
    assert worker.node_id[:12] in removed.target
    end = time.monotonic() + 90
    while time.monotonic() < end and any(n["Alive"] for n in ray.nodes()
                                         if n["NodeID"] == worker.node_id):
        time.sleep(0.5)
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == worker.node_id)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(on_worker.pid.remote(), timeout=60)
    assert all(r.state == "DEAD" for r in rank_processes(alive_only=False))
