"""Incremental held-prefix reports: what a client asks each leader for, and what it hands
the router.

A leader answers `held_prefix_changes(since)` with the hashes evicted from its KV pool
since eviction `since` (small) or, when asked with -1 or when its log no longer reaches
back, with every hash it holds (~8 bytes per cached page: ~1 MB for 100k pages). The
client remembers each leader's count, keyed with its group's epoch (a re-formed group
starts over), and asks for a full list every `FULL_EVERY` rounds anyway: evictions alone
never drop pages the router listed for a group that the group never cached (a request
routed there and aborted before its prefill). Hand-outs: a full list stays a list (the
router reconciles with `refresh_prefixes`); evictions become `{"evicted": [...]}` (the
router drops them with `forget_prefixes`).
"""

from __future__ import annotations

from typing import Hashable, Union

FULL_EVERY = 10  # rounds (the driver asks every ~2 s: a full list every ~20 s)

Report = Union[list[int], dict[str, list[int]]]


class HeldReports:
    """Per leader key: (epoch, eviction count) of its last answer."""

    def __init__(self, full_every: int = FULL_EVERY) -> None:
        self.full_every = full_every
        self._seen: dict[Hashable, tuple[Hashable, int]] = {}
        self._round = 0

    def next_round(self) -> None:
        self._round += 1

    def since(self, key: Hashable, epoch: Hashable) -> int:
        """The `since` to ask `key`'s leader with this round (-1: a full list)."""
        seen = self._seen.get(key)
        if seen is None or seen[0] != epoch or self._round % self.full_every == 1:
            return -1
        return seen[1]

    def take(self, key: Hashable, epoch: Hashable, reply: dict) -> Report:
        """Record `reply` (a `held_prefix_changes` answer) and return the router's form."""
        self._seen[key] = (epoch, int(reply.get("seq", -1)))
        if "full" in reply:
            return list(reply["full"])
        return {"evicted": list(reply.get("evicted", ()))}
