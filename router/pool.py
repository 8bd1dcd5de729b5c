"""A pool of placement targets of one kind (DP groups, or prefill instances): their
prefix tree, their load, and the routing policy that picks among them.

Contract:
- `route` considers exactly the targets in the pool at the moment of the call: a target
  removed with `remove` never receives another request, from the next call on.
- With no target (or all excluded) `route` raises `NoTargetError` at once; nothing waits.
- Load seen by the policy, per target: `queued_tokens = max(reported, own)` and
  `running = max(reported, own)`, where `reported` is the last `update_load` snapshot
  and `own` is the pool's accounting of requests it routed there and not yet released
  (own tokens = the prompt tokens that target did not hold, by the tree, when routed,
  until `settle` says the prefill is done);
  `kv_usage` is the reported one. The max never counts a request twice, and keeps the
  load current between two reports.
- A request id is tracked at most once per pool (`route` of a tracked id: ValueError);
  `release` is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Hashable, Optional, Sequence

from ..policies import Candidate, GroupLoad, RoutingPolicy, make_routing_policy

from .prefix_tree import PrefixTree

_ZERO = GroupLoad()
_set_queued, _set_running = GroupLoad.queued_tokens.__set__, GroupLoad.running.__set__
_set_kv = GroupLoad.kv_usage.__set__
_candidate = tuple.__new__  # a Candidate of valid fields, without the call through __new__


def _merged_load(queued_tokens: int, running: int, kv_usage: float) -> GroupLoad:
    """A `GroupLoad` of fields taken from valid ones (maxima of two valid counts and a
    reported KV usage), built without `__post_init__`'s checks (about 1 µs a decision)."""
    load = object.__new__(GroupLoad)
    _set_queued(load, queued_tokens)
    _set_running(load, running)
    _set_kv(load, kv_usage)
    return load


class NoTargetError(RuntimeError):
    """No target in the pool to route to."""


@dataclass(slots=True)
class PoolStats:
    """Counters since the pool was built: decisions, prompt tokens routed, and the
    tokens of those prompts the chosen target held according to the tree (the router's
    own hit estimate; the ranks' prefix caches are the ground truth)."""

    decisions: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0
    per_target: dict[Hashable, int] = field(default_factory=dict)

    @property
    def estimated_hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _Own:
    tokens: int = 0
    requests: int = 0


