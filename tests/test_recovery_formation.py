"""`Recovery` carries out a formation without blocking (no Ray: groups stand in for
`GroupSupervisor`): `reconcile` begins it and returns while the other groups serve, a
later `reconcile` reports it formed and resumes the group; a formation that fails is
fenced and formed again under the next epoch after its backoff; a group retired while
forming is fenced once formed and never resumed."""

from __future__ import annotations

from phalanx.actors.reconciler import RestartIntensity
from phalanx.actors.recovery import Recovery


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Group:
    """A supervisor's formation interface: `steps` answers of "not yet" before formed;
    `fail` raises from the formation instead."""

    def __init__(self, steps: int = 2) -> None:
        self.epoch, self.dp, self.steps = 1, 1, steps
        self.fail: Exception | None = None
        self.forming = False
        self.began: list[int] = []
        self.shutdowns = 0
        self.actors: list = []  # nothing to name deaths of at a fence
        self._left = 0

    def deaths(self, timeout_s: float = 0.0) -> list:
        return []

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.forming = False

    def begin_form(self, min_epoch: int = 0, dp=None, placement_timeout_s: float = 0.0) -> None:
        self.epoch = max(self.epoch, min_epoch - 1) + 1
        self.began.append(self.epoch)
        self.forming, self._left = True, self.steps

    def advance_form(self) -> bool:
        assert self.forming, "advanced a formation that is not under way"
        if self.fail is not None:
            error, self.fail = self.fail, None
            self.shutdown()
            raise error
        if self._left:
            self._left -= 1
            return False
        self.forming = False
        return True


def _recovery(groups: dict, clock: Clock, events: list) -> Recovery:
    return Recovery(groups, RestartIntensity(max_restarts=10, window_s=60.0, backoff_s=1.0),
                    on_fence=lambda k: events.append(("fence", k)),
                    on_resume=lambda k: events.append(("resume", k)), clock=clock)


def test_reconcile_returns_while_a_group_forms_and_resumes_it_later():
    clock, events = Clock(), []
    g0, g1 = Group(), Group(steps=2)
    rec = _recovery({"g0": g0, "g1": g1}, clock, events)
    rec.lost("g1", 1, "rank 0: process died")
    rec.reconcile()
    assert events == [("fence", "g1")] and g1.began == [2] and g1.forming
    assert rec.serving("g0") and not rec.serving("g1")  # g0 serves meanwhile
    rec.reconcile()
    rec.reconcile()
    assert not rec.serving("g1") and events == [("fence", "g1")]
    rec.reconcile()  # the third answer: formed
    assert rec.serving("g1") and events == [("fence", "g1"), ("resume", "g1")]
    assert rec.formed == {"g0": 0, "g1": 1}


def test_a_failed_formation_is_formed_again_under_the_next_epoch():
    clock, events = Clock(), []
    g = Group(steps=0)
    rec = _recovery({"g": g}, clock, events)
    rec.lost("g", 1, "rank 0: process died")
    rec.reconcile()
    g.fail = RuntimeError("rank 1 died while loading")
    rec.reconcile()  # the failure is the next event; the retry waits for its backoff
    assert g.began == [2] and not rec.serving("g") and not g.forming
    clock.t = 5.0
    rec.reconcile()
    assert g.began == [2, 3]
    rec.reconcile()
    # the failed epoch is fenced too (its requests stay held), then the next one resumes
    assert rec.serving("g") and events == [("fence", "g"), ("fence", "g"), ("resume", "g")]
    assert any(e[1] == "form_failed" for e in rec.events)


def test_a_group_retired_while_forming_is_fenced_once_formed_and_never_resumed():
    clock, events = Clock(), []
    g0, g = Group(), Group(steps=2)
    rec = _recovery({"g0": g0, "g": g}, clock, events)
    rec.lost("g", 1, "rank 0: process died")
    rec.reconcile()
    assert g.forming
    rec.reshape({"g0": 1, "g": 0})
    for _ in range(4):
        rec.reconcile()
    assert not rec.serving("g") and not g.forming and rec.serving("g0")
    assert events == [("fence", "g"), ("fence", "g")]  # never resumed
