"""Micro-batching policies on plain data (no Ray, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.policies import make_microbatch_policy, microbatch_policy_names
from phalanx.policies.microbatch import StepShape, bucket_of


def test_names_and_bad_configs():
    assert microbatch_policy_names() == ["adaptive", "off", "on", "threshold"]
    with pytest.raises(ValueError, match="known"):
        make_microbatch_policy("sometimes")
    with pytest.raises(ValueError, match="min_tokens"):
        make_microbatch_policy("threshold", {"min_tokens": 1})
    with pytest.raises(ValueError, match="probe"):
        make_microbatch_policy("adaptive", {"probe": 1.5})
    with pytest.raises(ValueError, match="tokens"):
        StepShape(-1)


def test_fixed_policies():
    off, on = make_microbatch_policy("off"), make_microbatch_policy("on")
    threshold = make_microbatch_policy("threshold", {"min_tokens": 16})
    assert [off.decide(StepShape(t)) for t in (1, 64)] == [1, 1]
    assert [on.decide(StepShape(t)) for t in (1, 2, 64)] == [1, 2, 2]
    assert [threshold.decide(StepShape(t)) for t in (15, 16, 200)] == [1, 2, 2]


def test_buckets():
    assert [bucket_of(t) for t in (0, 1, 2, 3, 4, 5, 8, 9, 256)] == [0, 0, 1, 2, 2, 3, 3, 4, 8]


def _run(policy, cost, tokens: int, steps: int) -> list[int]:
    """Decisions of `policy` over `steps` steps of `tokens` tokens whose time is
    `cost(n)` seconds (what the group would measure)."""
    out = []
    for _ in range(steps):
        shape = StepShape(tokens)
        n = policy.decide(shape)
        policy.observe(shape, n, cost(n))
        out.append(n)
    return out


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(2, 512), one=st.floats(1e-4, 1.0), ratio=st.floats(0.5, 2.0),
       seed=st.integers(0, 100))
def test_adaptive_measures_both_then_keeps_the_faster(tokens, one, ratio, seed):
    policy = make_microbatch_policy("adaptive", {"samples": 3, "probe": 0.1, "seed": seed})
    two = one * ratio
    got = _run(policy, lambda n: one if n == 1 else two, tokens, 400)
    assert sorted(got[:6]) == [1, 1, 1, 2, 2, 2], "each measured `samples` times first"
    if abs(ratio - 1) > 1e-9:
        best = 1 if one <= two else 2
        later = got[6:]
        assert later.count(best) / len(later) > 0.8, "the faster is kept"
        assert 3 - best in later, "the other is re-probed"


def test_adaptive_follows_a_change_and_is_deterministic():
    cost = {1: 1.0, 2: 0.5}
    a = make_microbatch_policy("adaptive", {"samples": 2, "probe": 0.2, "window": 4, "seed": 7})
    b = make_microbatch_policy("adaptive", {"samples": 2, "probe": 0.2, "window": 4, "seed": 7})
    first = _run(a, lambda n: cost[n], 64, 50)
    assert first == _run(b, lambda n: cost[n], 64, 50), "same inputs, same decisions"
    assert first[-10:].count(2) >= 7
    cost = {1: 0.2, 2: 0.5}  # conditions change: one batch is now faster
    later = _run(a, lambda n: cost[n], 64, 200)
    assert later[-20:].count(1) >= 15, "re-probes found the change"
    assert a.table()[6][1] == pytest.approx(0.2 / 64)


def test_adaptive_keeps_buckets_apart_and_never_splits_one_token():
    policy = make_microbatch_policy("adaptive", {"samples": 1, "probe": 0.0})
    _run(policy, lambda n: 1.0 if n == 1 else 2.0, 8, 10)     # bucket 3: one batch wins
    _run(policy, lambda n: 2.0 if n == 1 else 1.0, 128, 10)   # bucket 7: two win
    assert policy.decide(StepShape(8)) == 1 and policy.decide(StepShape(128)) == 2
    assert policy.decide(StepShape(1)) == 1


def test_metrics_show_the_split_share_and_step_times_by_bucket():
    from phalanx.router import Router
    from phalanx.server.cluster_stats import summarize
    from phalanx.server.metrics import ServerMetrics

    router = Router(page_size=4)
    leaders = [{"microbatch_steps": 10, "microbatch_split_steps": 4,
                "microbatch_step_ms": {"3:1": 2.0, "3:2": 1.5}},
               {"microbatch_steps": 10, "microbatch_split_steps": 2,
                "microbatch_step_ms": {"3:1": 4.0}}]
    stats = summarize({"decode": leaders}, router, live=0)
    assert stats["microbatch_share"] == pytest.approx(0.3)
    assert stats["microbatch_step_ms:8:1"] == pytest.approx(3.0)
    text = ServerMetrics().render(stats).decode()
    assert "phalanx_microbatch_share 0.3" in text
    assert 'phalanx_microbatch_step_ms{microbatches="2",tokens="8"} 1.5' in text
