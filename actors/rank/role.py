"""`RankRole`: what a rank does beyond stepping its engine in lockstep with its group.

A role is a plug-in of a :class:`~phalanx.actors.rank.rank.Rank`. The colocated rank's
role is this class itself (every hook a no-op); the disaggregated roles are
`prefill_role.PrefillRole` (plan the KV sends of each step, send after each layer) and
`decode_role.DecodeRole` (reserve pages, open gates, admit requests whose KV landed).

Contract:
- `start(rank)` runs in the caller's thread once the rank's engine exists (its loop may
  already step, but no request can reach it before `start` returns); it returns what the
  role adds to the rank's start reply.
- `handle`, `layer_hook`, `after_forward` and `service` run on the loop thread only.
- A role keeps its caller-facing state under `rank.mailbox.lock` and reports to callers
  through `rank.mailbox.publish_events`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["RankRole"]


class RankRole:
    """The colocated role, and the hooks every role may fill."""

    name = "colocated"

    def start(self, rank) -> dict:
        """Set up after the engine exists; extra fields of the start reply."""
        return {}

    def handle(self, kind: str, item: Any) -> bool:
        """Apply a role's own inbox item; False when `kind` is not the role's."""
        return False

    def layer_hook(self, inputs) -> Optional[Callable[[int], None]]:
        """A `layer_done(i)` callback for this step's forward, or None (every rank)."""
        return None

    def after_forward(self, inputs) -> None:
        """After a real forward, before sampling (every rank)."""

    def service(self) -> None:
        """Once per loop iteration, work or not (e.g. reap finished transfers)."""
