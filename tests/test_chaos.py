"""bench/chaos.py as a test: a colocated DP×EP group (its MoE exchange over gloo, or
through shared memory with the waits in Triton kernels) and the disaggregated layout each
lose a rank twice in a row (the second fault is armed on the re-formed group) while
serving; every request, greedy or seeded-sampled, completes with the single-rank
engine's tokens, each token once."""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest

from phalanx.models.loader import read_model_config

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
_spec = importlib.util.spec_from_file_location("chaos", os.path.join(BENCH, "chaos.py"))
chaos = importlib.util.module_from_spec(_spec)
sys.modules["chaos"] = chaos  # its dataclasses resolve annotations through the module
_spec.loader.exec_module(chaos)


@pytest.fixture(scope="module", autouse=True)
def _ray(local_ray):
    """Every test of this module runs on the module's local Ray (conftest)."""


@pytest.fixture(scope="module")
def workload(tiny_model):
    rng = random.Random(3)
    prompts = chaos.make_prompts(12, read_model_config(tiny_model).vocab_size, rng)
    params = chaos.make_params(12, 20, 0.5, rng)
    assert 0 < sum(not p.greedy for p in params) < 12  # both kinds
    return prompts, params, chaos.oracle(tiny_model, prompts, params)


@pytest.mark.parametrize("layout", ["dp2", "dp2-peer", "disagg"])
def test_two_faults_in_a_row_lose_and_change_nothing(tiny_model, workload, layout):
    prompts, params, expected = workload
    r = chaos.drill(tiny_model, layout, 2, prompts, expected, params, seed=1, deadline_s=5.0)
    assert r.faults_armed == 2 and r.recoveries >= 1, r
    assert r.identical == r.requests and r.index_errors == 0, r
    assert r.tokens == sum(len(e) for e in expected)
