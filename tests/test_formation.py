"""`Formation` over real Ray calls: advanced a step at a time without blocking, or run to
the end; a failed call ends it at once, a step past its timeout raises the step's error,
and the steps' `finally` runs either way."""

from __future__ import annotations

import time

import pytest
import ray

from phalanx.actors.formation import Formation, Wait

pytestmark = pytest.mark.usefixtures("local_ray")


@ray.remote
def _after(value, seconds: float):
    time.sleep(seconds)
    return value


@ray.remote
def _fails(seconds: float):
    time.sleep(seconds)
    raise RuntimeError("rank load failed")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _steps(log: list, first, second, timeout_s: float = 60.0):
    try:
        a = yield Wait(first, timeout_s)
        log.append(("first", a))
        b = yield Wait(second(a), timeout_s, lambda: TimeoutError("second step expired"))
        log.append(("second", b))
    finally:
        log.append("finally")


def _until_done(f: Formation, limit_s: float = 30.0) -> int:
    """Advances until formed; how many calls said "not yet"."""
    end, waits = time.monotonic() + limit_s, 0
    while not f.advance():
        waits += 1
        assert time.monotonic() < end, "the formation never finished"
        time.sleep(0.02)
    return waits


def test_advance_takes_each_step_without_blocking():
    log: list = []
    f = Formation(_steps(log, [_after.remote(1, 0.3), _after.remote(2, 0.1)],
                         lambda a: [_after.remote(sum(a), 0.3)]))
    t0 = time.monotonic()
    assert f.advance() is False and time.monotonic() - t0 < 0.2  # nothing answered yet
    assert _until_done(f) > 0
    assert f.done and log == [("first", [1, 2]), ("second", [3]), "finally"]
    assert f.advance() is True


def test_run_blocks_to_the_end():
    log: list = []
    Formation(_steps(log, [_after.remote("x", 0.1)], lambda a: [_after.remote(a[0] * 2, 0.1)])).run()
    assert log == [("first", ["x"]), ("second", ["xx"]), "finally"]


@pytest.mark.parametrize("driver", ["advance", "run"])
def test_a_failed_call_ends_it_without_waiting_for_its_peers(driver):
    log: list = []
    f = Formation(_steps(log, [_after.remote(1, 30.0), _fails.remote(0.1)], lambda a: []))
    t0 = time.monotonic()
    with pytest.raises(Exception, match="rank load failed"):
        _until_done(f) if driver == "advance" else f.run()
    assert time.monotonic() - t0 < 10.0  # not the 30 s peer
    assert f.done and log == ["finally"]


def test_a_step_past_its_timeout_raises_its_error():
    clock, log = Clock(), []
    f = Formation(_steps(log, [_after.remote(1, 0.0)], lambda a: [_after.remote(0, 60.0)],
                         timeout_s=5.0), clock=clock)
    _wait_for(lambda: ray.wait(f._wait.refs, timeout=0)[0])  # the first step's call answered
    assert f.advance() is False  # now on the second step, whose call sleeps
    clock.t = 4.9
    assert f.advance() is False
    clock.t = 5.1
    with pytest.raises(TimeoutError, match="second step expired"):
        f.advance()
    assert log == [("first", [1]), "finally"]


def test_run_raises_the_step_error_on_timeout():
    log: list = []
    f = Formation(_steps(log, [_after.remote(1, 5.0)], lambda a: [], timeout_s=0.2))
    with pytest.raises(Exception) as e:
        f.run()
    assert "0.2 s" in str(e.value) and log == ["finally"]


def _wait_for(cond, limit_s: float = 10.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.01)
