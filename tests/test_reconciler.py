"""The reconciler's state machine (plain logic) under random event orders: deaths in
every phase, formations that fail, events duplicated or late from older epochs, time
passing; checked against the invariants of ARCHITECTURE §5."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from phalanx.actors.reconciler import (CapacityBack, Fence, Form, Formed, FormFailed, GiveUp,
                                       Phase, RankLost, Reconciler, RestartIntensity, Resume)

KEYS = ("decode", ("prefill", 0), ("prefill", 1))


class Sim:
    """An executor that carries out the actions and keeps the record the checks read."""

    def __init__(self, intensity: RestartIntensity) -> None:
        self.rec = Reconciler({k: 1 for k in KEYS}, intensity,
                              widths={"decode": (4, 1), ("prefill", 0): (2, 2)},
                              pools={("prefill", 0): "prefill", ("prefill", 1): "prefill"})
        self.now = 0.0
        self.epoch = {k: 1 for k in KEYS}  # the supervisor's epoch (what actors carry)
        self.fenced = {k: set() for k in KEYS}
        self.forming: dict = {}  # key -> epoch of the formation under way
        self.live = {k: 1 for k in KEYS}  # epoch serving now (None while down)
        self.seen: list = []  # every event ever sent, for replays
        self.forms: list[float] = []
        self.gave_up = False

    def step(self) -> None:
        for a in self.rec.actions(self.now):
            if isinstance(a, Fence):
                assert a.epoch not in self.fenced[a.key]
                assert a.key not in self.forming
                self.fenced[a.key].add(a.epoch)
                self.live[a.key] = None
            elif isinstance(a, Form):
                assert a.key not in self.forming, "two formations of one group at once"
                assert a.epoch > self.epoch[a.key], "a formation reuses an old epoch"
                assert self.epoch[a.key] in self.fenced[a.key], "formed before fencing"
                g = self.rec.groups[a.key]
                assert g.min_width <= a.width <= g.desired
                self.epoch[a.key] = a.epoch
                self.forming[a.key] = a.epoch
                if not a.planned:  # layout changes are outside the restart intensity
                    self.forms.append(self.now)
            elif isinstance(a, Resume):
                assert self.rec.groups[a.key].phase is Phase.SERVING
                self.live[a.key] = a.epoch
            else:
                assert isinstance(a, GiveUp)
                self.gave_up = True

    def send(self, event) -> None:
        self.seen.append(event)
        self.rec.observe(event, self.now)


def _ops():
    key = st.sampled_from(KEYS)
    return st.lists(st.one_of(
        st.tuples(st.just("kill"), key),  # a rank of the group's current epoch dies
        st.tuples(st.just("formed"), key),  # a formation under way finishes
        st.tuples(st.just("form_fails"), key),  # ... or a rank dies while it forms
        st.tuples(st.just("form_short"), key),  # ... or finds no room for a rank
        st.tuples(st.just("capacity_back"), key),  # the executor found room to widen
        st.tuples(st.just("replay"), st.integers(0, 1000)),  # an old event arrives again
        st.tuples(st.just("reshape"), st.tuples(st.integers(0, 4), st.integers(0, 4))),
        st.tuples(st.just("wait"), st.floats(0.0, 30.0)),
    ), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=_ops(), restarts=st.integers(0, 6), window=st.sampled_from([5.0, 60.0, 1e9]))
def test_random_event_orders_keep_the_invariants(ops, restarts, window):
    sim = Sim(RestartIntensity(restarts, window, backoff_s=0.5, max_backoff_s=4.0))
    for op, arg in ops:
        if sim.gave_up:
            break
        if op == "kill" and sim.live[arg] is not None:
            sim.send(RankLost(arg, sim.live[arg], "process died"))
        elif op == "formed" and arg in sim.forming:
            sim.send(Formed(arg, sim.forming.pop(arg)))
        elif op == "form_fails" and arg in sim.forming:
            sim.send(FormFailed(arg, sim.forming.pop(arg), "ActorDiedError"))
        elif op == "form_short" and arg in sim.forming:
            sim.send(FormFailed(arg, sim.forming.pop(arg), "no room", short=True))
        elif op == "capacity_back" and (sim.live[arg] is not None
                                        or sim.rec.groups[arg].phase is Phase.PARKED):
            g = sim.rec.groups[arg]
            was = g.width < g.desired
            assert sim.rec.observe(CapacityBack(arg, g.epoch), sim.now) == was
        elif op == "replay" and sim.seen:
            before = {k: (g.phase, g.epoch) for k, g in sim.rec.groups.items()}
            old = sim.seen[arg % len(sim.seen)]
            changed = sim.rec.observe(old, sim.now)
            # A replayed event changes nothing unless it is of the live epoch (then it
            # is a second report of the same death: the group goes down once).
            if changed:
                g = sim.rec.groups[old.key]
                assert isinstance(old, RankLost) and before[old.key][1] == old.epoch
                assert before[old.key][0] is Phase.SERVING and g.phase is Phase.DOWN
        elif op == "reshape":  # the EP-width policy: decode and one prefill key's widths
            sim.rec.reshape({"decode": arg[0], ("prefill", 1): arg[1]}, sim.now)
        elif op == "wait":
            sim.now += arg
        sim.step()
        # The restart intensity: never more than R formations within any window.
        recent = [t for t in sim.forms if t > sim.now - window]
        assert len(recent) <= restarts
        for key, g in sim.rec.groups.items():
            if g.phase is Phase.PARKED:  # dropped only while a peer of its pool served
                assert g.width == 0 and g.pool is not None and sim.live[key] is None
            elif g.phase is Phase.RETIRED:  # not in the layout: nothing of it serves
                assert g.width == g.desired == 0 and sim.live[key] is None
            else:
                assert g.min_width <= g.width <= g.desired
    # Liveness: once deaths stop, every formation succeeds and time passes, the layout
    # settles (every group serving) or has given up; it never stalls in between.
    for _ in range(50):
        if sim.gave_up or sim.rec.settled:
            break
        for key in list(sim.forming):
            sim.send(Formed(key, sim.forming.pop(key)))
        sim.now += 5.0
        sim.step()
    groups = sim.rec.groups
    assert sim.gave_up or (sim.rec.settled and all(
        v is not None or groups[k].phase in (Phase.PARKED, Phase.RETIRED)
        for k, v in sim.live.items()))
    if sim.gave_up:
        assert sim.rec.failed is not None and sim.rec.actions(sim.now) == []


def test_a_death_during_formation_forms_again_under_a_later_epoch():
    rec = Reconciler({"decode": 1}, RestartIntensity(5, 60.0, backoff_s=1.0))
    assert rec.observe(RankLost("decode", 1, "process died"), 0.0)
    assert rec.actions(0.0) == [Fence("decode", 1), Form("decode", 2, 1, 1, "process died")]
    # the formation ran under epoch 3 (a taken port skipped 2), and a rank died in it
    assert rec.observe(FormFailed("decode", 3, "ActorDiedError"), 1.0)
    assert not rec.observe(RankLost("decode", 1, "process died"), 1.0)  # late, old epoch
    assert rec.actions(1.0) == [Fence("decode", 3)]  # backoff: 1 s before trying again
    assert rec.actions(1.5) == []
    assert rec.next_due() == 2.0
    assert rec.actions(2.0) == [Form("decode", 4, 2, 1, "ActorDiedError")]
    assert not rec.observe(FormFailed("decode", 3, "late"), 2.1)
    assert rec.observe(Formed("decode", 4), 3.0)
    assert rec.actions(3.0) == [Resume("decode", 4)]
    assert rec.settled and rec.total_restarts == 2


def test_two_groups_down_at_once_are_fenced_before_either_forms():
    rec = Reconciler({"decode": 1, ("prefill", 0): 1}, RestartIntensity(5, 60.0))
    rec.observe(RankLost(("prefill", 0), 1, "process died"))
    rec.observe(RankLost("decode", 1, "process died"))
    acts = rec.actions(0.0)
    assert [type(a) for a in acts] == [Fence, Fence, Form, Form]


@pytest.mark.parametrize("restarts", [0, 1, 3])
def test_intensity_exceeded_gives_up_once(restarts):
    rec = Reconciler({"g": 1}, RestartIntensity(restarts, 10.0, backoff_s=0.0, max_backoff_s=0.0))
    epoch = 1
    for i in range(restarts):
        rec.observe(RankLost("g", epoch, f"death {i}"), float(i))
        acts = rec.actions(float(i))
        assert isinstance(acts[-1], Form)
        epoch = acts[-1].epoch
        rec.observe(Formed("g", epoch), float(i))
        rec.actions(float(i))
    rec.observe(RankLost("g", epoch, "one too many"), float(restarts))
    acts = rec.actions(float(restarts))
    assert isinstance(acts[-1], GiveUp) and "one too many" in acts[-1].reasons
    assert rec.actions(100.0) == [] and not rec.serving("g")


def test_deaths_spread_wider_than_the_window_never_give_up():
    rec = Reconciler({"g": 1}, RestartIntensity(2, 10.0))
    epoch = 1
    for i in range(20):  # a death every 6 s: at most 2 in any 10 s
        now = 6.0 * i
        rec.observe(RankLost("g", epoch, "process died"), now)
        form = rec.actions(now)[-1]
        assert isinstance(form, Form), form
        epoch = form.epoch
        rec.observe(Formed("g", epoch), now + 1)
        rec.actions(now + 1)
    assert rec.settled and rec.total_restarts == 20


def test_bad_intensity_is_refused():
    with pytest.raises(ValueError, match="max_restarts"):
        RestartIntensity(-1)
    with pytest.raises(ValueError, match="window"):
        RestartIntensity(1, 0.0)
    with pytest.raises(ValueError, match="backoff"):
        RestartIntensity(1, 1.0, backoff_s=2.0, max_backoff_s=1.0)


def test_no_room_narrows_then_capacity_back_widens():
    rec = Reconciler({"decode": 1}, RestartIntensity(10, 60.0, backoff_s=0.0, max_backoff_s=0.0),
                     widths={"decode": (3, 1)}, widen_every_s=5.0)
    rec.observe(RankLost("decode", 1, "node left"), 0.0)
    assert [a.width for a in rec.actions(0.0) if isinstance(a, Form)] == [3]
    rec.observe(FormFailed("decode", 2, "placement not ready", short=True), 1.0)
    assert [a.width for a in rec.actions(1.0) if isinstance(a, Form)] == [2]
    rec.observe(FormFailed("decode", 3, "placement not ready", short=True), 2.0)
    assert [a.width for a in rec.actions(2.0) if isinstance(a, Form)] == [1]
    rec.observe(FormFailed("decode", 4, "placement not ready", short=True), 3.0)
    assert [a.width for a in rec.actions(3.0) if isinstance(a, Form)] == [1]  # the floor
    rec.observe(Formed("decode", 5), 4.0)
    rec.actions(4.0)
    assert rec.narrow() == {"decode": 2}
    assert rec.widen_due(4.0) == [] and rec.widen_due(9.0) == ["decode"]
    assert rec.widen_due(10.0) == []  # checked at most every widen_every_s
    assert not rec.observe(CapacityBack("decode", 4), 10.0)  # an old epoch's report
    assert rec.observe(CapacityBack("decode", 5), 10.0)
    acts = rec.actions(10.0)
    assert acts[0] == Fence("decode", 5, planned=True) and acts[1].width == 3 and "capacity back" in acts[1].why
    rec.observe(Formed("decode", 6), 11.0)
    rec.actions(11.0)
    assert rec.narrow() == {} and rec.widen_due(100.0) == [] and rec.settled


def test_bad_widths_are_refused():
    with pytest.raises(ValueError, match="min width"):
        Reconciler({"g": 1}, RestartIntensity(), widths={"g": (2, 3)})


def test_a_prefill_instance_without_room_is_parked_while_another_serves():
    pools = {("prefill", 0): "prefill", ("prefill", 1): "prefill"}
    rec = Reconciler({("prefill", 0): 1, ("prefill", 1): 1},
                     RestartIntensity(10, 60.0, backoff_s=0.0, max_backoff_s=0.0),
                     pools=pools, widen_every_s=1.0)
    rec.observe(RankLost(("prefill", 0), 1, "node left"), 0.0)
    form = rec.actions(0.0)[-1]
    rec.observe(FormFailed(("prefill", 0), form.epoch, "no room", short=True), 1.0)
    assert rec.actions(1.0) == [] and not rec.serving(("prefill", 0)) and rec.settled
    assert rec.narrow() == {("prefill", 0): 1}
    assert rec.widen_due(2.0) == [("prefill", 0)]
    assert rec.observe(CapacityBack(("prefill", 0), form.epoch), 2.0)
    acts = rec.actions(2.0)
    assert acts[0].planned and acts[1].width == 1
    rec.observe(Formed(("prefill", 0), acts[1].epoch), 3.0)
    rec.actions(3.0)
    assert rec.serving(("prefill", 0)) and rec.narrow() == {}
    # The last instance of its pool is never parked: it keeps trying (with backoff).
    rec.observe(RankLost(("prefill", 1), 1, "node left"), 4.0)
    rec.observe(RankLost(("prefill", 0), acts[1].epoch, "node left"), 4.0)
    forms = [a for a in rec.actions(4.0) if isinstance(a, Form)]
    rec.observe(FormFailed(("prefill", 0), forms[0].epoch, "no room", short=True), 5.0)
    rec.observe(FormFailed(("prefill", 1), forms[1].epoch, "no room", short=True), 5.0)
    phases = {k: g.phase for k, g in rec.groups.items()}
    assert Phase.PARKED not in phases.values(), phases


def test_a_layout_change_fences_every_changed_group_before_forming_and_is_not_a_recovery():
    rec = Reconciler({"g0": 1, "g1": 1}, RestartIntensity(1, 60.0, backoff_s=0.0, max_backoff_s=0.0),
                     widths={"g0": (2, 1), "g1": (2, 1)})
    assert rec.reshape({"g0": 4, "g1": 0}, 0.0) == ["g0", "g1"]
    acts = rec.actions(0.0)
    assert [type(a) for a in acts] == [Fence, Fence, Form]
    assert all(a.planned for a in acts) and acts[2].key == "g0" and acts[2].width == 4
    assert rec.groups["g1"].phase is Phase.RETIRED and not rec.serving("g1")
    rec.observe(Formed("g0", acts[2].epoch), 1.0)
    assert [type(a) for a in rec.actions(1.0)] == [Resume]
    assert rec.settled and rec.total_restarts == 0 and rec.reshapes == 1
    # And back: the retired group forms again; both are planned.
    rec.reshape({"g0": 2, "g1": 2}, 2.0)
    forms = [a for a in rec.actions(2.0) if isinstance(a, Form)]
    assert sorted((a.key, a.width, a.planned) for a in forms) == [("g0", 2, True), ("g1", 2, True)]
    # A death during a planned formation: the next formation is a recovery (counted).
    rec.observe(FormFailed("g1", forms[1].epoch, "ActorDiedError"), 3.0)
    again = [a for a in rec.actions(3.0) if isinstance(a, Form)]
    assert again[0].key == "g1" and not again[0].planned and rec.total_restarts == 1


def test_a_reshape_while_forming_applies_once_formed():
    rec = Reconciler({"g": 1}, RestartIntensity(5, 60.0, backoff_s=0.0, max_backoff_s=0.0),
                     widths={"g": (2, 1)})
    rec.observe(RankLost("g", 1, "process died"), 0.0)
    form = [a for a in rec.actions(0.0) if isinstance(a, Form)][0]
    assert rec.reshape({"g": 4}, 0.5) == ["g"]
    rec.observe(Formed("g", form.epoch), 1.0)
    acts = rec.actions(1.0)
    assert [type(a) for a in acts] == [Fence, Form] and acts[1].width == 4 and acts[1].planned
    with pytest.raises(ValueError, match="width"):
        rec.reshape({"g": -1})
