"""EP-width policies: how many ranks each DP×EP group of the decode (or colocated) layout
spans, chosen at run time (ARCHITECTURE §3).

A layout is `groups` groups of `width` ranks each (`width` a multiple of TP, the ranks
split evenly); each group has `width / tp` DP ranks, so the router's DP ranks are the
same in every layout and only their grouping changes. A policy gets plain data (the rank
pool, the model's numbers, the offered load, the measured cost tables, the current
layout, the time) and returns a `Decision`: the layout to serve with and why, in words,
with the estimate of every candidate.

Contract of every `EPWidthPolicy`:
- `decide(inputs)` returns a layout from `candidate_layouts(inputs.pool)`, never one
  whose weights or running requests do not fit a rank's memory while one that fits exists;
- deterministic: the result depends on the inputs and the policy's own state only (the
  time of its last change), never on a clock of its own;
- a changed layout is a re-sharding (every group re-forms): `cost_model` changes only
  when the gain is worth it (hysteresis) and not within `min_interval_s` of its last
  change, so it never flaps.

Policies (registry kind "ep_width"): `fixed` (the layout given at start, the default),
`widest` (one group of every rank), `cost_model` (the layout that maximises output tokens/s
per rank with the predicted step under `itl_target_ms`; `ep_cost.CostTables`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

from . import registry
from .checks import Configured, NoSettings, is_int, is_real, require
from .ep_cost import CostTables, ModelNumbers, kv_tokens_per_rank, weight_bytes_per_rank

__all__ = ["CostModelConfig", "CostModelPolicy", "DEFAULT_POLICY", "Decision", "EPInputs",
           "EPLayout", "EPWidthPolicy", "Estimate", "FixedPolicy", "KIND", "OfferedLoad",
           "RankPool", "WidestPolicy", "candidate_layouts", "ep_width_policy_names",
           "estimate", "make_ep_width_policy"]

KIND = "ep_width"
DEFAULT_POLICY = "fixed"


@dataclass(frozen=True, slots=True)
class RankPool:
    """The ranks a layout may use: how many, their TP degree, ranks per node, bytes of
    memory per rank for weights and KV, and the most sequences a DP rank batches."""

    ranks: int
    tp: int = 1
    ranks_per_node: int = 8
    memory_bytes: int = 1 << 40
    max_seqs: int = 256

    def __post_init__(self) -> None:
        for name in ("ranks", "tp", "ranks_per_node", "memory_bytes", "max_seqs"):
            v = getattr(self, name)
            require(is_int(v) and v >= 1, "RankPool", name, f"must be an integer >= 1, got {v!r}")
        require(self.ranks % self.tp == 0, "RankPool", "ranks",
                f"{self.ranks} is not a multiple of tp {self.tp}")


@dataclass(frozen=True, slots=True)
class EPLayout:
    """`groups` DP×EP groups of `width` ranks each."""

    width: int
    groups: int

    def __post_init__(self) -> None:
        require(is_int(self.width) and self.width >= 1, "EPLayout", "width",
                f"must be an integer >= 1, got {self.width!r}")
        require(is_int(self.groups) and self.groups >= 1, "EPLayout", "groups",
                f"must be an integer >= 1, got {self.groups!r}")

    def __str__(self) -> str:
        return f"{self.groups}x{self.width}"


@dataclass(frozen=True, slots=True)
class OfferedLoad:
    """Per DP rank (the router's order): sequences running, requests and prompt tokens
    queued; the mean context of the running sequences; tokens/s in and out."""

    running: tuple[int, ...]
    queued: tuple[int, ...]
    queued_tokens: tuple[int, ...]
    context: float = 1.0
    tokens_in_per_s: float = 0.0
    tokens_out_per_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.running)
        require(n >= 1 and len(self.queued) == n and len(self.queued_tokens) == n,
                "OfferedLoad", "running", "running, queued and queued_tokens need one "
                "entry per DP rank each")
        require(all(is_int(v) and v >= 0 for t in (self.running, self.queued,
                                                   self.queued_tokens) for v in t),
                "OfferedLoad", "running", "counts must be integers >= 0")
        for name in ("context", "tokens_in_per_s", "tokens_out_per_s"):
            v = getattr(self, name)
            require(is_real(v) and v >= 0, "OfferedLoad", name, f"must be a number >= 0, got {v!r}")

    def demand(self) -> tuple[int, ...]:
        """Sequences each DP rank has to serve (running + queued)."""
        return tuple(r + q for r, q in zip(self.running, self.queued))


@dataclass(frozen=True, slots=True)
class EPInputs:
    pool: RankPool
    model: ModelNumbers
    load: OfferedLoad
    tables: CostTables
    current: EPLayout
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class Estimate:
    """A candidate layout at the offered load: whether it fits, the batch per DP rank it
    would run, its predicted step (µs, the largest batch of a group) and output tokens/s
    per rank; `why` when it does not fit."""

    layout: EPLayout
    fits: bool
    batch: float = 0.0
    step_us: float = 0.0
    tokens_per_s_per_rank: float = 0.0
    why: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    layout: EPLayout
    reason: str
    changed: bool
    estimates: tuple[Estimate, ...] = field(default=())

    def estimate_of(self, layout: EPLayout) -> Optional[Estimate]:
        return next((e for e in self.estimates if e.layout == layout), None)


def candidate_layouts(pool: RankPool) -> list[EPLayout]:
    """Every even split of the pool into groups whose width is a multiple of TP,
    narrowest first."""
    return [EPLayout(w, pool.ranks // w) for w in range(pool.tp, pool.ranks + 1, pool.tp)
            if pool.ranks % w == 0]


def _imbalance(demand: tuple[int, ...], group_dp: int) -> float:
    """How much larger a group's largest batch is than its mean, from the current spread
    of demand over DP ranks cut into groups of `group_dp` (1.0: even)."""
    if group_dp <= 1 or sum(demand) == 0:
        return 1.0
    ratios = []
    for g in range(0, len(demand), group_dp):
        part = demand[g:g + group_dp]
        mean = sum(part) / len(part)
        if mean > 0:
            ratios.append(max(part) / mean)
    return sum(ratios) / len(ratios) if ratios else 1.0


def estimate(inputs: EPInputs, layout: EPLayout) -> Estimate:
    """`layout` at the offered load (see the module doc of `ep_cost` for the step)."""
    pool, model, load = inputs.pool, inputs.model, inputs.load
    weights = weight_bytes_per_rank(model, layout.width, pool.tp)
    if weights > pool.memory_bytes:
        return Estimate(layout, False, why=f"weights {weights} B > {pool.memory_bytes} B per rank")
    ctx = max(load.context, 1.0)
    room = kv_tokens_per_rank(model, pool.memory_bytes, layout.width, pool.tp)
    cap = min(pool.max_seqs, room / ctx)
    dp_ranks = pool.ranks // pool.tp
    running = sum(load.running) / dp_ranks
    if running > cap:
        return Estimate(layout, False, why=f"running KV {running * ctx:.0f} tokens per DP rank "
                                           f"> room for {room}")
    demand = load.demand()
    mean = sum(demand) / dp_ranks
    batch = min(mean, cap)
    if batch <= 0:
        return Estimate(layout, True, 0.0, inputs.tables.step_us(model, layout.width, 0, ctx), 0.0)
    largest = min(batch * _imbalance(demand, layout.width // pool.tp), cap)
    step = inputs.tables.step_us(model, layout.width, largest, ctx)
    per_rank = batch * dp_ranks / (step * 1e-6) / pool.ranks
    return Estimate(layout, True, batch, step, per_rank)


class EPWidthPolicy(Configured, ABC):
    """See the module docstring for the contract (settings: `Configured`)."""

    @abstractmethod
    def decide(self, inputs: EPInputs) -> Decision:
        ...


def _keep(inputs: EPInputs, reason: str, estimates: tuple = ()) -> Decision:
    return Decision(inputs.current, reason, False, estimates)


@registry.register(KIND, "fixed")
class FixedPolicy(EPWidthPolicy):
    """The layout given at start, always."""

    Config = NoSettings

    def decide(self, inputs: EPInputs) -> Decision:
        return _keep(inputs, f"fixed at {inputs.current}")


@registry.register(KIND, "widest")
class WidestPolicy(EPWidthPolicy):
    """Every rank in one group (the least weight bytes per rank, the most KV room)."""

    Config = NoSettings

    def decide(self, inputs: EPInputs) -> Decision:
        widest = EPLayout(inputs.pool.ranks, 1)
        if widest == inputs.current:
            return _keep(inputs, f"already one group of {widest.width}")
        return Decision(widest, f"one group of all {widest.width} ranks", True)


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    """- `itl_target_ms`: the predicted step (inter-token latency) a layout must stay
      under; when none does, the fastest step wins;
    - `margin`: change only for a predicted gain in tokens/s per rank above this
      fraction (hysteresis), unless the current layout stopped fitting or meeting the
      target;
    - `min_interval_s`: no change within this long of the last one."""

    itl_target_ms: float = 50.0
    margin: float = 0.15
    min_interval_s: float = 30.0

    def __post_init__(self) -> None:
        me = "CostModelConfig"
        require(is_real(self.itl_target_ms) and self.itl_target_ms > 0, me, "itl_target_ms",
                f"must be a number > 0, got {self.itl_target_ms!r}")
        require(is_real(self.margin) and self.margin >= 0, me, "margin",
                f"must be a number >= 0, got {self.margin!r}")
        require(is_real(self.min_interval_s) and self.min_interval_s >= 0, me,
                "min_interval_s", f"must be a number >= 0, got {self.min_interval_s!r}")


@registry.register(KIND, "cost_model")
class CostModelPolicy(EPWidthPolicy):
    """The layout with the most output tokens/s per rank whose predicted step meets the
    ITL target, by the measured cost tables; see `CostModelConfig`."""

    Config = CostModelConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.last_change: Optional[float] = None

    def decide(self, inputs: EPInputs) -> Decision:
        cfg = self.config
        target_us = cfg.itl_target_ms * 1e3
        estimates = tuple(estimate(inputs, lay) for lay in candidate_layouts(inputs.pool))
        fitting = [e for e in estimates if e.fits]
        if not fitting:
            return _keep(inputs, "no layout fits: " + "; ".join(
                f"{e.layout}: {e.why}" for e in estimates), estimates)
        meeting = [e for e in fitting if e.step_us <= target_us]
        if meeting:  # most tokens/s per rank; ties to the narrowest (fewest re-shardings)
            best = max(meeting, key=lambda e: (round(e.tokens_per_s_per_rank, 6), -e.layout.width))
        else:
            best = min(fitting, key=lambda e: (e.step_us, e.layout.width))
        cur = next((e for e in estimates if e.layout == inputs.current), None)
        why = (f"{best.layout}: {best.tokens_per_s_per_rank:.0f} tok/s per rank, step "
               f"{best.step_us / 1e3:.2f} ms at batch {best.batch:.1f} per DP rank")
        if best.layout == inputs.current:
            return _keep(inputs, f"current is best: {why}", estimates)
        if self.last_change is not None and inputs.now - self.last_change < cfg.min_interval_s:
            return _keep(inputs, f"within {cfg.min_interval_s} s of the last change ({why})",
                         estimates)
        cur_ok = cur is not None and cur.fits and cur.step_us <= target_us
        if cur_ok and best.tokens_per_s_per_rank <= cur.tokens_per_s_per_rank * (1 + cfg.margin):
            return _keep(inputs, f"gain below {cfg.margin:.0%}: {why} against "
                                 f"{cur.tokens_per_s_per_rank:.0f} tok/s per rank", estimates)
        self.last_change = inputs.now
        before = "does not fit" if cur is None or not cur.fits else (
            f"{cur.tokens_per_s_per_rank:.0f} tok/s per rank, step {cur.step_us / 1e3:.2f} ms")
        return Decision(best.layout, f"{why}; {inputs.current} {before}", True, estimates)


def make_ep_width_policy(name: str = DEFAULT_POLICY, config: Any = None) -> EPWidthPolicy:
    """A new policy registered as `name` (ValueError listing the known names)."""
    return registry.get(KIND, name)(config)  # type: ignore[operator]


def ep_width_policy_names() -> list[str]:
    return registry.names(KIND)
