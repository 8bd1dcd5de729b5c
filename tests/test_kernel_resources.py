"""The decode step's Triton kernels compiled for sm_90 on this CPU machine
(`bench/offline_sm90.py` through `bench/probes/kernel_resources.py`): at their default tiles
none spills or asks for more shared memory than a Hopper block may have, every pipelined
loop keeps copies in flight, and page ids a tile ahead let decode attention's loop and
prefill attention's prefix loop keep the next tile's K/V in flight (the inline page
lookup does not).

The probe runs in a subprocess: the stand-in driver is process-wide state, and Triton's
interpreter (other tests) must not be on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM90_SHARED = 232448


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sm90") / "kernel_resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out.parent / "triton")  # compile for real, not from a cache
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "probes", "kernel_resources.py"),
                           "--batches", "1,64", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_every_decode_kernel_compiles_for_sm90_without_spills(rows):
    cases = {r["case"] for r in rows}
    assert {"attention", "attention ahead", "attention wide tables", "experts bf16", "experts fp8", "qkv fp8", "o fp8"} <= cases
    for r in rows:
        assert r["regs"] > 0, r
        assert r["stack"] == 0, f"{r['case']}: {r['name']} spills ({r['stack']} bytes a thread)"
        assert r["shared"] <= SM90_SHARED and r["blocks_per_sm"] >= 1, r


def test_pipelined_loops_keep_copies_in_flight(rows):
    """A loop whose loads the pipeliner staged (cp.async) has a wait allowing copies in
    flight, except decode attention with its page ids loaded inline (the known case the
    prefetch answers)."""
    from phalanx.kernels.gpu.attention import PAGE_PREFETCH

    staged = [r for r in rows if r["cp_async"] > 0]
    assert {r["name"] for r in staged} >= {"_decode_split_kernel", "_fp8_gate_up_kernel", "_gate_up_kernel",
                                           "_small_gate_up_kernel", "_prefill_kernel"}
    for r in staged:
        if r["case"] in ("attention", "attention wide tables") and not PAGE_PREFETCH:
            assert max(r["waits"]) == 0, r  # the inline lookup: nothing in flight while it computes
        elif r["case"] == "prefill prefix":  # inline by construction (the probe's case)
            assert r["waits"][0] == 0 and max(r["waits"]) > 0, r  # the prefix loop waits; the others not
        else:
            assert max(r["waits"]) > 0, f"{r['case']}: {r['name']} waits for every copy: {r['waits']}"
    ahead = [r for r in staged if r["case"] == "attention ahead"]
    assert {r["batch"] for r in ahead} == {1, 64} and all(r["stages"] == 3 for r in ahead)
    prefix_ahead = [r for r in staged if r["case"] == "prefill ahead"]
    assert len(prefix_ahead) == 1 and prefix_ahead[0]["waits"][0] > 0, prefix_ahead
