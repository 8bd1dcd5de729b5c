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
