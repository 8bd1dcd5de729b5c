"""The suite's background jobs (tests/background_jobs.py): a selected module's job runs
ahead at the lowest priority, in a session of its own; a job its fixture took first is
never launched twice; unselected modules' jobs never run; `stop` kills what still runs."""

from __future__ import annotations

import os
import sys
import time

from background_jobs import JobQueue, launch

# The child reports its nice value, whether it leads a session of its own, and whether it
# runs under SCHED_IDLE (None where the platform has no such policy); it waits first, as
# the launcher sets the priority just after the process starts.
PROBE = ("import os, time; time.sleep(0.5); idle = getattr(os, 'SCHED_IDLE', None); "
         "print(os.getpriority(os.PRIO_PROCESS, 0), os.getsid(0) == os.getpid(), "
         "None if idle is None else os.sched_getscheduler(0) == idle)")


def _probe(calls: list):
    def launcher(background: bool):
        calls.append(background)
        return launch(lambda folder: [[sys.executable, "-c", PROBE]], background=background)
    return launcher


def _report(job) -> list[str]:
    job.wait(timeout_s=60)
    try:
        assert job.procs[0].returncode == 0, job.output(0)[1]
        return job.output(0)[0].split()
    finally:
        job.close()


def test_a_selected_modules_job_runs_ahead_at_the_lowest_priority():
    queue, calls = JobQueue(), []
    queue.ahead("a", "mod_a.py", _probe(calls))
    assert queue.module_files() == {os.path.abspath("mod_a.py")}
    thread = queue.start(["mod_a.py"])
    thread.join(timeout=60)
    job = queue.take("a")
    assert calls == [True] and job is not None
    nice, own_session, idle = _report(job)
    assert int(nice) == 19 and own_session == "True" and idle in ("True", "None")
    assert queue.take("a") is None  # taken once


def test_the_fixture_runs_a_job_itself_at_normal_priority_when_it_comes_first():
    queue, calls = JobQueue(), []
    queue.ahead("b", "mod_b.py", _probe(calls))
    assert queue.take("b") is None  # the fixture came before the background: it runs the job
    foreground = _probe(calls)(False)
    thread = queue.start(["mod_b.py"])
    if thread is not None:
        thread.join(timeout=60)
    assert calls == [False]  # never launched a second time
    nice, own_session, _ = _report(foreground)
    assert int(nice) == os.getpriority(os.PRIO_PROCESS, 0) and own_session == "False"


def test_only_selected_modules_run_in_their_order_and_stop_kills_the_rest():
    queue, order = JobQueue(), []

    def sleeper(name: str, seconds: float):
        def launcher(background: bool):
            order.append(name)
            return launch(lambda folder: [[sys.executable, "-c", f"import time; time.sleep({seconds})"]],
                          background=background)
        return launcher

    queue.ahead("late", "mod_late.py", sleeper("late", 60))
    queue.ahead("first", "mod_first.py", sleeper("first", 0))
    queue.ahead("unselected", "mod_other.py", sleeper("unselected", 0))
    thread = queue.start(["mod_first.py", "mod_late.py"])
    deadline = time.monotonic() + 60
    while order != ["first", "late"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert order == ["first", "late"]
    late = queue.running["late"]
    queue.stop()
    thread.join(timeout=60)
    assert not thread.is_alive() and late.procs[0].returncode == -9
    assert not os.path.exists(late.folder)
    assert queue.take("first") is None  # stop closed the finished job too
