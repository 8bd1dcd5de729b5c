"""The chaos tool's plain parts: fault specs, the schedule and the stream checker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.chaos.checker import check_stream
from phalanx.chaos.faults import FaultSpec, parse_fault
from phalanx.chaos.schedule import planned

REF = [5, 6, 7, 8, 9, 10]


def test_fault_specs_parse_and_print_back():
    spec = parse_fault("pause-rank:every=40s:for=5s")
    assert spec == FaultSpec("pause-rank", every_s=40.0, for_s=5.0)
    assert parse_fault(spec.text) == spec
    assert parse_fault("kill-rank:at=2s,recovery:role=decode").at_events == ("recovery",)
    assert parse_fault("kv-delay:rate=0.1:for=500ms").for_s == 0.5
    assert parse_fault("fault-point:point=moe_dispatch:every=20s").point == "moe_dispatch"
    assert parse_fault("kv-drop:every=30s").kind == "kv-drop"


@pytest.mark.parametrize("text, message", [
    ("kill-everything:every=1s", "unknown fault kind"),
    ("kill-rank", "exactly one of"),
    ("kill-rank:every=1s:rate=2", "exactly one of"),
    ("pause-rank:every=10s", "for="),
    ("kill-rank:every=10s:for=1s", "for= applies"),
    ("kill-rank:every=soon", "is not a time"),
    ("fault-point:every=5s", "point="),
    ("fault-point:point=nowhere:every=5s", "point must be"),
    ("kill-rank:every=5s:role=boss", "role must be"),
    ("kill-rank:often=5s", "unknown key"),
])
def test_bad_fault_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_fault(text)


def test_schedule_is_seeded_and_within_the_duration():
    specs = [parse_fault("kill-rank:every=15s"), parse_fault("kill-actor:rate=0.2"),
             parse_fault("remove-node:at=40s,99s")]
    one, two = planned(specs, 60.0, seed=1), planned(specs, 60.0, seed=1)
    assert one == two and one != planned(specs, 60.0, seed=2)
    assert [p.t for p in one if p.spec.kind == "kill-rank"] == [15.0, 30.0, 45.0]
    assert [p.t for p in one if p.spec.kind == "remove-node"] == [40.0]
    assert all(0 < p.t < 60 for p in one) and [p.t for p in one] == sorted(p.t for p in one)


@pytest.mark.parametrize("chunks, kind", [
    ([[5, 6], [7], [8, 9, 10]], "ok"),
    ([[5, 6], [8, 9, 10]], "lost"),
    ([[5, 6, 7], [7, 8, 9, 10]], "duplicated"),
    ([[5, 7, 6], [8, 9, 10]], "reordered"),
    ([[5, 6, 7, 8, 9, 11]], "changed"),
])
def test_each_kind_of_damage_is_named(chunks, kind):
    assert check_stream(REF, chunks).kind == kind


def test_cut_off_streams_and_errors():
    assert check_stream(REF, [[5, 6]], cut_off=True).kind == "ok"
    assert check_stream(REF, [[5, 7]], cut_off=True).kind == "changed"
    gave_up = check_stream(REF, [[5, 6]], (503, "service_unavailable"), service_gave_up=True)
    assert gave_up.kind == "gave-up" and gave_up.passed
    assert check_stream(REF, [[5]], (503, "x"), service_gave_up=False).kind == "error"
    assert check_stream(REF, [[6]], (503, "x"), service_gave_up=True).kind == "changed"
    assert check_stream(REF, [], (500, "internal")).kind == "error"


@given(st.lists(st.integers(0, 50), min_size=1, max_size=30), st.data())
def test_only_the_reference_passes_uncut(ref, data):
    got = data.draw(st.lists(st.integers(0, 50), max_size=30))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(got)), max_size=4)))
    chunks = [got[a:b] for a, b in zip([0] + cuts, cuts + [len(got)])]
    assert check_stream(ref, chunks).passed == (got == ref)


def test_fault_points_exit_stall_or_drop_once():
    import time

    from phalanx.actors.rank.fault_points import FaultPoints
    points = FaultPoints()
    points.arm("kv_send", after=1, drop=True)
    assert [points.passed("kv_send") for _ in range(3)] == [False, True, False]
    points.arm("step", stall_s=0.05)
    t = time.monotonic()
    assert points.passed("step") is False and time.monotonic() - t >= 0.05
    assert points.passed("step") is False
    with pytest.raises(ValueError, match="not both"):
        points.arm("kv_send", stall_s=1.0, drop=True)
