"""Routing policies: which DP group (or prefill instance) gets a request.

The router hands a policy the candidate groups, each with a load snapshot and the number
of prompt tokens its prefix tree says that group already holds; the policy picks one.

Contract of every `RoutingPolicy`:
- `choose(candidates, prompt_tokens)` returns the `group` of one of `candidates`
  (never anything else); `candidates` is non-empty (ValueError otherwise) and in the
  router's stable group order.
- Deterministic: the choice depends only on the arguments and the policy's own state
  (e.g. a round-robin cursor), never on time, randomness or dict/set iteration order.
- Cheap: O(len(candidates)); it is called once per request on the router's hot path.
- A policy never mutates its inputs.

Policies are registered under kind "routing" (see `registry`) and built with
`make_routing_policy(name, config)`; `config` is the policy's `Config` dataclass, a
mapping of its fields (unknown keys rejected), or None for the defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Hashable, NamedTuple, Sequence

from . import registry
from .checks import is_int as _is_int, is_real as _is_real, require as _require
from .checks import resolve_config as _resolve_config

KIND = "routing"
DEFAULT_POLICY = "prefix_aware"


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """A load snapshot of one group: tokens waiting for prefill, requests running, and
    the fraction of KV pages in use (0..1)."""

    queued_tokens: int = 0
    running: int = 0
    kv_usage: float = 0.0

    def __post_init__(self) -> None:
        _require(_is_int(self.queued_tokens) and self.queued_tokens >= 0, "GroupLoad",
                 "queued_tokens", f"must be a non-negative integer, got {self.queued_tokens!r}")
        _require(_is_int(self.running) and self.running >= 0, "GroupLoad", "running",
                 f"must be a non-negative integer, got {self.running!r}")
        _require(_is_real(self.kv_usage) and 0.0 <= self.kv_usage <= 1.0, "GroupLoad",
                 "kv_usage", f"must be a number in [0, 1], got {self.kv_usage!r}")


class Candidate(NamedTuple):
    """One group a request may go to: its id, load, and prefix-tree match in tokens.
    A named tuple: the router builds one per group per decision, on its hot path."""

    group: Hashable
    load: GroupLoad
    matched_tokens: int = 0


@dataclass(frozen=True, slots=True)
class NoConfig:
    """The config of a policy that has no settings."""


def _check_common(cfg: Any) -> None:
    me = type(cfg).__name__
    _require(_is_int(cfg.running_cost_tokens) and cfg.running_cost_tokens >= 0, me,
             "running_cost_tokens",
             f"must be a non-negative integer, got {cfg.running_cost_tokens!r}")
    _require(_is_real(cfg.kv_high_watermark) and 0.0 < cfg.kv_high_watermark <= 1.0, me,
             "kv_high_watermark", f"must be a number in (0, 1], got {cfg.kv_high_watermark!r}")


@dataclass(frozen=True, slots=True)
class LeastLoadedConfig:
    """- `running_cost_tokens`: the load of a group, in tokens, is
      `queued_tokens + running_cost_tokens * running` (`load_tokens`): a running request
      costs decode steps even when it queued nothing;
    - `kv_high_watermark`: groups whose KV usage is at or above it are skipped while any
      group below it exists (a full cache preempts instead of serving)."""

    running_cost_tokens: int = 256
    kv_high_watermark: float = 0.95

    def __post_init__(self) -> None:
        _check_common(self)


@dataclass(frozen=True, slots=True)
class PrefixAwareConfig:
    """Settings of the prefix-aware policy (the decision rule is `PrefixAwarePolicy`'s).

    - `load_weight`: the *score* of a candidate is
      `load_weight * load_tokens - matched_tokens` (lowest wins): prefill tokens saved
      against load ahead. 1.0 weighs a queued token like an uncached one; below 1.0 a
      prompt moving away from its prefix is charged its extra prefill twice over, once
      for its own wait and once for the work it adds to the cluster (0.5: equally).
    - `spill_ratio`, `spill_abs_tokens`: the latency guard. The *expected cost* of a
      candidate is `load_tokens + (prompt tokens - matched_tokens)`: the tokens it
      must prefill before this request's first token. When the best-scored candidate's
      cost exceeds `spill_ratio` times the cheapest candidate's plus `spill_abs_tokens`,
      the cheapest one is chosen instead (a *cost override*).
    - `balance_abs_tokens`, `balance_ratio`: the safety valve on raw load. The load is
      *imbalanced* when the busiest candidate's `load_tokens` exceed the least busy
      one's by more than `balance_abs_tokens` AND are more than `balance_ratio` times as
      many; then the least loaded candidate is chosen whatever the prefix matches say
      (a *load override*). `balance_ratio = 1.0` makes the absolute difference the only
      test. The default (32768 tokens, about eight long uncached prompts) leaves balance
      to the score and the guard, which weigh what each group would actually prefill.
    - `saturation_tokens`, `saturation_gain`: the saturation rule. When every
      candidate's `load_tokens` is at least `saturation_tokens` (every group queued), a
      move's lost prefix delays not one request but each one queued behind it, about
      `least load / prompt tokens` prompt-sized requests; so the score charges the
      matched tokens `1 + saturation_gain * least load / prompt tokens` times instead of
      once. For large queues that is the load compared *relatively* (the load term over
      the least load, in units of the prompt), so a conversation stays on the group
      holding its prefix unless its queue is longer by more than what the cache saves.
      `saturation_gain = 0` turns the rule off; below saturation nothing changes.
    - `running_cost_tokens`, `kv_high_watermark`: as in `LeastLoadedConfig`.
    """

    balance_abs_tokens: int = 32768
    balance_ratio: float = 1.25
    load_weight: float = 0.5
    spill_ratio: float = 2.0
    spill_abs_tokens: int = 2048
    saturation_tokens: int = 4096
    saturation_gain: float = 1.0
    running_cost_tokens: int = 256
    kv_high_watermark: float = 0.95

    def __post_init__(self) -> None:
        me = type(self).__name__
        _require(_is_int(self.balance_abs_tokens) and self.balance_abs_tokens >= 0, me,
                 "balance_abs_tokens",
                 f"must be a non-negative integer, got {self.balance_abs_tokens!r}")
        _require(_is_real(self.balance_ratio) and self.balance_ratio >= 1.0, me,
                 "balance_ratio", f"must be a number >= 1.0, got {self.balance_ratio!r}")
        _require(_is_real(self.load_weight) and self.load_weight >= 0.0, me, "load_weight",
                 f"must be a finite number >= 0, got {self.load_weight!r}")
        _require(_is_real(self.spill_ratio) and self.spill_ratio >= 1.0, me, "spill_ratio",
                 f"must be a number >= 1.0, got {self.spill_ratio!r}")
        _require(_is_int(self.spill_abs_tokens) and self.spill_abs_tokens >= 0, me,
                 "spill_abs_tokens",
                 f"must be a non-negative integer, got {self.spill_abs_tokens!r}")
        _require(_is_int(self.saturation_tokens) and self.saturation_tokens >= 1, me,
                 "saturation_tokens",
                 f"must be a positive integer, got {self.saturation_tokens!r}")
        _require(_is_real(self.saturation_gain) and self.saturation_gain >= 0.0, me,
                 "saturation_gain", f"must be a finite number >= 0, got {self.saturation_gain!r}")
        _check_common(self)


def load_tokens(load: GroupLoad, running_cost_tokens: int) -> int:
    """A group's load in tokens: queued tokens plus a fixed cost per running request."""
    return load.queued_tokens + running_cost_tokens * load.running


def below_watermark(candidates: Sequence[Candidate], watermark: float) -> Sequence[Candidate]:
    """The candidates with KV usage below `watermark`, or all of them if none is."""
    ok = [c for c in candidates if c.load.kv_usage < watermark]
    return ok if ok else candidates


class RoutingPolicy(ABC):
    """Picks one group among candidates (contract in the module docstring)."""

    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any = None) -> None:
        self.config = _resolve_config(self.Config, config)

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Hashable:
        """The group of the chosen candidate; ValueError when there is none."""
        if not candidates:
            raise ValueError(f"{type(self).__name__}: no candidate groups to choose from")
        return self._choose(candidates, prompt_tokens).group

    @abstractmethod
    def _choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Candidate:
        """The chosen candidate; `candidates` is non-empty."""


