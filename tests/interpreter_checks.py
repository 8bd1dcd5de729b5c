"""Running a test module's checks under Triton's interpreter, in a subprocess (Triton
reads TRITON_INTERPRET when first imported, so the pytest process, which may have
imported it already, cannot switch): the module, run as a script, prints one line
``RESULTS {json}`` with each check's result; the pytest side reads it once per module.

The interpreter runs on one core, so the pytest side starts one script per core (up to
`MAX_WORKERS`) over a shared claims folder (``--claims DIR``): each script runs the checks
it claims first (a file created exclusively per check) and the results are merged. The
scripts start in the background once collection is done (`background_jobs`), so they
run on the cores the tests before them leave idle."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable

import pytest

import background_jobs


def checks_in(namespace: dict) -> list[str]:
    """The module's checks: its callables named ``check_*``, sorted."""
    return sorted(n for n, fn in namespace.items() if n.startswith("check_") and callable(fn))


MAX_WORKERS = 4


def _claimed(name: str) -> bool:
    """Whether this script runs check `name`: always alone; with ``--claims DIR``, when it
    is the first to create ``DIR/name``."""
    if "--claims" not in sys.argv:
        return True
    folder = sys.argv[sys.argv.index("--claims") + 1]
    try:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_checks(namespace: dict, call: Callable[[str, Callable], dict] = lambda n, fn: fn()
               ) -> dict:
    """Each claimed check's result (``call(name, fn)``), or ``{"error": traceback}``."""
    results = {}
    for name in checks_in(namespace):
        if not _claimed(name):
            continue
        try:
            results[name] = call(name, namespace[name])
        except Exception:  # reported per check by the pytest side
            results[name] = {"error": traceback.format_exc()}
    return results


def print_results(results: dict) -> None:
    """The script side: refuse to run outside the interpreter, print the results."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    print("RESULTS " + json.dumps(results))


def seeded(name: str, fn: Callable) -> dict:
    """A kernel check's relative error (``fn(generator)``), the generator seeded by the
    check's name: each check draws the same fresh inputs on every run and machine."""
    import torch

    return {"err": fn(torch.Generator().manual_seed(zlib.crc32(name.encode())))}


def run_kernel_checks(namespace: dict) -> None:
    """The script side of a kernel-check module: its ``check_*(generator)`` functions on
    the Triton path (`seeded`), results printed; exits."""
    import interpreter_dot
    from phalanx.kernels.backend import force_triton

    interpreter_dot.install()
    force_triton(True)
    print_results(run_checks(namespace, seeded))
    sys.exit(0)


def results_fixture(path: str):
    """A module-scoped fixture ``interpreter_results``: the module at `path` run once
    under the interpreter (`run_module`), in the background ahead of the module's tests
    (`background_jobs`)."""
    if importlib.util.find_spec("triton") is not None:
        background_jobs.ahead(path, path, _launcher(path, None))

    @pytest.fixture(scope="module", name="interpreter_results")
    def interpreter_results() -> dict:
        return run_module(path)

    return interpreter_results


def assert_within(results: dict, name: str, tol: float) -> None:
    """The pytest side of one kernel check: it ran, and its relative error is below `tol`."""
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["err"] < tol, f"{name}: relative error {res['err']:.3e}"


def _workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, cores or 1))


def _launcher(path: str, workers: int | None) -> background_jobs.Launcher:
    """Launches the module at `path` under the interpreter: `workers` scripts (default one
    per core) over a claims folder in the job's own folder."""

    def launch_checks(background: bool) -> background_jobs.Job:
        def commands(folder: str) -> list[list[str]]:
            claims = os.path.join(folder, "claims")
            os.mkdir(claims)
            return [[sys.executable, path, "--claims", claims]] * (workers or _workers())

        return background_jobs.launch(commands, background=background,
                                      env=dict(os.environ, TRITON_INTERPRET="1"))

    return launch_checks


def _merged_results(job: background_jobs.Job, timeout_s: float) -> dict:
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    for i, proc in enumerate(job.procs):
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        text, err = job.output(i)
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULTS ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(f"check script failed (rc {proc.returncode}):\n{text[-4000:]}\n{err[-4000:]}")
        results.update(json.loads(lines[-1][len("RESULTS "):]))
    return results


def run_module(path: str, timeout_s: float = 600, workers: int | None = None) -> dict:
    """The pytest side: the merged results of the module at `path` run under the
    interpreter, taken from the background run `results_fixture` registered when there
    is one, else run now. Checks that time their own waits pass ``workers=1`` (and are
    never run in the background)."""
    pytest.importorskip("triton")
    job = background_jobs.take(path) or _launcher(path, workers)(False)
    try:
        return _merged_results(job, timeout_s)
    finally:
        job.close()


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float64 (inf if out is not finite); shapes and
    dtypes must match."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    out, ref = out.double(), ref.double()
    if not out.isfinite().all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_test(namespace: dict, tol: float):
    """The pytest side of a kernel-check module: one test per check (parametrized by
    name) that it ran and its relative error is below `tol`; it takes the module's
    `interpreter_results` fixture (`results_fixture`)."""

    @pytest.mark.parametrize("name", checks_in(namespace))
    def test_kernel_matches_reference(interpreter_results, name):
        assert_within(interpreter_results, name, tol)

    return test_kernel_matches_reference
