"""EP-width policies and their cost model on plain data (no Ray, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.policies import registry
from phalanx.policies.ep_cost import (CostTables, Grid, ModelNumbers, active_experts,
                                      weight_bytes_per_rank)
from phalanx.policies.ep_width import (EPInputs, EPLayout, OfferedLoad, RankPool,
                                       candidate_layouts, estimate, make_ep_width_policy)

MIB = 1 << 20


def seed_shaped_tables(exchange_per_rank_us: float = 15.0) -> CostTables:
    """Tables shaped as seed 001 describes a decode step (not a measurement: a test
    input): expert time grows with the distinct experts a rank reads, the exchange with
    the width and the tokens, attention with tokens × context."""
    widths = (1.0, 2.0, 4.0, 8.0, 16.0)
    tokens = (1.0, 16.0, 64.0, 256.0)
    exchange = Grid(widths, tokens, tuple(tuple(0.0 if w == 1 else 40 + exchange_per_rank_us * w
                                                + 0.5 * t for t in tokens) for w in widths))
    actives = (0.0, 4.0, 16.0, 64.0)
    rows = (0.0, 64.0, 1024.0, 8192.0)
    experts = Grid(actives, rows, tuple(tuple(30.0 * a + 0.05 * r for r in rows) for a in actives))
    attention = Grid(tokens, (128.0, 4096.0), tuple((20 + 0.01 * t * 128, 20 + 0.01 * t * 4096)
                                                    for t in tokens))
    overhead = Grid(widths, (0.0,), tuple((100.0 + 5 * w,) for w in widths))
    return CostTables(exchange, experts, attention, overhead, source="test input")


MODEL = ModelNumbers(num_experts=64, experts_per_token=8, moe_layers=24,
                     expert_bytes=2 * MIB, dense_bytes=512 * MIB, kv_bytes_per_token=48 << 10)


def load_of(per_rank: int, dp: int, context: float = 1024.0) -> OfferedLoad:
    return OfferedLoad((per_rank,) * dp, (0,) * dp, (0,) * dp, context)


def inputs(pool: RankPool, load: OfferedLoad, current: EPLayout, now: float = 0.0,
           model: ModelNumbers = MODEL) -> EPInputs:
    return EPInputs(pool, model, load, seed_shaped_tables(), current, now)


def test_grid_reads_its_points_and_lines_between_and_beyond():
    g = Grid((1.0, 3.0), (0.0, 10.0), ((1.0, 2.0), (3.0, 6.0)))
    assert g.at(1, 0) == 1.0 and g.at(3, 10) == 6.0
    assert g.at(2, 5) == pytest.approx(3.0)
    assert g.at(5, 0) == pytest.approx(5.0), "beyond the grid: the last two points' line"
    assert g.at(0, 0) == 1.0, "below the grid: the first value"
    with pytest.raises(ValueError, match="strictly increasing"):
        Grid((2.0, 1.0), (0.0,), ((1.0,), (2.0,)))
    with pytest.raises(ValueError, match=">= 0"):
        Grid((1.0,), (0.0,), ((-1.0,),))


def test_cost_tables_round_trip_through_json():
    t = seed_shaped_tables()
    back = CostTables.from_json(t.to_json())
    assert back == t
    with pytest.raises(ValueError, match="lack"):
        CostTables.from_json('{"exchange": {}}')


def test_active_experts_fall_with_width_and_saturate():
    assert active_experts(MODEL, 1, 1) == pytest.approx(8.0)
    assert active_experts(MODEL, 8, 10_000) == pytest.approx(64 / 8)
    assert active_experts(MODEL, 8, 64) < active_experts(MODEL, 1, 64)
    assert weight_bytes_per_rank(MODEL, 8, 1) < weight_bytes_per_rank(MODEL, 1, 1)


def test_candidates_are_even_splits_in_multiples_of_tp():
    assert [str(c) for c in candidate_layouts(RankPool(8, tp=2))] == ["4x2", "2x4", "1x8"]
    assert [str(c) for c in candidate_layouts(RankPool(6))] == ["6x1", "3x2", "2x3", "1x6"]


def test_registry_names_and_bad_names_and_configs():
    assert {"fixed", "widest", "cost_model"} <= set(registry.names("ep_width"))
    with pytest.raises(ValueError, match="known"):
        make_ep_width_policy("nope")
    with pytest.raises(ValueError, match="unknown keys"):
        make_ep_width_policy("cost_model", {"margn": 0.1})
    with pytest.raises(ValueError, match="itl_target_ms"):
        make_ep_width_policy("cost_model", {"itl_target_ms": 0})


def test_fixed_keeps_and_widest_takes_everything():
    pool = RankPool(4)
    cur = EPLayout(2, 2)
    assert make_ep_width_policy("fixed").decide(inputs(pool, load_of(50, 4), cur)).layout == cur
    d = make_ep_width_policy("widest").decide(inputs(pool, load_of(1, 4), cur))
    assert d.layout == EPLayout(4, 1) and d.changed


def test_cost_model_widens_under_load_and_narrows_when_it_falls():
    pool = RankPool(4, memory_bytes=4096 * MIB)
    policy = make_ep_width_policy("cost_model", {"min_interval_s": 10})
    light = policy.decide(inputs(pool, load_of(1, 4), EPLayout(4, 1), now=0))
    assert light.layout == EPLayout(1, 4) and light.changed, light.reason
    heavy = policy.decide(inputs(pool, load_of(64, 4, 256.0), light.layout, now=5))
    assert heavy.layout == light.layout and "within" in heavy.reason, "min interval holds"
    heavy = policy.decide(inputs(pool, load_of(64, 4, 256.0), light.layout, now=20))
    assert heavy.layout.width > 1 and heavy.changed, heavy.reason
    assert heavy.estimate_of(heavy.layout).fits
    calm = policy.decide(inputs(pool, load_of(1, 4), heavy.layout, now=40))
    assert calm.layout == EPLayout(1, 4) and calm.changed, calm.reason


@pytest.mark.parametrize("current", [EPLayout(1, 4), EPLayout(2, 2), EPLayout(4, 1)])
def test_cost_model_keeps_any_layout_while_idle(current):
    """No load predicts no tokens/s anywhere: nothing to gain, so no re-sharding."""
    policy = make_ep_width_policy("cost_model", {"min_interval_s": 0, "margin": 0.0})
    idle = policy.decide(inputs(RankPool(4, memory_bytes=4096 * MIB), load_of(0, 4), current))
    assert idle.layout == current and not idle.changed, idle.reason


memories = st.integers(min_value=300, max_value=8192).map(lambda m: m * MIB)


@settings(max_examples=200, deadline=None)
@given(ranks=st.sampled_from([1, 2, 4, 8]), memory=memories,
       running=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       context=st.floats(1, 8192), experts=st.sampled_from([0, 8, 64, 256]))
def test_never_a_layout_that_does_not_fit_while_one_fits(ranks, memory, running, context, experts):
    model = ModelNumbers(experts, min(8, experts), 24, 2 * MIB, 256 * MIB, 16 << 10)
    pool = RankPool(ranks, memory_bytes=memory)
    dp = ranks
    run = tuple((running * dp)[:dp])
    load = OfferedLoad(run, (0,) * dp, (0,) * dp, context)
    for name in ("cost_model", "widest", "fixed"):
        current = candidate_layouts(pool)[0]
        d = make_ep_width_policy(name, {"min_interval_s": 0} if name == "cost_model" else None
                                 ).decide(inputs(pool, load, current, model=model))
        assert d.layout in candidate_layouts(pool)
        fits = [lay for lay in candidate_layouts(pool) if estimate(inputs(pool, load, current, model=model), lay).fits]
        if name == "cost_model" and fits:
            assert d.layout in fits, d.reason


@settings(max_examples=100, deadline=None)
@given(loads=st.lists(st.integers(0, 256), min_size=2, max_size=12), gap=st.floats(0, 29))
def test_hysteresis_no_change_within_the_interval(loads, gap):
    pool = RankPool(4, memory_bytes=8192 * MIB)
    policy = make_ep_width_policy("cost_model", {"min_interval_s": 30})
    current, changed_at, now = EPLayout(4, 1), None, 0.0
    for per_rank in loads:
        d = policy.decide(inputs(pool, load_of(per_rank, 4), current, now=now))
        if d.changed:
            assert changed_at is None or now - changed_at >= 30
            changed_at, current = now, d.layout
        now += gap


@settings(max_examples=60, deadline=None)
@given(levels=st.lists(st.integers(1, 256), min_size=2, max_size=8, unique=True),
       per_rank_us=st.floats(1.0, 40.0))
def test_the_choice_widens_as_load_grows(levels, per_rank_us):
    """With no hysteresis, a larger batch never picks a narrower layout: the wider
    group's saving (fewer distinct experts per rank) grows with the batch, its exchange
    cost per token does not."""
    pool = RankPool(8, memory_bytes=16384 * MIB)
    tables = seed_shaped_tables(per_rank_us)
    widths = []
    for per_rank in sorted(levels):
        policy = make_ep_width_policy("cost_model", {"min_interval_s": 0, "margin": 0,
                                                     "itl_target_ms": 1e6})
        d = policy.decide(EPInputs(pool, MODEL, load_of(per_rank, 8), tables, EPLayout(8, 1)))
        widths.append(d.layout.width)
    assert widths == sorted(widths), list(zip(sorted(levels), widths))
