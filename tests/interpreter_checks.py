"""Running a test module's checks under Triton's interpreter, in a subprocess (Triton
reads TRITON_INTERPRET when first imported, so the pytest process, which may have
imported it already, cannot switch): the module, run as a script, prints one line
``RESULTS {json}`` with each check's result; the pytest side reads it once per module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import zlib
from collections.abc import Callable

import pytest


def checks_in(namespace: dict) -> list[str]:
    """The module's checks: its callables named ``check_*``, sorted."""
    return sorted(n for n, fn in namespace.items() if n.startswith("check_") and callable(fn))


def run_checks(namespace: dict, call: Callable[[str, Callable], dict] = lambda n, fn: fn()
               ) -> dict:
    """Each check's result (``call(name, fn)``), or ``{"error": traceback}``."""
    results = {}
    for name in checks_in(namespace):
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
    from phalanx.kernels.backend import force_triton

    force_triton(True)
    print_results(run_checks(namespace, seeded))
    sys.exit(0)


def results_fixture(path: str):
    """A module-scoped fixture ``interpreter_results``: the module at `path` run once
    under the interpreter (`run_module`)."""

    @pytest.fixture(scope="module", name="interpreter_results")
    def interpreter_results() -> dict:
        return run_module(path)

    return interpreter_results


def assert_within(results: dict, name: str, tol: float) -> None:
    """The pytest side of one kernel check: it ran, and its relative error is below `tol`."""
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["err"] < tol, f"{name}: relative error {res['err']:.3e}"


def run_module(path: str, timeout_s: float = 600) -> dict:
    """The pytest side: run the module at `path` under the interpreter; its results."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"check script failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


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
