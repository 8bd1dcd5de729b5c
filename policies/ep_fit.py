"""`fit_cost_tables`: the EP-width cost tables (`ep_cost.CostTables`) from decode steps
measured on real ranks at each candidate width, and the expert grid measured with the
ranks' kernel. Plain data in and out (no Ray, no torch): `actors/ep_calibration.py`
measures at start, `bench/ep_width.py` in a benchmark; both fit here.

The step at width w and batch b (sequences per DP rank) is split as
`attention(b) + experts(active(w, b), b·k) + exchange(w, b)`: the narrowest width has no
EP exchange, so its step minus its expert time is attention and the rest of a one-group
step; each wider width's exchange (with the rest of a group's lockstep) is its step minus
that and its own expert time. Step overhead is folded into attention (zero table).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .ep_cost import CostTables, Grid, ModelNumbers, active_experts

__all__ = ["fit_cost_tables"]


def fit_cost_tables(steps_ms: Mapping[tuple[int, int], float], experts: Grid,
                    model: ModelNumbers, batches: Sequence[int], context: float,
                    widths: Sequence[int], source: str) -> CostTables:
    """`steps_ms[(width, batch)]`: a measured step (ms) for every width and every batch
    of `batches`; `context`: the mean context they ran at."""
    if not widths or not batches:
        raise ValueError("fit_cost_tables needs at least one width and one batch")
    missing = [(w, b) for w in widths for b in batches if (w, b) not in steps_ms]
    if missing:
        raise ValueError(f"fit_cost_tables: no measured step for (width, batch) {missing}")
    batches, widths = sorted(set(batches)), sorted(set(widths))
    k, narrow = model.experts_per_token, widths[0]

    def expert_us(w: int, b: int) -> float:
        return experts.at(active_experts(model, w, b), b * k)

    attention = Grid(tuple(float(b) for b in batches), (float(context),), tuple(
        (max(0.0, steps_ms[(narrow, b)] * 1e3 - expert_us(narrow, b)),) for b in batches))
    exchange = Grid(tuple(float(w) for w in widths), tuple(float(b) for b in batches), tuple(
        tuple(0.0 if w == narrow else max(0.0, steps_ms[(w, b)] * 1e3 - attention.at(b, context)
                                          - expert_us(w, b)) for b in batches)
        for w in widths))
    zero = Grid((1.0,), (0.0,), ((0.0,),))
    return CostTables(exchange, experts, attention, zero, source=source)
