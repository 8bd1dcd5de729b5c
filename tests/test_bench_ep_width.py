"""bench/ep_width.py's pure parts: the simulation (bench/ep_width_sim.py) writes its JSON with a pick
that fits memory at every load (DeepSeek-V3 at EP8 does not hold 128 sequences per GPU,
as seed 001 says)."""

from __future__ import annotations

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # the bench modules import each other by plain name
import ep_width  # noqa: E402,F401  (imports cleanly)
import ep_width_sim  # noqa: E402


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
