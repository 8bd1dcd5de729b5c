"""An aborted prefill attempt's cleanup (plain logic, no Ray): stages in order, each
issued only once every call of the one before has returned, or at its deadline when it
has one; a stage without a deadline waits for its calls however long they take."""

from phalanx.actors.abort_cleanup import AbortCleanup, Stage


class _Calls:
    """Handles are names; `finished` holds those whose call has returned."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        self.finished: set[str] = set()

    def stage(self, name: str, n: int, timeout_s=None) -> Stage:
        def issue() -> list:
            handles = [f"{name}{i}" for i in range(n)]
            self.issued += handles
            return handles
        return Stage(name, issue, timeout_s)

    def running(self, handles: list) -> list:
        return [h for h in handles if h not in self.finished]


def test_stages_follow_each_other_once_their_calls_return():
    calls, now = _Calls(), [0.0]
    cleanup = AbortCleanup("r", 3, [calls.stage("forget", 2, 5.0), calls.stage("gates", 2),
                                    calls.stage("pages", 1)], clock=lambda: now[0])
    assert calls.issued == ["forget0", "forget1"] and cleanup.stage.name == "forget"
    assert cleanup.advance(calls.running) == [] and not cleanup.done
    calls.finished |= {"forget0", "forget1"}
    ended = cleanup.advance(calls.running)
    assert ended == [("forget", ["forget0", "forget1"], False)]
    assert calls.issued[2:] == ["gates0", "gates1"] and cleanup.stage.name == "gates"
    now[0] = 1e9  # a stage without a deadline never gives up on its calls
    calls.finished.add("gates0")
    assert cleanup.advance(calls.running) == [] and "pages0" not in calls.issued
    calls.finished |= {"gates1", "pages0"}  # the gates' calls return, then the last stage's
    ended = cleanup.advance(calls.running)
    assert [e[0] for e in ended] == ["gates", "pages"] and cleanup.done
    assert cleanup.advance(calls.running) == []


def test_a_stage_with_a_deadline_is_left_behind_when_it_passes():
    calls, now = _Calls(), [10.0]
    cleanup = AbortCleanup("r", 0, [calls.stage("forget", 2, 5.0), calls.stage("gates", 1)],
                           clock=lambda: now[0])
    calls.finished.add("forget0")
    now[0] = 14.9
    assert cleanup.advance(calls.running) == []
    now[0] = 15.0
    assert cleanup.advance(calls.running) == [("forget", ["forget0", "forget1"], True)]
    assert cleanup.stage.name == "gates" and calls.issued[-1] == "gates0"
