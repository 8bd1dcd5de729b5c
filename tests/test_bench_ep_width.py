"""bench/ep_width.py's pure parts: tables fitted from step measurements reproduce the
fitted points, and the simulation (bench/ep_width_sim.py) writes its JSON with a pick
that fits memory at every load (DeepSeek-V3 at EP8 does not hold 128 sequences per GPU,
as seed 001 says)."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # the bench modules import each other by plain name
import ep_width  # noqa: E402
import ep_width_sim  # noqa: E402

from phalanx.policies.ep_cost import Grid, ModelNumbers  # noqa: E402


def test_fitted_tables_reproduce_the_fitted_steps():
    model = ModelNumbers(64, 8, 3, 1 << 20, 1 << 24, 4096)
    experts = Grid((0.0, 64.0), (0.0, 4096.0), ((0.0, 0.0), (6400.0, 6400.0)))
    steps = {(w, b): 10.0 + 0.5 * b + (2.0 * w if w > 1 else 0.0)
             for w in (1, 2, 4) for b in (1, 16)}
    tables = ep_width.fit_tables(steps, experts, model, [1, 16], 100.0)
    for (w, b), ms in steps.items():
        assert tables.step_us(model, w, b, 100.0) / 1e3 == pytest.approx(ms, rel=1e-6)


def test_simulation_picks_fit_and_are_written(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert ep_width_sim.main() == 0
    results = json.loads((tmp_path / "ep_width_sim.json").read_text())
    assert [r["model"] for r in results] == ["qwen3-30b-a3b", "deepseek-v3"]
    for r in results:
        for row in r["rows"]:
            tps, _ = row["per_width"][str(row["chosen_width"])]
            assert tps is not None, (r["model"], row)
    deepseek = {row["batch"]: row for row in results[1]["rows"]}
    assert deepseek[128]["per_width"]["8"] == [None, None]
