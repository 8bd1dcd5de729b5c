"""`phalanx chaos` as a user runs it: a 60-second drill per layout (the disaggregated
layout with every fault kind that reaches it from outside, and a colocated DP×EP group),
the server started by the tool as a process of its own, faults from this machine's
outside view of it (Ray's state, signals, named actors). Every stream must pass the
check against the reference pass; the report holds every fault and a timeline. And
bench/chaos.py (fault points again and again, a kill during each re-formation) on the
peer exchange's DP×EP group, whose survivors learn of a death only at the deadline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

DRILLS = {
    "disagg": ["kill-rank:every=20s", "pause-rank:at=8s:for=3s", "kill-actor:at=30s",
               "fault-point:point=moe_dispatch:at=45s", "kv-delay:at=5s,35s:for=2s",
               "kv-drop:at=15s,50s", "kill-rank:at=recovery"],
    "dp2": ["kill-rank:at=12s,40s", "pause-rank:at=5s:for=2s", "kill-actor:at=25s",
            "fault-point:point=step:at=52s"],
}


@pytest.mark.parametrize("layout", sorted(DRILLS))
def test_a_60_second_drill_passes_with_every_fault_kind(tmp_path, layout):
    report = tmp_path / "report"
    cmd = [sys.executable, "-m", "phalanx.cli", "chaos", "--layout", layout, "--duration",
           "60", "--seed", "1", "--requests", "24", "--report", str(report)]
    cmd += [a for f in DRILLS[layout] for a in ("--fault", f)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    body = json.loads((report / "report.json").read_text())
    summary = body["summary"]
    assert summary["passed"] and set(summary["verdicts"]) == {"ok"}, summary
    assert summary["streams"] > 50 and summary["fault_errors"] == 0, summary
    kinds = {f["spec"].split(":")[0] for f in body["faults"]}
    assert kinds == {f.split(":")[0] for f in DRILLS[layout]}, body["faults"]
    assert summary["recoveries_seen"] >= 1, body["marks"]
    assert any(s["cut_off"] for s in body["streams"]), "some clients went away mid-stream"
    assert (report / "timeline.png").stat().st_size > 10_000
    assert "| verdict | PASS |" in done.stdout


def test_bench_chaos_drills_the_peer_exchange_group(tmp_path, monkeypatch):
    import os
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    monkeypatch.syspath_prepend(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    import chaos as bench_chaos  # bench/chaos.py (the package is phalanx.chaos)
    assert bench_chaos.main(["--layouts", "dp2-peer", "--duration", "30", "--every", "8"]) == 0
    (row,) = json.loads((tmp_path / "chaos.json").read_text())["rows"]
    assert row["passed"] and row["faults"] >= 3 and row["recoveries_seen"] >= 1, row
