"""bench/probes/ucx_hops.py and bench/probes/ucx_posts.py on CPU, tiny sizes: each runs
its processes to the end (ucxx's notifier thread is stopped, so they exit), prints its
table without error rows and writes its JSON. A probe that cannot exit cost two device
calls before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "probes")
ENV = {**os.environ, "UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def _run(script: str, args: list[str], out: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(PROBES, script), *args, "--out", out],
                          capture_output=True, text=True, timeout=90, env=ENV, cwd=PROBES)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_ucx_hops_runs_to_the_end(tmp_path):
    stdout = _run("ucx_hops.py", ["--modes", "thread+fut,thread+spin", "--rounds", "5",
                                  "--burst", "4x1"], str(tmp_path))
    rows = json.loads((tmp_path / "ucx_hops.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["thread+fut", "thread+spin"]
    assert all("error" not in r and r["rtt_us"] > 0 and r["burst_4x1MiB_us"] > 0
               for r in rows), rows
    assert "| thread+spin |" in stdout


def test_ucx_posts_runs_to_the_end(tmp_path):
    stdout = _run("ucx_posts.py", ["--modes", "thread", "--count", "8", "--mib", "0.0625",
                                   "--reps", "2"], str(tmp_path))
    rows = json.loads((tmp_path / "ucx_posts.json").read_text())["rows"]
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    assert all(min(r["straight"], r["tasks"], r["straight_send"], r["tasks_send"]) > 0
               for r in rows), rows
    assert "| thread | True |" in stdout
