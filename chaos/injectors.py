"""How a drill's faults reach the cluster: each `FaultSpec` kind carried out against the
Ray cluster this process is connected to (`ray.init(address=...)`), its rank processes
found through Ray's state (`ranks.rank_processes`).

- `kill-rank`: SIGKILL a rank process (one on this machine);
- `kill-actor`: `ray.kill` a rank actor by its id (any node);
- `pause-rank`: SIGSTOP a rank process, SIGCONT it `for` seconds later (a straggler: its
  group's deadline fences it; when it wakes it finds its epoch gone);
- `fault-point`: arm an internal fault point of a rank (the process exits at its next
  pass: inside an MoE all-to-all, at a step's start, before a KV send);
- `kv-delay`: arm a prefill rank's `kv_send` point to stall `for` seconds once;
- `kv-drop`: arm it to drop its next KV batch (the transfer fails; the request is
  prefilled again);
- `remove-node`: SIGKILL the raylet of a node other than the head (one on this machine):
  the node and every rank on it are gone.

`role` narrows the victims (`group`: colocated ranks; `prefill`, `decode`); a pick is
seeded. Each injection is recorded as an `Injected`.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .faults import FaultSpec
from .ranks import RankProcess, rank_handle, rank_processes, sigkill

__all__ = ["Injected", "Injectors", "NoVictim"]


class NoVictim(RuntimeError):
    """Nothing the fault could be applied to now (no rank of the role, no other node)."""


@dataclass(frozen=True, slots=True)
class Injected:
    t: float  # time.time() when it was applied
    spec: str
    target: str
    note: str = ""


def _local(pid: int) -> bool:
    """A Ray worker process of this machine."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


class Injectors:
    """Carries out faults; `paused` holds the pids stopped and not yet continued."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.paused: set[int] = set()
        self._lock = threading.Lock()

    def inject(self, spec: FaultSpec, only: Optional[set[str]] = None) -> Injected:
        """Apply `spec` once (`only`: actor ids to choose among, e.g. a group being
        re-formed); NoVictim when there is nothing to apply it to."""
        if spec.kind == "remove-node":
            return self._remove_node(spec)
        victim = self._victim(spec, only)
        if spec.kind == "kill-rank":
            if not sigkill(victim.pid):
                raise NoVictim(f"pid {victim.pid} was gone already")
            return Injected(time.time(), spec.text, f"pid {victim.pid} ({victim.class_name})")
        if spec.kind == "pause-rank":
            return self._pause(spec, victim)
        try:
            handle = rank_handle(victim)
        except ValueError as e:
            raise NoVictim(str(e)) from None
        if spec.kind == "kill-actor":
            import ray
            ray.kill(handle, no_restart=True)
            return Injected(time.time(), spec.text, f"actor {victim.name}")
        point = "kv_send" if spec.kind in ("kv-delay", "kv-drop") else spec.point
        stall, drop = (spec.for_s if spec.kind == "kv-delay" else 0.0), spec.kind == "kv-drop"
        handle.arm_fault.remote(point, 0, stall, drop)
        return Injected(time.time(), spec.text, f"actor {victim.name}",
                        f"{point} armed" + (f", stall {stall:g} s" if stall else "")
                        + (", drop" if drop else ""))

    def _victim(self, spec: FaultSpec, only: Optional[set[str]]) -> RankProcess:
        roles = _roles(spec)
        local = spec.kind in ("kill-rank", "pause-rank")
        pool = [r for r in rank_processes()
                if (roles is None or r.role in roles) and (only is None or r.actor_id in only)
                and (not local or _local(r.pid)) and r.pid not in self.paused]
        if not pool:
            where = " on this machine" if local else ""
            raise NoVictim(f"{spec.kind}: no live rank process{where}"
                           + (f" of role {'/'.join(roles)}" if roles else ""))
        return self.rng.choice(pool)

    def _pause(self, spec: FaultSpec, victim: RankProcess) -> Injected:
        os.kill(victim.pid, signal.SIGSTOP)
        with self._lock:
            self.paused.add(victim.pid)
        timer = threading.Timer(spec.for_s, self._resume, (victim.pid,))
        timer.daemon = True
        timer.start()
        return Injected(time.time(), spec.text, f"pid {victim.pid} ({victim.class_name})",
                        f"stopped for {spec.for_s:g} s")

    def _resume(self, pid: int) -> None:
        with self._lock:
            self.paused.discard(pid)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # fenced and killed while stopped
            pass

    def resume_all(self) -> None:
        """SIGCONT every process still stopped (the drill is over)."""
        for pid in list(self.paused):
            self._resume(pid)

    def _remove_node(self, spec: FaultSpec) -> Injected:
        import ray
        head = ray.get_runtime_context().get_node_id()
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head]
        raylets = _raylets()
        local = [n for n in nodes if n in raylets]
        if not local:
            raise NoVictim("remove-node: no live node other than the head has its raylet "
                           "on this machine")
        node = self.rng.choice(sorted(local))
        sigkill(raylets[node])
        return Injected(time.time(), spec.text, f"node {node[:12]}", f"raylet pid {raylets[node]}")


def _roles(spec: FaultSpec) -> Optional[tuple[str, ...]]:
    """The rank roles `spec` may hit: its `role`, else the ranks that pass its point (an
    MoE dispatch: DP×EP ranks; a KV send: prefill ranks), else any."""
    if spec.role is not None:
        return (spec.role,)
    point = "kv_send" if spec.kind in ("kv-delay", "kv-drop") else spec.point
    return {"kv_send": ("prefill",), "moe_dispatch": ("group", "decode")}.get(point)


def _raylets() -> dict[str, int]:
    """Node id -> pid of every raylet process of this machine."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"/raylet"):
            for a in args:
                if a.startswith(b"--node_id="):
                    out[a.split(b"=", 1)[1].decode()] = int(entry)
    return out