@registry.register(KIND, "round_robin")
class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the candidates in order, ignoring load and prefixes."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._cursor = 0

    def _choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Candidate:
        c = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return c


@registry.register(KIND, "least_loaded")
class LeastLoadedPolicy(RoutingPolicy):
    """The least loaded candidate (`load_tokens`, then KV usage; ties: first in order),
    skipping groups over the KV watermark."""

    Config = LeastLoadedConfig

    def _choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Candidate:
        rc, hw = self.config.running_cost_tokens, self.config.kv_high_watermark
        cands = below_watermark(candidates, hw)
        keys = [(c.load.queued_tokens + rc * c.load.running, c.load.kv_usage) for c in cands]
        return cands[keys.index(min(keys))]


@registry.register(KIND, "prefix_aware")
class PrefixAwarePolicy(RoutingPolicy):
    """Longest cached prefix against load, with a latency guard and a load safety valve
    (see `PrefixAwareConfig`). In order:

    1. load override: raw loads imbalanced -> the least loaded candidate (ties: longer
       match, lower KV usage, order);
    2. otherwise the best score (`load_weight * load - matched`; at saturation the
       matched tokens weigh more, see `prefix_weight`);
    3. cost override: if that pick's expected cost is beyond `spill_ratio` times the
       cheapest candidate's plus `spill_abs_tokens`, the cheapest (ties: longer match);
    Ties in 2 and 3 go to the lower load, then lower KV usage, then rotate: a cursor
    that advances on every tie picks among the tied candidates (in order), so equally
    good idle groups take turns instead of the first in order taking all.

    Counts its decisions in `load_overrides`, `cost_overrides` and `prefix_choices`,
    and in `saturated` those taken with the saturation rule in force."""

    Config = PrefixAwareConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.load_overrides = 0  # decisions taken by raw load (imbalance)
        self.cost_overrides = 0  # decisions taken by expected cost (the latency guard)
        self.prefix_choices = 0  # decisions taken by score
        self.saturated = 0  # decisions past the load valve taken at saturation
        self._tie_cursor = 0

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """Whether the busiest and least busy of `loads` (`load_tokens` values) differ
        beyond both thresholds."""
        return self._imbalanced(max(loads), min(loads))

    def _imbalanced(self, hi: int, lo: int) -> bool:
        cfg = self.config
        return hi - lo > cfg.balance_abs_tokens and hi > cfg.balance_ratio * lo

    def prefix_weight(self, loads: Sequence[int], prompt_tokens: int) -> float:
        """How many times the score counts a matched token: 1 below saturation; with
        every load at least `saturation_tokens`, `1 + saturation_gain * min(loads) /
        prompt_tokens` (the prompt-sized requests queued on the least busy group, each
        of which a move's extra prefill would delay). Never below 1."""
        return self._weight(min(loads), prompt_tokens)

    def _weight(self, lo: int, prompt_tokens: int) -> float:
        cfg = self.config
        if cfg.saturation_gain <= 0.0 or lo < cfg.saturation_tokens:
            return 1.0
        return 1.0 + cfg.saturation_gain * lo / max(1, prompt_tokens)

    def _choose(self, candidates: Sequence[Candidate], prompt_tokens: int) -> Candidate:
        # one pass per list over a handful of candidates: this runs once per request
        cfg = self.config
        hw, rc = cfg.kv_high_watermark, cfg.running_cost_tokens
        cands = below_watermark(candidates, hw)
        loads = [c.load.queued_tokens + rc * c.load.running for c in cands]
        matched = [c.matched_tokens for c in cands]
        hi, lo = max(loads), min(loads)
        if self._imbalanced(hi, lo):
            self.load_overrides += 1
            i = min(range(len(cands)), key=lambda i: (loads[i], -matched[i],
                                                      cands[i].load.kv_usage, i))
            return cands[i]
        w, wm = cfg.load_weight, self._weight(lo, prompt_tokens)
        if wm > 1.0:
            self.saturated += 1
        scores = [w * x - wm * m for x, m in zip(loads, matched)]
        best = scores.index(min(scores))
        if scores.count(scores[best]) > 1:
            best = self._pick(cands, loads, scores)
        cost = loads[best] + max(0, prompt_tokens - matched[best])
        if cost > cfg.spill_ratio * lo + cfg.spill_abs_tokens:  # lo <= the cheapest cost
            costs = [x + max(0, prompt_tokens - m) for x, m in zip(loads, matched)]
            if cost > cfg.spill_ratio * min(costs) + cfg.spill_abs_tokens:
                self.cost_overrides += 1
                return cands[self._pick(cands, loads, costs, [-m for m in matched])]
        self.prefix_choices += 1
        return cands[best]

    def _pick(self, cands: Sequence[Candidate], loads: Sequence[int], keys: Sequence[float],
              then: Sequence[int] = ()) -> int:
        """Index of the lowest `keys` value; ties: lower `then` (when given), lower load,
        lower KV usage, then rotation."""
        top = min(keys)
        tied = [i for i, k in enumerate(keys) if k == top]
        if len(tied) == 1:
            return tied[0]
        full = {i: (then[i] if then else 0, loads[i], cands[i].load.kv_usage) for i in tied}
        top2 = min(full.values())
        tied = [i for i in tied if full[i] == top2]
        if len(tied) == 1:
            return tied[0]
        cursor = self._tie_cursor
        self._tie_cursor += 1
        return tied[cursor % len(tied)]


def make_routing_policy(name: str = DEFAULT_POLICY, config: Any = None) -> RoutingPolicy:
    """A new policy registered as `name` (ValueError listing the known names)."""
    cls = registry.get(KIND, name)
    return cls(config)  # type: ignore[operator]


def routing_policy_names() -> list[str]:
    return registry.names(KIND)


__all__ = ["Candidate", "DEFAULT_POLICY", "GroupLoad", "KIND", "LeastLoadedConfig",
           "LeastLoadedPolicy", "NoConfig", "PrefixAwareConfig", "PrefixAwarePolicy",
           "RoundRobinPolicy", "RoutingPolicy", "below_watermark", "load_tokens",
           "make_routing_policy", "routing_policy_names"]
