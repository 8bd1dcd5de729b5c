"""`EPControl` on plain data (no Ray): the model's numbers from its config, the offered
load from the DP leaders' stats, the policy's decision, the step it measures, and clear
errors for a policy without tables or an unknown name."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.actors.ep_control import EPControl, model_numbers, upstream_demand
from phalanx.config import EngineConfig, EPWidthConfig, ParallelConfig
from phalanx.llm import engine_config
from phalanx.models.loader import read_model_config
from phalanx.policies.ep_cost import CostTables, Grid
from phalanx.policies.ep_width import EPLayout


def test_model_numbers_of_the_tiny_model(tiny_model):
    m = read_model_config(tiny_model)
    n = model_numbers(m, 4)
    assert (n.num_experts, n.experts_per_token, n.moe_layers) == (16, 4, 3)
    assert n.expert_bytes == 3 * 128 * 64 * 4
    assert n.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    assert n.dense_bytes > 0


def _config(tiny_model, **ep) -> EngineConfig:
    return dataclasses.replace(engine_config(tiny_model, dp=4),
                               parallel=ParallelConfig(dp=4, ep_width=EPWidthConfig(**ep)))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _tables() -> CostTables:
    widths = (1.0, 2.0, 4.0)
    return CostTables(Grid(widths, (1.0, 64.0), ((0.0, 0.0), (0.0, 0.0), (2000.0, 2000.0))),
                      Grid((0.0, 16.0), (0.0, 1024.0), ((0.0, 0.0), (16000.0, 16000.0))),
                      Grid((0.0,), (0.0,), ((0.0,),)),
                      Grid(widths, (0.0,), ((10000.0,), (0.0,), (0.0,))))


def _stats(running: int, steps: int) -> list[dict]:
    return [{"num_running": running, "num_waiting": 0, "num_waiting_tokens": 0,
             "running_tokens": 40 * running, "steps": steps} for _ in range(4)]


def test_decisions_follow_the_load_and_the_step_is_measured(tiny_model):
    clock = Clock()
    ctl = EPControl(_config(tiny_model, policy="cost_model", groups=2, interval_s=1.0,
                            min_interval_s=0.0, margin=0.1), 1, 4, num_pages=256,
                    tables=_tables(), clock=clock)
    assert not ctl.due()
    clock.t = 1.0
    assert ctl.due()
    light = ctl.decide(_stats(1, 100), EPLayout(2, 2))
    assert not light.changed and light.layout == EPLayout(2, 2), light.reason
    clock.t = 2.0
    heavy = ctl.decide(_stats(4, 150), EPLayout(2, 2))
    assert heavy.changed and heavy.layout == EPLayout(4, 1), heavy.reason
    assert ctl.measured_step_ms == pytest.approx(1000.0 / 50)
    assert ctl.predicted_step_ms > 0 and ctl.changes == 1
    snap = ctl.snapshot(heavy.layout)
    assert snap["ep_width"] == 4.0 and snap["ep_groups"] == 1.0


def test_a_group_serving_again_puts_the_next_turn_an_interval_away(tiny_model):
    """After a re-formation the stats are a transient (requests re-prefilling, finished
    ones run again for their last token): the policy waits a whole interval."""
    clock = Clock()
    ctl = EPControl(_config(tiny_model, policy="cost_model", groups=2, interval_s=1.0,
                            min_interval_s=0.0), 1, 4, num_pages=256, tables=_tables(),
                    clock=clock)
    clock.t = 1.0
    ctl.decide(_stats(4, 100), EPLayout(2, 2))  # the next turn is due at 2.0
    clock.t = 1.9
    ctl.settle()
    clock.t = 2.5
    assert not ctl.due()
    clock.t = 2.9
    assert ctl.due()
    ctl.settle()  # the next group serving again pushes it once more
    assert not ctl.due()
    clock.t = 3.9
    assert ctl.due()


def test_requests_still_upstream_count_as_queued_demand(tiny_model):
    """The disaggregated layout's decode leaders do not count requests still queued for or
    inside a prefill: handed over as `upstream`, a busy prefill side widens like a busy
    decode side (without them the policy saw an idle decode side and narrowed)."""
    clock = Clock()
    make = lambda: EPControl(_config(tiny_model, policy="cost_model", groups=2,  # noqa: E731
                                     interval_s=1.0, min_interval_s=0.0, margin=0.1),
                             1, 4, num_pages=256, tables=_tables(), clock=clock)
    clock.t = 1.0
    alone = make().decide(_stats(1, 100), EPLayout(2, 2))
    assert not alone.changed, alone.reason
    bound = make().decide(_stats(1, 100), EPLayout(2, 2), upstream=[(3, 120)] * 4)
    assert bound.changed and bound.layout == EPLayout(4, 1), bound.reason
    with pytest.raises(ValueError, match="one entry per DP rank"):
        make().decide(_stats(1, 100), EPLayout(2, 2), upstream=[(3, 120)] * 3)
    assert upstream_demand([(0, 10), (2, 5), (4, 7), (1, 1)], 4) == [(2, 17), (1, 1), (1, 5),
                                                                       (0, 0)]


def test_cost_model_waits_for_its_tables_and_unknown_policies_are_refused(tiny_model):
    now = [0.0]
    waiting = EPControl(_config(tiny_model, policy="cost_model"), 1, 4, num_pages=256,
                        clock=lambda: now[0])
    now[0] = 100.0
    assert waiting.needs_tables and not waiting.due(), "no turn before calibration"
    with pytest.raises(RuntimeError, match="cost tables"):
        waiting.decide(_stats(4, 1), EPLayout(4, 1))
    waiting.use_tables(_tables())
    assert not waiting.needs_tables and not waiting.due(), "the first turn an interval later"
    now[0] += waiting.interval_s
    assert waiting.due()
    with pytest.raises(ValueError, match="known"):
        engine_config(tiny_model, dp=4, ep_policy="nope")
    with pytest.raises(ValueError, match="evenly"):
        engine_config(tiny_model, dp=4, ep_groups=3)
    fixed = EPControl(_config(tiny_model), 1, 4, num_pages=256)
    assert not fixed.decide(_stats(4, 1), EPLayout(4, 1)).changed
