"""The decode step's Triton kernels compiled for sm_90 on this CPU machine
(`bench/offline_sm90.py` through `bench/probes/kernel_resources.py`): at their default tiles
none spills or asks for more shared memory than a Hopper block may have, every pipelined
loop keeps copies in flight, and page ids a tile ahead let decode attention's loop and
prefill attention's prefix loop keep the next tile's K/V in flight (the inline page
lookup does not).

The probe runs in a subprocess (the stand-in driver is process-wide state, and Triton's
interpreter, which other tests use, must not be on), started in the background ahead of
this module's tests (`background_jobs`).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import background_jobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM90_SHARED = 232448


def _launch_probe(background: bool) -> background_jobs.Job:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def commands(folder: str) -> list[list[str]]:
        env["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")  # compile for real, not from a cache
        return [[sys.executable, os.path.join(ROOT, "bench", "probes", "kernel_resources.py"),
                 "--batches", "1,64", "--out", os.path.join(folder, "kernel_resources.json")]]

    return background_jobs.launch(commands, background=background, env=env)


background_jobs.ahead(__file__, __file__, _launch_probe)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    job = background_jobs.take(__file__) or _launch_probe(False)
    try:
        job.wait(timeout_s=600)
        assert job.procs[0].returncode == 0, job.output(0)[1][-3000:]
        with open(os.path.join(job.folder, "kernel_resources.json")) as f:
            return json.load(f)["rows"]
    finally:
        job.close()


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
