"""bench/kv_transfer.py on CPU at a tiny size (64 tokens, one repetition, one and two
senders): every mode runs to the end, the request's slots then hold what the senders'
hold (`intact`), and the JSON holds each mode's best and median against raw's; the
early-posted spans baseline runs where it applies (one sender, consecutive pages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_kv_transfer_bench_runs_every_mode_intact(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "kv_transfer.py"),
                           "--layouts", "1-1,2-1", "--tokens", "64", "--pages", "runs",
                           "--reps", "1"], capture_output=True, text=True, timeout=240,
                          env=env, cwd=BENCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "kv_transfer.json").read_text())["rows"]
    modes = {(r["layout"], r["what"]) for r in rows}
    for layout in ("tp1->tp1", "tp2->tp1"):
        assert {(layout, w) for w in ("raw", "whole", "whole_prepared", "pipelined")} <= modes
    assert ("tp1->tp1", "raw_spans_early") in modes and ("tp2->tp1", "raw_spans") not in modes
    assert all(r["intact"] for r in rows), [r for r in rows if not r["intact"]]
    assert all(0 < r["seconds"] <= r["median_seconds"] and r["of_raw_median"] > 0
               for r in rows), rows
    assert "| tp1->tp1 | runs | 64 | True | raw_spans_early |" in proc.stdout
