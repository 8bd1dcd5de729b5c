"""RequestRecord / RequestTable: exactly-once, in-order token forwarding and lifecycle."""

from __future__ import annotations

import random

import pytest

from phalanx.engine.sampling_params import SamplingParams
from phalanx.router import (DuplicateRequestError, RequestRecord, RequestState,
                            RequestStateError, RequestTable, TokenGapError)


def rec(max_tokens: int = 8, seed: int | None = 1) -> RequestRecord:
    return RequestRecord("r1", (5, 6, 7), SamplingParams(max_tokens=max_tokens, seed=seed))


def test_accept_forwards_each_index_once_in_order():
    r = rec()
    assert r.accept(0, [10]) == [(0, 10)]
    assert r.state is RequestState.DECODING
    assert r.accept(1, [11, 12]) == [(1, 11), (2, 12)]
    assert r.next_index == 3
    assert r.resume_tokens() == [5, 6, 7, 10, 11, 12]


def test_duplicates_after_replay_are_dropped_and_the_rest_forwarded():
    r = rec()
    r.accept(0, [10, 11, 12])
    assert r.accept(0, [10, 11]) == []  # a re-run replays tokens the client has
    assert r.accept(1, [11, 12, 13, 14]) == [(3, 13), (4, 14)]
    assert r.output_token_ids == [10, 11, 12, 13, 14]


def test_gap_raises_and_changes_nothing():
    r = rec()
    r.accept(0, [10])
    with pytest.raises(TokenGapError, match="index 3 .* owed index 1"):
        r.accept(3, [13])
    assert r.next_index == 1 and r.state is RequestState.DECODING
    assert r.accept(1, [11]) == [(1, 11)]


def test_nothing_after_finish():
    r = rec()
    assert r.accept(0, [10, 11], finished=True, finish_reason="stop") == [(0, 10), (1, 11)]
    assert r.state is RequestState.FINISHED and r.finish_reason == "stop"
    assert r.accept(2, [12]) == []
    assert r.accept(5, [15], finished=True) == []  # not even a gap error once ended
    assert r.output_token_ids == [10, 11]


def test_finish_with_duplicates_only_ends_the_request():
    r = rec()
    r.accept(0, [10, 11, 12])
    assert r.accept(1, [11, 12], finished=True, finish_reason="length") == []
    assert r.state is RequestState.FINISHED and r.finish_reason == "length"


def test_finish_that_contradicts_emitted_tokens_raises():
    r = rec()
    r.accept(0, [10, 11, 12])
    with pytest.raises(RequestStateError, match="already emitted"):
        r.accept(0, [10], finished=True)
    assert not r.done


def test_empty_finish_message():
    r = rec()
    r.accept(0, [10])
    assert r.accept(1, [], finished=True, finish_reason="stop") == []
    assert r.done and r.output_token_ids == [10]


def test_max_tokens_is_never_exceeded():
    r = rec(max_tokens=2)
    r.accept(0, [10])
    with pytest.raises(ValueError, match="exceed max_tokens=2"):
        r.accept(1, [11, 12])
    assert r.output_token_ids == [10]
    assert r.remaining_tokens() == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_bad_tokens_and_indexes_are_rejected(bad):
    r = rec()
    with pytest.raises(ValueError):
        r.accept(0, [bad])
    with pytest.raises(ValueError):
        r.accept(bad if bad is not None else -2, [1])  # type: ignore[arg-type]
    assert r.next_index == 0


def test_construction_validates_and_pins_a_seed():
    with pytest.raises(ValueError, match="empty prompt"):
        RequestRecord("a", ())
    with pytest.raises(ValueError, match="request_id"):
        RequestRecord("", (1,))
    with pytest.raises(ValueError, match="non-negative"):
        RequestRecord("a", (1, -3))
    seeded = RequestRecord("a", [1, 2], SamplingParams(seed=None), random.Random(0))
    assert seeded.sampling_params.seed == random.Random(0).getrandbits(63)
    assert isinstance(seeded.prompt_token_ids, tuple)
    assert RequestRecord("b", (1,), SamplingParams(seed=7)).sampling_params.seed == 7
    assert RequestRecord("c", (1,)).max_tokens is None  # opaque / absent params


def test_lifecycle_transitions_and_recovery():
    r = rec()
    r.transition(RequestState.PREFILLING)
    r.place(dp_group=2, prefill_instance="p0")
    r.accept(0, [10, 11])
    assert r.requeue() == [5, 6, 7, 10, 11]
    assert (r.state, r.dp_group, r.prefill_instance, r.recoveries) == \
        (RequestState.QUEUED, None, None, 1)
    assert r.accept(0, [10, 11, 12]) == [(2, 12)]  # the re-run streams on from index 2
    assert r.abort() is True and r.abort() is False
    assert r.state is RequestState.ABORTED
    with pytest.raises(RequestStateError, match="cannot go from aborted"):
        r.transition(RequestState.DECODING)
    with pytest.raises(RequestStateError):
        r.place(dp_group=1)
    f = rec()
    assert f.fail("rank lost twice") and f.error == "rank lost twice"
    assert f.finish_reason == "error" and not f.fail("again")


def test_table_rejects_duplicates_and_counts_states():
    t = RequestTable(seed_rng=random.Random(1))
    a = t.create("a", [1, 2], SamplingParams())
    assert a.sampling_params.seed is not None
    with pytest.raises(DuplicateRequestError, match="'a'"):
        t.create("a", [3])
    with pytest.raises(DuplicateRequestError):
        t.add(RequestRecord("a", (3,)))
    b = t.add(RequestRecord("b", (3,)))
    b.place(dp_group=1)
    b.accept(0, [4])
    assert t.get("b") is b and "b" in t and len(t) == 2
    with pytest.raises(KeyError, match="unknown request id 'zz'"):
        t.get("zz")
    counts = t.count_by_state()
    assert counts[RequestState.QUEUED] == 1 and counts[RequestState.DECODING] == 1
    assert sum(counts.values()) == 2 and set(counts) == set(RequestState)
    assert t.on_group(1) == [b] and t.live() == [a, b]
    b.abort()
    assert t.on_group(1) == [] and t.in_state(RequestState.ABORTED) == [b]
    assert t.remove("b") is b and t.remove("b") is None
    t.create("b", [9])  # an id is free again once removed
