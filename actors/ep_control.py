"""`EPControl`: asks the EP-width policy (policies/ep_width.py) what layout the colocated
or decode groups should have, from what the DP leaders report, every `interval_s`.

Plain (no Ray): the client hands it the leaders' stats and the layout it serves; it
returns the policy's `Decision` (the client turns a changed one into a new desired layout
for the reconciler, ARCHITECTURE §5). It also measures the step time the layout actually
runs at (the leaders' step counters over wall time while they had work), so the last
decision's prediction can be checked against it (`/metrics`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional, Sequence

from ..config import EngineConfig, ModelConfig
from ..log import get_logger
from ..policies.ep_cost import CostTables, ModelNumbers, weight_bytes_per_rank
from ..policies.ep_width import (CostModelPolicy, Decision, EPInputs, EPLayout, EPWidthPolicy,
                                 OfferedLoad, RankPool, make_ep_width_policy)

log = get_logger(__name__)

__all__ = ["EPControl", "model_numbers", "upstream_demand"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_numbers(m: ModelConfig, dtype_bytes: int) -> ModelNumbers:
    """The numbers the EP-width decision needs, from a model's config."""
    h, heads, kv, d = m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim
    attention = h * heads * d * 2 + h * kv * d * 2
    moe_layers = m.num_moe_layers
    dense_mlp = (m.num_hidden_layers - moe_layers) * 3 * h * m.intermediate_size
    shared = moe_layers * 3 * h * getattr(m, "shared_expert_intermediate_size", 0)
    router = moe_layers * h * m.num_experts
    embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    dense = m.num_hidden_layers * attention + dense_mlp + shared + router + embeddings
    return ModelNumbers(num_experts=m.num_experts, experts_per_token=m.num_experts_per_tok,
                        moe_layers=moe_layers,
                        expert_bytes=3 * h * m.moe_intermediate_size * dtype_bytes,
                        dense_bytes=dense * dtype_bytes,
                        kv_bytes_per_token=2 * m.num_hidden_layers * kv * d * dtype_bytes)


def upstream_demand(requests: Iterable[tuple[int, int]], ranks: int) -> list[tuple[int, int]]:
    """Per DP rank, (requests, prompt tokens) of `requests` given as (DP group, prompt
    tokens) pairs; a DP group past the ranks wraps, as placement does."""
    out = [(0, 0)] * ranks
    for group, tokens in requests:
        n, t = out[group % ranks]
        out[group % ranks] = (n + 1, t + tokens)
    return out


