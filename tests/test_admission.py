"""Admission at the router: requests held until a DP group has room, and the group with
room takes the held request it serves best (router/admission.py). Plain Python, ms."""

from __future__ import annotations

import pytest

from phalanx.engine.sampling_params import SamplingParams
from phalanx.router import RequestRecord, Router
from phalanx.router.admission import Admission, AdmissionConfig

PS = 4
SYSTEM = list(range(100, 132))  # 8 pages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(rid: str, tokens: list[int]) -> RequestRecord:
    return RequestRecord(rid, tokens, SamplingParams(max_tokens=4))


def conversation(k: int, pages: int = 6) -> list[int]:
    return SYSTEM + [1000 * (k + 1) + i for i in range(pages * PS)]


def setup(groups: int = 2, **cfg) -> tuple[Router, Admission, Clock]:
    router = Router(page_size=PS, groups=range(groups))
    clock = Clock()
    return router, Admission(router, AdmissionConfig(**cfg), clock=clock), clock


@pytest.mark.parametrize("bad", [dict(max_requests=-1), dict(window=0),
                                 dict(max_requests=2, max_queued_tokens=0),
                                 dict(wait_tokens_per_s=-1.0), dict(wait_tokens_per_s=float("nan")),
                                 dict(max_requests=True), dict(window=2.5)])
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="AdmissionConfig"):
        AdmissionConfig(**bad)


def test_without_a_hold_everything_is_placed_at_once_in_arrival_order():
    router, adm, _ = setup()
    for i in range(5):
        adm.hold(record(f"r{i}", conversation(i)))
    placed = adm.place()
    assert [r.request_id for r, _ in placed] == [f"r{i}" for i in range(5)]
    assert all(r.dp_group == g for r, g in placed) and len(adm) == 0
    assert router.decode.num_inflight == 5


def test_a_full_group_takes_nothing_until_a_request_finishes():
    router, adm, _ = setup(groups=1, max_requests=2)
    recs = [record(f"r{i}", conversation(i)) for i in range(3)]
    for r in recs:
        adm.hold(r)
    assert [r.request_id for r, _ in adm.place()] == ["r0", "r1"]
    assert adm.place() == [] and "r2" in adm and recs[2].dp_group is None
    assert router.decode.routed(0)[0] == 2
    router.finish(recs[0])
    assert [(r.request_id, g) for r, g in adm.place()] == [("r2", 0)]


def test_queued_prompt_tokens_also_close_a_group_until_prefill_is_done():
    router, adm, _ = setup(groups=1, max_requests=8, max_queued_tokens=40)
    a, b = record("a", conversation(0)), record("b", conversation(1))  # 56 tokens each
    adm.hold(a)
    adm.hold(b)
    assert [r.request_id for r, _ in adm.place()] == ["a"]
    assert router.decode.routed(0) == (1, 56)
    router.prefill_done(a)
    assert [r.request_id for r, _ in adm.place()] == ["b"]


def test_a_group_with_room_takes_its_own_conversation_before_older_strangers():
    router, adm, clock = setup(groups=2, max_requests=1, wait_tokens_per_s=1.0)
    first = [record("c0", conversation(0)), record("c1", conversation(1))]
    for r in first:
        adm.hold(r)
    homes = {r.request_id: g for r, g in adm.place()}
    assert sorted(homes.values()) == [0, 1]
    home0 = next(rid for rid, g in homes.items() if g == 0)
    k0 = int(home0[1])
    # group 1's conversation's next turn arrives first, group 0's second
    other = record("next-other", conversation(1 - k0, pages=9))
    own = record("next-own", conversation(k0, pages=9))
    adm.hold(other)
    clock.now += 1.0
    adm.hold(own)
    router.finish(next(r for r in first if r.request_id == home0))
    placed = adm.place()
    assert [(r.request_id, g) for r, g in placed] == [("next-own", 0)]
    assert "next-other" in adm  # it waits for its own group


def test_a_long_wait_outweighs_a_lost_prefix():
    router, adm, clock = setup(groups=2, max_requests=1, wait_tokens_per_s=10.0)
    a, b = record("a", conversation(0)), record("b", conversation(1))
    adm.hold(a)
    adm.hold(b)
    homes = {r.request_id: g for r, g in adm.place()}
    stranger = record("a2", conversation(0, pages=9))  # a's next turn; a's group stays full
    adm.hold(stranger)
    router.finish(b)
    cold = record("cold", list(range(5000, 5040)))
    adm.hold(cold)
    # a2 would lose 14 pages (56 tokens) on b's group; after 1 s it counts 10 tokens
    clock.now += 1.0
    assert [r.request_id for r, _ in adm.place()] == ["cold"]
    router.finish(cold)
    clock.now += 10.0  # now 110 tokens of waiting: worth more than the lost prefix
    placed = adm.place()
    assert [(r.request_id, g) for r, g in placed] == [("a2", homes["b"])]


def test_the_window_bounds_how_far_a_pick_looks():
    router, adm, _ = setup(groups=1, max_requests=1, window=2, wait_tokens_per_s=0.0)
    warm = record("warm", conversation(0))
    adm.hold(warm)
    adm.place()
    router.finish(warm)
    for i in range(3):
        adm.hold(record(f"cold{i}", list(range(7000 + 100 * i, 7040 + 100 * i))))
    adm.hold(record("turn", conversation(0, pages=9)))
    # the next turn of group 0's conversation is 4th: outside a window of 2
    assert [r.request_id for r, _ in adm.place()] == ["cold0"]


def test_drop_takes_a_held_request_back_and_duplicates_are_refused():
    router, adm, _ = setup(groups=1, max_requests=1)
    a, b = record("a", conversation(0)), record("b", conversation(1))
    adm.hold(a)
    with pytest.raises(ValueError, match="already held"):
        adm.hold(a)
    adm.hold(b)
    adm.place()
    assert adm.drop("b") is b and adm.drop("b") is None and len(adm) == 0
    router.finish(a)
    assert adm.place() == [] and router.decode.num_inflight == 0
    b.abort()
    with pytest.raises(ValueError, match="ended"):
        adm.hold(b)


def test_held_requests_wait_while_there_is_no_group_and_go_when_one_is_added():
    router, adm, _ = setup(groups=0, max_requests=2)
    adm.hold(record("a", conversation(0)))
    assert adm.place() == []
    router.add_group(7)
    assert [(r.request_id, g) for r, g in adm.place()] == [("a", 7)]


def test_a_request_that_would_lose_too_much_waits_for_its_group():
    router, adm, clock = setup(groups=2, max_requests=1, wait_tokens_per_s=4.0, move_tokens=16)
    a, b = record("a", conversation(0)), record("b", list(range(5000, 5024)))
    adm.hold(a)
    adm.hold(b)
    homes = {r.request_id: g for r, g in adm.place()}
    assert sorted(homes) == ["a", "b"]
    router.finish(b)  # b's group has room, a's does not
    turn = record("a2", conversation(0, pages=9))  # a's group holds 14 pages (56 tokens) of it
    adm.hold(turn)
    assert adm.place() == [] and "a2" in adm
    clock.now += 9.0  # 36 tokens of waiting: 56 - 36 = 20 lost, still past move_tokens
    assert adm.place() == []
    clock.now += 1.0  # 40: loses 16, which is allowed
    assert [(r.request_id, g) for r, g in adm.place()] == [("a2", homes["b"])]