class PlacementPool:
    """Targets of one kind, in the order they were added (see the module docstring)."""

    def __init__(self, *, page_size: int, capacity_pages: int, policy: str = "prefix_aware",
                 policy_config: Any = None, kind: str = "target") -> None:
        self.kind = kind
        self.tree = PrefixTree(page_size, capacity_pages)
        self.policy: RoutingPolicy = make_routing_policy(policy, policy_config)
        self.policy_name = policy
        self.stats = PoolStats()
        self._reported: dict[Hashable, GroupLoad] = {}
        self._own: dict[Hashable, _Own] = {}
        self._effective: dict[Hashable, GroupLoad] = {}
        self._inflight: dict[str, tuple[Hashable, int]] = {}  # request id -> (target, tokens)

    # ---- membership -----------------------------------------------------------------

    @property
    def targets(self) -> list[Hashable]:
        return list(self._reported)

    def __contains__(self, target: object) -> bool:
        return target in self._reported

    def __len__(self) -> int:
        return len(self._reported)

    def add(self, target: Hashable, *, capacity_pages: Optional[int] = None,
            load: Optional[GroupLoad] = None) -> None:
        """Adds a target (ValueError if present); `capacity_pages` bounds its tree."""
        if target is None:
            raise ValueError(f"a {self.kind} id cannot be None")
        if target in self._reported:
            raise ValueError(f"{self.kind} {target!r} is already in the pool")
        if capacity_pages is not None:
            self.tree.set_capacity(target, capacity_pages)
        self._reported[target] = load if load is not None else _ZERO
        self._own[target] = _Own()
        self._refresh_effective(target)

    def remove(self, target: Hashable) -> list[str]:
        """Removes a target at once: no request goes there from now on, its prefixes and
        accounting are dropped. Returns the ids of the requests routed there and not yet
        released (the caller recovers them); KeyError if the target is unknown."""
        if target not in self._reported:
            raise KeyError(f"unknown {self.kind} {target!r}; known: {self.targets}")
        del self._reported[target], self._own[target], self._effective[target]
        self.tree.remove_group(target)
        stranded = [rid for rid, (t, _) in self._inflight.items() if t == target]
        for rid in stranded:
            del self._inflight[rid]
        return stranded

    # ---- load -----------------------------------------------------------------------

    def update_load(self, target: Hashable, load: GroupLoad) -> None:
        """Stores the latest snapshot a target reported (KeyError if unknown)."""
        if not isinstance(load, GroupLoad):
            raise TypeError(f"expected a GroupLoad, got {type(load).__name__}")
        if target not in self._reported:
            raise KeyError(f"unknown {self.kind} {target!r}; known: {self.targets}")
        self._reported[target] = load
        self._refresh_effective(target)

    def load(self, target: Hashable) -> GroupLoad:
        """The load the policy sees for `target` (KeyError if unknown)."""
        try:
            return self._effective[target]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {target!r}; known: {self.targets}") from None

    def loads(self) -> dict[Hashable, GroupLoad]:
        return dict(self._effective)

    @property
    def num_inflight(self) -> int:
        """How many requests the pool tracks."""
        return len(self._inflight)

    def inflight(self, target: Optional[Hashable] = None) -> list[str]:
        """Tracked request ids (on `target` only, when given), in routing order."""
        return [rid for rid, (t, _) in self._inflight.items() if target is None or t == target]

    def routed(self, target: Hashable) -> tuple[int, int]:
        """(requests, uncached prompt tokens not yet prefilled) this pool routed to
        `target` and has not released: its own view, current without any report."""
        own = self._own[target]
        return own.requests, own.tokens

    def _refresh_effective(self, target: Hashable) -> None:
        rep, own = self._reported[target], self._own[target]
        if own.tokens <= rep.queued_tokens and own.requests <= rep.running:
            self._effective[target] = rep
        else:
            self._effective[target] = _merged_load(max(rep.queued_tokens, own.tokens),
                                                   max(rep.running, own.requests), rep.kv_usage)

    # ---- routing --------------------------------------------------------------------

    def route(self, request_id: str, tokens: Sequence[int], *,
              exclude: Collection[Hashable] = (), hashes: Optional[Sequence[int]] = None
              ) -> Hashable:
        """Picks a target for `tokens` through the policy, lists the prompt's pages for it
        in the tree, and tracks the request's load there until `release`. `hashes`: the
        chain hashes of `tokens`' full pages at this pool's page size, if already known."""
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} is already routed to {self.kind} "
                             f"{self._inflight[request_id][0]!r}; finish (release) it first")
        targets = [t for t in self._reported if t not in exclude] if exclude else self._reported
        if not targets:
            raise NoTargetError(f"no {self.kind} to route request {request_id!r} to "
                                f"(pool: {self.targets}, excluded: {sorted(map(repr, exclude))})")
        tree = self.tree
        if hashes is None:
            hashes = tree.hashes(tokens)
        pages = tree.match_pages(hashes)
        ps = tree.page_size
        eff, held_pages = self._effective, pages.get
        cands = [_candidate(Candidate, (t, eff[t], held_pages(t, 0) * ps)) for t in targets]
        n_tokens = len(tokens)
        target = self.policy.choose(cands, n_tokens)
        if target not in targets:
            raise RuntimeError(f"policy {self.policy_name!r} chose {target!r}, "
                               f"not a candidate {self.kind}")
        held = pages.get(target, 0)
        matched = min(held * ps, n_tokens)
        cost = n_tokens - matched
        tree.insert_hashes(target, hashes)
        self._inflight[request_id] = (target, cost)
        own = self._own[target]
        own.tokens += cost
        own.requests += 1
        self._refresh_effective(target)
        st = self.stats
        st.decisions += 1
        st.prompt_tokens += n_tokens
        st.matched_tokens += matched
        st.per_target[target] = st.per_target.get(target, 0) + 1
        return target

    def release(self, request_id: str, tokens: Optional[Sequence[int]] = None, *,
                hashes: Optional[Sequence[int]] = None) -> bool:
        """Drops a request's load; with `tokens` (e.g. prompt + output), or the chain
        `hashes` of their full pages, lists those pages for the target it ran on. False
        if the id was not tracked."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return False
        target, cost = entry
        own = self._own[target]
        own.tokens -= cost
        own.requests -= 1
        self._refresh_effective(target)
        if hashes is not None:
            self.tree.insert_hashes(target, hashes)
        elif tokens is not None:
            self.tree.insert(target, tokens)
        return True

    def settle(self, request_id: str) -> bool:
        """The request's prompt is in (prefill done): its queued tokens leave the target's
        load, its running request stays until `release`. False if not tracked."""
        entry = self._inflight.get(request_id)
        if entry is None:
            return False
        target, cost = entry
        if cost:
            self._inflight[request_id] = (target, 0)
            self._own[target].tokens -= cost
            self._refresh_effective(target)
        return True

    def target_of(self, request_id: str) -> Optional[Hashable]:
        entry = self._inflight.get(request_id)
        return entry[0] if entry else None

    # ---- prefixes -------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> dict[Hashable, int]:
        """Tokens of `tokens` each target holds by the tree (read-only)."""
        return self.tree.match(tokens)

    def refresh_prefixes(self, target: Hashable, held: Collection[int],
                         as_of: Optional[int] = None) -> int:
        """Reconciles the tree with the page hashes `target` reports (see
        `PrefixTree.refresh`; `as_of` = `self.tree.clock` when the report was asked for)."""
        if target not in self._reported:
            raise KeyError(f"unknown {self.kind} {target!r}; known: {self.targets}")
        return self.tree.refresh(target, held, as_of)

    def forget_prefixes(self, target: Hashable, evicted: Collection[int],
                        as_of: Optional[int] = None) -> int:
        """Drops the pages `target` reports it evicted (`PrefixTree.forget`)."""
        if target not in self._reported:
            raise KeyError(f"unknown {self.kind} {target!r}; known: {self.targets}")
        return self.tree.forget(target, evicted, as_of)


__all__ = ["NoTargetError", "PlacementPool", "PoolStats"]
