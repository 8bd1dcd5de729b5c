"""Slow subprocess fixtures started ahead of their tests, on the CPU the rest of the suite
leaves idle.

A few module fixtures spend minutes in subprocesses whose results depend on nothing but
the checkout (the Triton interpreter's kernel checks, the offline sm_90 compiles, AIPerf's
venv). A module registers such a job at import (`ahead`); conftest puts those modules'
tests last, and once collection is done `start` runs the selected modules' jobs one after
another, in the order their tests come, on a thread of the pytest process, each job's
processes in a session of their own at the lowest priority (nice 19, SCHED_IDLE where
the kernel has it, the session's autogroup at nice 19), so that a test's own processes
(ranks with deadlines among them) keep their cores. The fixture then `take`s its job:
done or under way in the background, or, if not yet begun, launched by the fixture
itself at normal priority.

Invariant: a job is launched at most once; `take` never returns a job another caller
took; `stop` kills whatever is still running when the session ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Job", "JobQueue", "SESSION", "ahead", "launch", "start", "stop", "take"]


def _lowest_priority(pid: int) -> None:
    """Process `pid` (just started, in a session of its own, so in an autogroup of its
    own where the kernel makes them) and what it starts later at the lowest priority an
    unprivileged owner may give: best effort, each knob where the kernel has it."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write("19")
    except OSError:
        pass
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


@dataclass(slots=True)
class Job:
    """One or more processes launched together; their output goes to files in a folder of
    the job's own (no pipe can fill up and stall them). `wait` returns once every process
    has ended; `close` kills what still runs and removes the folder."""

    folder: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    outputs: list[tuple] = field(default_factory=list)  # (stdout file, stderr file) per proc

    def wait(self, timeout_s: float | None = None) -> None:
        for proc in self.procs:
            proc.wait(timeout=timeout_s)

    def output(self, i: int) -> tuple[str, str]:
        """Process `i`'s stdout and stderr text (read after `wait`)."""
        texts = []
        for f in self.outputs[i]:
            f.seek(0)
            texts.append(f.read())
        return texts[0], texts[1]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self.kill()
        for out, err in self.outputs:
            out.close()
            err.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def launch(commands: Callable[[str], Sequence[Sequence[str]]], *, background: bool,
           env: dict | None = None, cwd: str | None = None) -> Job:
    """Every command of `commands(folder)` (`folder`: the job's own, for files its
    processes share) as a process."""
    job = Job(tempfile.mkdtemp(prefix="phalanx-job-"))
    try:
        for i, cmd in enumerate(commands(job.folder)):
            out, err = (open(os.path.join(job.folder, f"{i}.{kind}"), "w+") for kind in ("out", "err"))
            job.outputs.append((out, err))
            proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=background)
            job.procs.append(proc)
            if background:
                _lowest_priority(proc.pid)
    except BaseException:
        job.close()
        raise
    return job


Launcher = Callable[[bool], Job]  # background? -> the launched job


class JobQueue:
    """Registered jobs and the thread that runs the selected ones (the session has one,
    `SESSION`; the module functions below are its methods)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registered: dict[str, tuple[str, Launcher]] = {}  # key -> (module file, launcher)
        self.pending: list[str] = []
        self.running: dict[str, Job] = {}
        self.claimed: set[str] = set()
        self.stopped = False

    def ahead(self, key: str, module_file: str, launcher: Launcher) -> None:
        """Registers `launcher` as the job `key` of the test module at `module_file`."""
        with self.lock:
            self.registered.setdefault(key, (os.path.abspath(module_file), launcher))

    def module_files(self) -> set[str]:
        """The files of the modules with a registered job."""
        with self.lock:
            return {f for f, _ in self.registered.values()}

    def start(self, module_files: Sequence[str]) -> threading.Thread | None:
        """Runs the jobs of the modules in `module_files` (the selected tests' distinct
        modules, in test order), one at a time, on a thread of their own."""
        order = {os.path.abspath(f): i for i, f in enumerate(module_files)}
        with self.lock:
            keys = [k for k, (f, _) in self.registered.items() if f in order]
            self.pending = sorted(keys, key=lambda k: order[self.registered[k][0]])
        if not keys:
            return None
        thread = threading.Thread(target=self._run, name="background-jobs", daemon=True)
        thread.start()
        return thread

    def take(self, key: str) -> Job | None:
        """The job `key` if the background has launched it (done or running; the caller
        waits and reads it, then closes it), else None: the caller runs the work itself."""
        with self.lock:
            self.claimed.add(key)
            return self.running.pop(key, None)

    def stop(self) -> None:
        """No more jobs start; those still running are killed."""
        with self.lock:
            self.stopped = True
            jobs, self.running = list(self.running.values()), {}
        for job in jobs:
            job.close()

    def _next(self) -> Job | None:
        with self.lock:
            while self.pending and not self.stopped:
                key = self.pending.pop(0)
                if key in self.claimed:
                    continue
                try:
                    job = self.registered[key][1](True)
                except BaseException:  # noqa: BLE001 - its fixture runs it and reports
                    continue
                self.running[key] = job
                return job
            return None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                job.wait()
            except Exception:  # noqa: BLE001 - killed by `stop`, or read by its fixture
                pass


SESSION = JobQueue()
ahead, start, take, stop = SESSION.ahead, SESSION.start, SESSION.take, SESSION.stop
