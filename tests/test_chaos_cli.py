"""`phalanx chaos` as a user runs it: a 60-second drill per layout (the disaggregated
layout with every fault kind that reaches it from outside, the server started by the tool
as a process of its own; a colocated DP×EP group served by `phalanx serve --address` on a
three-node Ray cluster, with a node removed among its faults), faults from this machine's
outside view of it (Ray's state, signals, named actors). Every stream must pass the
check against the reference pass; the report holds every fault and a timeline. And
bench/chaos.py (fault points again and again, a kill during each re-formation) on the
peer exchange's DP×EP group, whose survivors learn of a death only at the deadline.

The workload seeds (3 for the disaggregated drill, 2 for the three-node one): with the
counter-hash sampler, seed 1's request 5 has a near-tie at its token 28 that flips with
the batch it shares (the forward's float sums change with the batch's shape, e.g. the
experts' GEMMs over every DP rank's tokens): it changed in 2 of the 5 disaggregated
drills whose reports were read and twice in the one three-node drill (once before any
fault), never in offline runs. Sampled tokens are exact only as far as the logits
are; since then the CPU forward is batch-invariant (kernels/invariant_linear.py, prefill
attention row by row as decode: tests/test_batch_invariance.py)."""

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
}
# The colocated DP×EP group's drill runs against a server of a three-node cluster, so that
# removing a node is among its faults (the last test below).
DP2_FAULTS = ["remove-node:at=8s", "kill-rank:at=22s", "pause-rank:at=30s:for=2s",
              "kill-actor:at=40s", "fault-point:point=step:at=52s"]


@pytest.mark.parametrize("layout", sorted(DRILLS))
def test_a_60_second_drill_passes_with_every_fault_kind(tmp_path, layout):
    report = tmp_path / "report"
    cmd = [sys.executable, "-m", "phalanx.cli", "chaos", "--layout", layout, "--duration",
           "60", "--seed", "3", "--requests", "24", "--report", str(report)]
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
    assert bench_chaos.main(["--layouts", "dp2-peer", "--duration", "20", "--every", "5"]) == 0
    (row,) = json.loads((tmp_path / "chaos.json").read_text())["rows"]
    assert row["passed"] and row["faults"] >= 3 and row["recoveries_seen"] >= 1, row


def test_a_60_second_dp2_drill_with_a_node_removed_against_a_running_server(tmp_path):
    """The operator's form: a Ray cluster of three nodes on this machine (a head with no
    CPUs and two worker nodes of one CPU each, so each DP rank has a node of its own),
    `phalanx serve --tp 1 --dp 2 --address` on it, then `phalanx chaos --url --address`
    removing a worker node's raylet 8 s into the drill. The lost rank cannot be placed
    again: past --replace-timeout the DP group re-forms at width 1; the rank left is then
    killed, paused, killed by name and failed at a step, and every stream still passes."""
    import re
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    serve = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "serve", "--port", "0", "--tp", "1", "--dp", "2",
         "--address", cluster.address, "--max-num-seqs", "16", "--page-size", "4",
         "--num-pages", "1024", "--max-num-batched-tokens", "256", "--collective-timeout", "10",
         "--replace-timeout", "3", "--api-key", "K"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = next(m.group(1) for line in serve.stdout
                   if (m := re.search(r"serving \S+ at (http://\S+)", line)))
        report = tmp_path / "report"
        done = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "chaos", "--url", url, "--api-key", "K",
             "--address", cluster.address, "--duration", "60", "--seed", "2", "--requests", "24",
             "--report", str(report), *[a for f in DP2_FAULTS for a in ("--fault", f)]],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        body = json.loads((report / "report.json").read_text())
        summary = body["summary"]
        assert summary["passed"] and set(summary["verdicts"]) == {"ok"}, summary
        assert summary["fault_errors"] == 0, body["faults"]
        kinds = {f["spec"].split(":")[0] for f in body["faults"]}
        assert kinds == {f.split(":")[0] for f in DP2_FAULTS}, body["faults"]
        assert summary["recoveries_seen"] >= 1, body["marks"]
        assert summary["streams"] > 50 and not summary["service_gave_up"], summary
        widths = [m["note"] for m in body["marks"] if m["kind"] == "width"]
        assert "DP width 2 -> 1" in widths, body["marks"]
    finally:
        serve.terminate()
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            serve.kill()
        cluster.shutdown()
