"""Policy registry, routing-policy configs and the three routing policies."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.policies import (Candidate, GroupLoad, LeastLoadedConfig, PrefixAwareConfig,
                              PrefixAwarePolicy, RoundRobinPolicy, make_routing_policy, registry,
                              routing_policy_names)


def cand(group, queued=0, matched=0, running=0, kv=0.0) -> Candidate:
    return Candidate(group, GroupLoad(queued, running, kv), matched)


def test_registry_lists_names_and_explains_unknown_ones():
    assert routing_policy_names() == ["least_loaded", "prefix_aware", "round_robin"]
    assert registry.get("routing", "round_robin") is RoundRobinPolicy
    with pytest.raises(ValueError, match=r"unknown routing policy 'nope'; known: "
                                         r"\['least_loaded', 'prefix_aware', 'round_robin'\]"):
        make_routing_policy("nope")
    with pytest.raises(ValueError, match=r"unknown policy kind 'nokind'; known kinds: .*routing"):
        registry.get("nokind", "x")
    assert registry.names("nokind") == []


def test_registry_refuses_a_second_owner_of_a_name():
    @registry.register("test-kind", "one")
    class One:
        pass

    registry.register("test-kind", "one")(One)  # the same object again is harmless
    with pytest.raises(ValueError, match="already registered"):
        registry.register("test-kind", "one")(type("Other", (), {}))
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("test-kind", "")
    assert registry.get("test-kind", "one") is One


@pytest.mark.parametrize("kwargs, match", [
    (dict(balance_abs_tokens=-1), "balance_abs_tokens: must be a non-negative integer"),
    (dict(balance_abs_tokens=1.5), "balance_abs_tokens"),
    (dict(balance_ratio=0.9), "balance_ratio: must be a number >= 1.0"),
    (dict(balance_ratio=float("nan")), "balance_ratio"),
    (dict(load_weight=-0.1), "load_weight: must be a finite number >= 0"),
    (dict(load_weight=float("inf")), "load_weight"),
    (dict(running_cost_tokens=-5), "running_cost_tokens"),
    (dict(kv_high_watermark=0.0), r"kv_high_watermark: must be a number in \(0, 1\]"),
    (dict(kv_high_watermark=True), "kv_high_watermark"),
])
def test_prefix_aware_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=f"PrefixAwareConfig.{match}"):
        PrefixAwareConfig(**kwargs)


def test_configs_from_mappings_and_their_errors():
    p = make_routing_policy("prefix_aware", {"balance_abs_tokens": 10, "balance_ratio": 1.0})
    assert p.config == PrefixAwareConfig(balance_abs_tokens=10, balance_ratio=1.0)
    with pytest.raises(ValueError, match=r"unknown keys \['balance'\]"):
        make_routing_policy("prefix_aware", {"balance": 1})
    with pytest.raises(TypeError, match="expected a LeastLoadedConfig"):
        make_routing_policy("least_loaded", PrefixAwareConfig())
    with pytest.raises(ValueError, match="LeastLoadedConfig.kv_high_watermark"):
        LeastLoadedConfig(kv_high_watermark=2)
    with pytest.raises(ValueError, match="unknown keys"):
        make_routing_policy("round_robin", {"x": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.config.balance_ratio = 2.0  # type: ignore[misc]


def test_group_load_validation():
    with pytest.raises(ValueError, match="GroupLoad.queued_tokens"):
        GroupLoad(-1)
    with pytest.raises(ValueError, match="GroupLoad.running"):
        GroupLoad(0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="GroupLoad.kv_usage"):
        GroupLoad(0, 0, 1.5)


def test_every_policy_refuses_an_empty_candidate_list():
    for name in routing_policy_names():
        with pytest.raises(ValueError, match="no candidate groups"):
            make_routing_policy(name).choose([], 10)


def test_round_robin_cycles_in_order():
    p = make_routing_policy("round_robin")
    cs = [cand(g) for g in "abc"]
    assert [p.choose(cs, 1) for _ in range(7)] == list("abcabca")


def test_least_loaded_counts_running_requests_and_skips_full_caches():
    p = make_routing_policy("least_loaded", {"running_cost_tokens": 100})
    assert p.choose([cand("a", queued=250), cand("b", running=3), cand("c", queued=200)], 1) == "c"
    assert p.choose([cand("a", queued=10, kv=0.99), cand("b", queued=500)], 1) == "b"
    assert p.choose([cand("a", kv=0.99), cand("b", kv=0.97)], 1) == "b"  # all full: usage
    assert p.choose([cand("a"), cand("b")], 1) == "a"  # ties: first in order


def test_prefix_aware_prefers_the_longest_prefix_while_balanced():
    p = make_routing_policy("prefix_aware", PrefixAwareConfig(
        balance_abs_tokens=1000, balance_ratio=1.0, load_weight=0.5, running_cost_tokens=0))
    cs = [cand("a", queued=400, matched=512), cand("b", queued=0, matched=64),
          cand("c", queued=100, matched=0)]
    assert p.choose(cs, 600) == "a"  # 512 - 200 beats 64 - 0
    cs = [cand("a", queued=1000, matched=512), cand("b", queued=0, matched=64)]
    assert p.choose(cs, 600) == "b"  # 512 - 500 < 64: the load outweighs the prefix
    assert p.choose([cand("a"), cand("b")], 10) == "a"  # nothing matched, equal loads
    assert (p.load_overrides, p.prefix_choices) == (0, 3)


def test_prefix_aware_lets_load_win_beyond_the_threshold():
    cfg = PrefixAwareConfig(balance_abs_tokens=1000, balance_ratio=2.0, load_weight=0.0,
                            running_cost_tokens=0)
    p = PrefixAwarePolicy(cfg)
    # difference 1001 > 1000 and 1501 > 2 * 500: imbalanced, so the least loaded wins
    cs = [cand("a", queued=1501, matched=4096), cand("b", queued=500), cand("c", queued=900)]
    assert p.choose(cs, 5000) == "b" and p.load_overrides == 1
    # difference 1500 but ratio 1.75 < 2: still balanced, the prefix wins
    cs = [cand("a", queued=3500, matched=4096), cand("b", queued=2000)]
    assert p.choose(cs, 5000) == "a" and p.prefix_choices == 1
    # among equally least loaded, the longer prefix
    cs = [cand("a", queued=5000), cand("b", queued=0, matched=16), cand("c", queued=0, matched=32)]
    assert p.choose(cs, 100) == "c"


def test_policies_are_deterministic():
    cs = [cand(g, queued=q, matched=m) for g, q, m in [("a", 5, 32), ("b", 5, 32), ("c", 0, 0)]]
    for name in routing_policy_names():
        runs = [[make_routing_policy(name).choose(cs, 64) for _ in range(3)] for _ in range(2)]
        assert runs[0] == runs[1]


# ---- the decision rules of issue 34: ties, the latency guard, the load safety valve ----

@pytest.mark.parametrize("kwargs, match", [
    (dict(spill_ratio=0.5), "spill_ratio: must be a number >= 1.0"),
    (dict(spill_ratio=float("nan")), "spill_ratio"),
    (dict(spill_abs_tokens=-1), "spill_abs_tokens: must be a non-negative integer"),
    (dict(spill_abs_tokens=2.5), "spill_abs_tokens"),
])
def test_prefix_aware_spill_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=f"PrefixAwareConfig.{match}"):
        PrefixAwareConfig(**kwargs)


def test_prefix_aware_spreads_ties_over_idle_groups_instead_of_the_first():
    p = make_routing_policy("prefix_aware")
    idle = [cand(g) for g in "abcd"]
    assert [p.choose(idle, 600) for _ in range(6)] == list("abcdab")
    # a tie among some candidates rotates over those only
    cs = [cand("a", queued=900), cand("b"), cand("c", queued=900), cand("d")]
    assert {p.choose(cs, 600) for _ in range(4)} == {"b", "d"}


def test_prefix_aware_breaks_equal_scores_by_load_before_rotating():
    p = make_routing_policy("prefix_aware", {"load_weight": 0.5, "running_cost_tokens": 0})
    # both score 0: 0.5 * 200 - 100 and 0.5 * 0 - 0; the idle one wins every time
    cs = [cand("a", queued=200, matched=100), cand("b")]
    assert [p.choose(cs, 600) for _ in range(3)] == ["b"] * 3


def test_prefix_aware_a_long_queue_loses_to_a_slightly_worse_match():
    p = make_routing_policy("prefix_aware")
    cs = [cand("a", queued=3000, matched=1024), cand("b", matched=960)]
    assert p.choose(cs, 1100) == "b"  # 0.5 * 3000 - 1024 > -960
    cs = [cand("a", queued=100, matched=1024), cand("b", matched=960)]
    assert p.choose(cs, 1100) == "a"  # 0.5 * 100 - 1024 < -960: a short queue stays
    assert p.cost_overrides == p.load_overrides == 0 and p.prefix_choices == 2


def test_prefix_aware_latency_guard_takes_the_cheapest_expected_cost():
    p = make_routing_policy("prefix_aware", {"load_weight": 0.1})
    # by score a wins (0.1 * 12000 - 3000 < -512), but its expected cost
    # 12000 + 100 exceeds 2 * (0 + 2588) + 2048: b, the cheapest, is chosen
    cs = [cand("a", queued=12000, matched=3000), cand("b", matched=512)]
    assert p.choose(cs, 3100) == "b" and p.cost_overrides == 1
    # with 5000 queued, 5100 is within the guard: the score's pick stands
    cs = [cand("a", queued=5000, matched=3000), cand("b", matched=512)]
    assert p.choose(cs, 3100) == "a" and p.prefix_choices == 1


def test_prefix_aware_defaults_leave_one_prompt_of_queue_to_the_score():
    # the old defaults (4096 tokens, 1.25x) overrode here: an idle group passes the
    # ratio test at once, so one uncached prompt's worth of queue sent the request away
    # from the 3000 tokens it shares with group a
    p = make_routing_policy("prefix_aware")
    cs = [cand("a", queued=4100, matched=3000), cand("b", matched=512)]
    assert p.choose(cs, 3100) == "a" and p.load_overrides == 0
    old = make_routing_policy("prefix_aware", {"balance_abs_tokens": 4096})
    assert old.choose(cs, 3100) == "b" and old.load_overrides == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(saturation_tokens=0), "saturation_tokens: must be a positive integer"),
    (dict(saturation_tokens=1.5), "saturation_tokens"),
    (dict(saturation_gain=-0.5), "saturation_gain: must be a finite number >= 0"),
    (dict(saturation_gain=float("nan")), "saturation_gain"),
])
def test_prefix_aware_saturation_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=f"PrefixAwareConfig.{match}"):
        PrefixAwareConfig(**kwargs)


def test_prefix_weight_is_one_below_saturation_and_grows_with_the_least_queue():
    p = make_routing_policy("prefix_aware")  # saturation at 4096 tokens, gain 1.0
    assert p.prefix_weight([0, 9000, 9000], 2000) == 1.0  # one group not queued
    assert p.prefix_weight([4095, 9000], 2000) == 1.0
    # every group queued: one extra charge per prompt-sized request on the least busy
    assert p.prefix_weight([8000, 12000], 2000) == 5.0  # 1 + 8000 / 2000
    assert p.prefix_weight([8000, 12000], 4000) == 3.0
    half = make_routing_policy("prefix_aware", {"saturation_gain": 0.5})
    assert half.prefix_weight([8000, 12000], 2000) == 3.0
    off = make_routing_policy("prefix_aware", {"saturation_gain": 0})
    assert off.prefix_weight([8000, 12000], 2000) == 1.0


# A conversation's later turn (2000 tokens): group a holds 1500 of them, b only the
# shared system prompt (512); no running requests, so loads are the queued tokens.
def _turn(queued_a: int, queued_b: int) -> list[Candidate]:
    return [cand("a", queued=queued_a, matched=1500), cand("b", queued=queued_b, matched=512)]


def test_saturated_conversation_stays_where_its_prefix_is():
    # 0.5 * 12000 - 1500 > 0.5 * 8000 - 512: the plain score moves it to the shorter
    # queue, prefilling 988 tokens again; at saturation the lost prefix weighs 5x
    # (1 + 8000 / 2000): 6000 - 7500 < 4000 - 2560, it stays on a
    cs = _turn(12000, 8000)
    old = make_routing_policy("prefix_aware", {"saturation_gain": 0})
    assert old.choose(cs, 2000) == "b" and old.saturated == 0
    p = make_routing_policy("prefix_aware")
    assert p.choose(cs, 2000) == "a" and p.saturated == 1 and p.prefix_choices == 1


def test_saturated_conversation_moves_when_its_queue_gap_exceeds_what_the_cache_saves():
    # the gap (10500) times 0.5 outweighs 5 x the 988 tokens a saves: 9250 - 7500 >
    # 4000 - 2560, and the latency guard does not fire (19000 + 500 < 2 * 9488 + 2048)
    p = make_routing_policy("prefix_aware")
    assert p.choose(_turn(18500, 8000), 2000) == "b" and p.cost_overrides == 0
    # the same absolute gap on larger queues is a smaller relative one: it stays
    assert p.choose(_turn(30500, 20000), 2000) == "a"


def test_saturation_leaves_an_idle_group_to_the_plain_score():
    # b below saturation_tokens: the rule is off, the plain score moves the turn
    p = make_routing_policy("prefix_aware")
    assert p.choose(_turn(9000, 4000), 2000) == "b" and p.saturated == 0