class EPControl:
    """The policy, the pool it decides over and the last decision."""

    def __init__(self, config: EngineConfig, tp: int, dp: int, num_pages: int,
                 tables: Optional[CostTables] = None, policy: Optional[EPWidthPolicy] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        ep = config.parallel.ep_width
        self.config, self.tp, self.dp, self.clock = config, tp, dp, clock
        self.policy = policy if policy is not None else make_ep_width_policy(
            ep.policy, _policy_config(ep) if ep.policy == "cost_model" else None)
        self.model = model_numbers(config.model, DTYPE_BYTES.get(config.torch_dtype_name, 2))
        if tables is None and ep.costs:
            tables = CostTables.from_json(Path(ep.costs).read_text())
        self.tables = tables  # None with cost_model: measured at start (`use_tables`)
        width = tp * dp // ep.groups
        kv_per_rank = num_pages * config.cache.page_size * math.ceil(
            self.model.kv_bytes_per_token / tp)
        self.pool = RankPool(ranks=tp * dp, tp=tp, ranks_per_node=tp * dp,
                             memory_bytes=weight_bytes_per_rank(self.model, width, tp) + kv_per_rank,
                             max_seqs=config.scheduler.max_num_seqs)
        self.interval_s = ep.interval_s
        self.next_at = clock() + self.interval_s
        self.last: Optional[Decision] = None
        self.changes = 0
        self.measured_step_ms = 0.0
        self._steps: Optional[tuple[float, int]] = None  # (time, leader 0's steps)

    @property
    def needs_tables(self) -> bool:
        """cost_model without its tables yet (`actors/ep_calibration.py` measures them)."""
        return self.tables is None and isinstance(self.policy, CostModelPolicy)

    def use_tables(self, tables: CostTables) -> None:
        """The tables measured at start; the policy's first turn is an interval later."""
        self.tables = tables
        self.next_at = self.clock() + self.interval_s

    def settle(self) -> None:
        """A group serves again (re-formed after a fault, or re-shaped): its requests are
        re-prefilling from where the caller has them, and one that finished just before
        the fence runs again for its last token, so its stats are a transient, not the
        offered load. The policy's next turn is a whole interval from now (seen in CI:
        a decision 0.1 s after a narrowing read such a transient and widened again)."""
        self.next_at = max(self.next_at, self.clock() + self.interval_s)

    def due(self) -> bool:
        """The policy's turn (never while its tables are still to be measured)."""
        return not self.needs_tables and self.clock() >= self.next_at

    def decide(self, stats: Sequence[dict], current: EPLayout,
               upstream: Sequence[tuple[int, int]] = ()) -> Decision:
        """The policy's decision from the DP leaders' engine stats (global DP order).

        `upstream`, one (requests, prompt tokens) per DP rank where given: requests bound
        for that rank that its engine does not count yet (in the disaggregated layout,
        queued for or inside a prefill instance). They are queued demand like its own."""
        now = self.clock()
        self.next_at = now + self.interval_s
        self._measure(stats, now)
        if upstream and len(upstream) != len(stats):
            raise ValueError(f"upstream needs one entry per DP rank ({len(stats)}), "
                             f"got {len(upstream)}")
        extra = tuple(upstream) or ((0, 0),) * len(stats)
        running = tuple(int(s.get("num_running", 0)) for s in stats)
        tokens = sum(float(s.get("running_tokens", 0)) for s in stats)
        load = OfferedLoad(running=running,
                           queued=tuple(int(s.get("num_waiting", 0)) + e[0]
                                        for s, e in zip(stats, extra)),
                           queued_tokens=tuple(int(s.get("num_waiting_tokens", 0)) + e[1]
                                               for s, e in zip(stats, extra)),
                           context=tokens / sum(running) if sum(running) else 1.0)
        if self.needs_tables:
            raise RuntimeError("the cost_model EP-width policy has no cost tables yet")
        if self.tables is None:  # fixed / widest never read them
            self.tables = _flat_tables()
        decision = self.policy.decide(EPInputs(self.pool, self.model, load, self.tables,
                                               current, now))
        self.last = decision
        self.changes += decision.changed
        chosen = decision.estimate_of(decision.layout)
        log.info("ep_width_decision", layout=str(decision.layout), current=str(current),
                 changed=decision.changed, reason=decision.reason[:300], running=list(running),
                 queued=list(load.queued), context=round(load.context, 1),
                 predicted_step_ms=round(chosen.step_us / 1e3, 3) if chosen else None,
                 measured_step_ms=round(self.measured_step_ms, 3))
        return decision

    @property
    def predicted_step_ms(self) -> float:
        """The last decision's predicted step of the layout it chose (0: none yet)."""
        if self.last is None:
            return 0.0
        e = self.last.estimate_of(self.last.layout)
        return 0.0 if e is None else e.step_us / 1e3

    def _measure(self, stats: Sequence[dict], now: float) -> None:
        """Wall time per step of the first leader since the last call, while it had work."""
        if not stats:
            return
        steps = int(stats[0].get("steps", 0))
        busy = int(stats[0].get("num_running", 0)) > 0
        if self._steps is not None and busy and steps > self._steps[1]:
            self.measured_step_ms = (now - self._steps[0]) * 1e3 / (steps - self._steps[1])
        self._steps = (now, steps)

    def snapshot(self, current: EPLayout) -> dict:
        """What `/metrics` shows of the EP width."""
        return {"ep_width": float(current.width), "ep_groups": float(current.groups),
                "ep_predicted_step_ms": self.predicted_step_ms,
                "ep_measured_step_ms": self.measured_step_ms}


def _policy_config(ep) -> dict:
    return {"itl_target_ms": ep.itl_target_ms, "margin": ep.margin,
            "min_interval_s": ep.min_interval_s}


def _flat_tables() -> CostTables:
    """Stand-in tables for policies that do not read them (every cost zero)."""
    from ..policies.ep_cost import Grid
    zero = Grid((1.0,), (0.0,), ((0.0,),))
    return CostTables(zero, zero, zero, zero, source="unused")
