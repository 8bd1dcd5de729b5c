"""bench/serve.py: the load generator's figures from known timings, the multi-turn trace's
shape, and one small run end to end against `phalanx serve` (tiny model, CPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
import serve  # noqa: E402
import serve_load  # noqa: E402
from serve_load import Request, Result  # noqa: E402


def test_percentiles_interpolate_between_ranks():
    assert serve_load.percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert serve_load.percentile([5.0], 99) == 5.0
    assert serve_load.percentile(list(range(101)), 90) == pytest.approx(90.0)


def test_summary_from_known_timings():
    req = Request((1, 2, 3), 3)
    a = Result(req, sent=0.0, first=0.1, done=0.3, chunks=[0.1, 0.2, 0.3], output_tokens=3)
    b = Result(req, sent=1.0, first=1.3, done=1.5, chunks=[1.3, 1.4, 1.5], output_tokens=3)
    bad = Result(req, sent=0.0, error="HTTP 500: boom")
    s = serve_load.summarize([a, b, bad], wall_s=2.0)
    assert s["requests"] == 3 and s["errors"] == 1 and s["first_error"].startswith("HTTP 500")
    assert s["output_tok_s"] == pytest.approx(3.0)
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p50_ms"] == pytest.approx(100.0)
    assert s["e2e_p99_ms"] == pytest.approx(498.0)  # 300 + 0.99 x (500 - 300)


def test_the_trace_shares_system_prompts_and_chains_turns():
    convos = serve_load.multi_turn(conversations=4, turns=3, system_prompts=2, system_len=10,
                                   user_len=4, max_tokens=5, vocab=1000, seed=0)
    assert [len(c) for c in convos] == [3] * 4
    firsts = [c[0].prompt for c in convos]
    assert firsts[0][:10] == firsts[2][:10] != firsts[1][:10]  # conversation c: system c % 2
    assert all(len(p) == 14 for p in firsts)
    assert all(c[1].prompt == () and c[0].follow_up and len(c[0].follow_up) == 4 for c in convos)
    assert all(c[-1].follow_up is None for c in convos)
    assert all(16 <= t < 1000 - 16 for p in firsts for t in p)


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert serve.main(["--model", tiny_model, "--concurrency", "1,2", "--rates", "8",
                       "--prompt-len", "40", "--max-tokens", "6", "--conversations", "2",
                       "--turns", "2", "--requests", "4"]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    runs = result["runs"]
    summaries = [runs["cold"], runs["trace"], *runs["open"]]
    summaries += [r[k] for r in runs["closed"] for k in ("miss", "hit")]
    assert all(s["errors"] == 0 and s["output_tok_s"] > 0 for s in summaries)
    assert runs["closed"][0]["hit"]["requests"] == 4
    assert runs["trace"]["cached_tokens"] > 0  # later turns hit the earlier turns' pages
    assert set(result["engine"]) == {"1", "2"}
    assert all(e["step_ms"] > 0 and e["prefill_ms"] > 0 for e in result["engine"].values())
    assert result["startup_s"] > 0
