"""Rank processes as Ray's state lists them, and killing them from outside.

Ray's state API (`ray.util.state.list_actors`) answers through the dashboard; a cluster
started without one (phalanx's local default, CI) still has the GCS actor table, which
holds the same facts (class, state, pid, node). `rank_processes` asks the first that
answers. The caller must be connected to the cluster (`ray.init(address=...)`).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["RANK_CLASSES", "RANK_NAMESPACE", "RankProcess", "rank_handle", "rank_processes",
           "sigkill"]

RANK_CLASSES = ("RankActor", "PrefillRank", "DecodeRank")
RANK_NAMESPACE = "phalanx-ranks"  # where the supervisor names its rank actors


@dataclass(frozen=True, slots=True)
class RankProcess:
    pid: int
    actor_id: str
    class_name: str  # RankActor (colocated), PrefillRank, DecodeRank
    node_id: str
    state: str  # ALIVE, DEPENDENCIES_UNREADY, PENDING_CREATION, RESTARTING, DEAD
    name: str = ""  # its name in RANK_NAMESPACE ("" for an unnamed actor)

    @property
    def role(self) -> str:
        return {"PrefillRank": "prefill", "DecodeRank": "decode"}.get(self.class_name, "group")


def _from_state_api() -> list[RankProcess] | None:
    try:
        from ray.util.state import list_actors
        rows = list_actors(limit=10_000, raise_on_missing_output=False, timeout=5)
    except Exception:  # noqa: BLE001 - no dashboard: fall back to the GCS table
        return None
    return [RankProcess(int(r.pid or 0), r.actor_id, r.class_name, r.node_id or "", r.state,
                        r.name or "") for r in rows]


def _from_gcs() -> list[RankProcess]:
    import ray
    table = ray._private.state.actors()  # the GCS actor table, as `ray list actors` reads it
    return [RankProcess(int(a.get("Pid") or 0), a["ActorID"], a.get("ActorClassName") or "",
                        (a.get("Address") or {}).get("NodeID", ""), a.get("State", ""),
                        a.get("Name") or "") for a in table.values()]


def rank_processes(alive_only: bool = True, use_dashboard: bool = False) -> list[RankProcess]:
    """Every phalanx rank actor of the cluster, in the order Ray lists them; by default
    only those with a live process (ALIVE, or still in its constructor: a rank of a
    group being formed has a process before Ray calls it alive)."""
    rows = (_from_state_api() if use_dashboard else None) or _from_gcs()
    rows = [r for r in rows if r.class_name in RANK_CLASSES]
    if alive_only:
        rows = [r for r in rows if r.state != "DEAD" and r.pid > 0]
    return rows


def sigkill(pid: int) -> bool:
    """SIGKILL `pid` (a rank process on this machine); False when it was gone already."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def rank_handle(rank: RankProcess):
    """A handle of `rank`'s actor, by its name (ValueError for an unnamed one, or one
    gone meanwhile)."""
    import ray
    if not rank.name:
        raise ValueError(f"rank actor {rank.actor_id} has no name to reach it by")
    return ray.get_actor(rank.name, namespace=RANK_NAMESPACE)
