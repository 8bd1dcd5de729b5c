"""bench/router_http.py: the text codec, the simulated engine's cache and its eviction
log, and (slow) the whole bench over real HTTP with a tiny load, SMG left out."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
import router_http  # noqa: E402
from router_http_engine import EngineConfig, PrefixCache, SimEngine  # noqa: E402
from router_http_load import LoadResult, Outcome  # noqa: E402
from router_http_report import add_common_hits, run_row, summarize  # noqa: E402
from router_http_text import CHARS_PER_TOKEN, decode, encode  # noqa: E402

from phalanx.router.prefix_tree import page_hashes  # noqa: E402


def test_routers_spec_splits_outside_json_configs():
    spec = 'smg,prefix_aware,ws=prefix_aware:{"a": 1, "b": [2, 3]},round_robin'
    got = router_http.parse_routers(spec, smg_available=False)
    assert got == [("phalanx prefix_aware", "prefix_aware", None),
                   ("phalanx ws", "prefix_aware", {"a": 1, "b": [2, 3]}),
                   ("phalanx round_robin", "round_robin", None)]


def test_text_codec_keeps_token_prefixes_as_character_prefixes():
    a, b = [7, 31999, 0, 42], [7, 31999, 5]
    assert decode(encode(a)) == a
    ea, eb = encode(a), encode(b)
    common = os.path.commonprefix([ea, eb])
    assert len(common) // CHARS_PER_TOKEN == 2  # the shared tokens, and no more
    with pytest.raises(ValueError, match="not whole tokens"):
        decode(ea[:-1])


def test_prefix_cache_evicts_lru_leaves_and_logs_them():
    cache = PrefixCache(capacity_pages=4)
    x, y = page_hashes(list(range(48)), 16), page_hashes(list(range(100, 132)), 16)
    cache.insert(x)
    cache.insert(y)  # 5 pages for 4: the least recent leaf of x goes
    assert cache.match_pages(x) == 2 and cache.match_pages(y) == 2
    assert cache.evictions == 1 and cache.evicted_since(0) == [x[2]]
    assert cache.evicted_since(1) == [] and cache.evicted_since(5) is None
    assert set(cache.held()) == {x[0], x[1], *y}


def test_engine_counts_hits_when_the_prefill_starts():
    async def go():
        e = SimEngine(EngineConfig(slots=2, capacity_pages=64, prefill_fixed_s=0.0,
                                   prefill_s_per_token=0.0, decode_s_per_token=0.0))
        firsts = []

        async def first(tok, cached):
            firsts.append(cached)
        prompt = list(range(40))
        answer, cached = await e.generate(prompt, 8, first)
        again, cached2 = await e.generate(prompt + answer + [1, 2], 4, first)
        return e, answer, cached, cached2, firsts
    e, answer, cached, cached2, firsts = asyncio.run(go())
    assert cached == 0 and len(answer) == 8 and firsts == [0, cached2]
    assert cached2 == 48  # prompt + answer (48 tokens) cached: 3 full pages
    assert (e.counters.requests, e.counters.prompt_tokens, e.counters.hit_tokens) == \
        (2, 40 + 50, 48)
    assert e.num_waiting == e.num_running == 0


def test_engine_counts_its_prefill_lane_busy_time():
    async def go():
        e = SimEngine(EngineConfig(slots=1, capacity_pages=64, prefill_fixed_s=0.001,
                                   prefill_s_per_token=1e-5, decode_s_per_token=0.0))

        async def first(tok, cached):
            return None
        await e.generate(list(range(40)), 2, first)
        return e
    e = asyncio.run(go())
    assert e.counters.prefill_busy_s == pytest.approx(0.001 + 40 * 1e-5)


def test_run_row_reports_prefill_busy_share_and_evictions():
    result = LoadResult([Outcome(0, 0, 0.0, 0.5, 100, 50, True, "w0"),
                         Outcome(0, 1, 1.0, 0.7, 200, 150, True, "w1")], wall_s=10.0)
    truths = [dict(requests=1, prompt_tokens=100, hit_tokens=50, prefill_busy_s=2.0,
                   evictions=3),
              dict(requests=1, prompt_tokens=200, hit_tokens=150, prefill_busy_s=4.0,
                   evictions=0)]
    row = run_row("r", "light", 8.0, 0, result, truths, None)
    assert row["hit_rate"] == pytest.approx(200 / 300)
    assert row["prefill_busy"] == pytest.approx(6.0 / (2 * 10.0))
    assert row["evicted_pages"] == 3 and row["busiest_share"] == 0.5


def test_hit_rate_over_the_turns_both_routers_answered():
    """A turn counts only where SMG of the same (load, run) answered it too; SMG's own
    rate over the same turns sits beside it."""
    mine = [Outcome(0, 0, 0.0, 0.1, 100, 80, True), Outcome(0, 1, 0.0, 0.1, 300, 60, True),
            Outcome(1, 0, 0.0, 0.1, 100, 10, False)]
    smg = [Outcome(0, 0, 0.0, 0.1, 100, 20, True), Outcome(1, 0, 0.0, 0.1, 100, 90, True)]
    rows = [dict(router="phalanx x", load="l", run=0, rate=1.0, requests=2, failed=1,
                 hit_rate=140 / 400, p99_s=1.0, p50_s=0.5, throughput=1.0, busiest_share=0.5),
            dict(router="smg cache_aware", load="l", run=0, rate=1.0, requests=2, failed=0,
                 hit_rate=110 / 200, p99_s=2.0, p50_s=0.5, throughput=1.0, busiest_share=0.5)]
    add_common_hits(rows, {("l", 0, "phalanx x"): mine, ("l", 0, "smg cache_aware"): smg})
    assert rows[0]["common_turns"] == 1  # (0, 0): answered by both
    assert rows[0]["hit_common"] == 0.8 and rows[0]["smg_hit_common"] == 0.2
    summary = {s["router"]: s for s in summarize(rows)}
    assert summary["phalanx x"]["runs_beating_smg_hit_common"] == 1
    assert summary["phalanx x"]["runs_beating_smg_hit"] == 0  # the plain rate says otherwise


@pytest.mark.slow
def test_bench_end_to_end_over_http(tmp_path):
    out = tmp_path / "r.json"
    router_http.main(["--loads", "tiny=6", "--duration", "6", "--runs", "1",
                      "--routers", 'prefix_aware,round_robin,'
                      'hold=prefix_aware:{"admission":{"max_requests":1}}', "--think", "0.1,0.3",
                      "--prefill-s-per-token", "200e-6", "--decode-s-per-token", "0.2e-3",
                      "--base-port", "23000", "--json", str(out), "--outcomes"])
    data = json.loads(out.read_text())
    rows = {r["router"]: r for r in data["rows"]}
    pa, rr = rows["phalanx prefix_aware"], rows["phalanx round_robin"]
    for r in (pa, rr):
        assert r["failed"] == 0 and r["requests"] > 10
        assert sum(r["worker_requests"]) == r["requests"]  # each answered request prefilled once
        assert 0 < r["p50_s"] <= r["p99_s"]
    hold = rows["phalanx hold"]  # requests waited at the router (admission), none lost
    assert hold["failed"] == 0 and sum(hold["worker_requests"]) == hold["requests"] > 10
    assert hold["held_pick_mean_ms"] > 0 and hold["held_wait_mean_s"] > 0
    assert pa["hit_rate"] > rr["hit_rate"]  # later turns find their conversation
    assert pa["hit_vs_rr"] == pytest.approx(pa["hit_rate"] / rr["hit_rate"])
    assert (tmp_path / "r.png").stat().st_size > 0
    assert 0 < pa["prefill_busy"] < 1
    served = json.loads((tmp_path / "r_logs" / "outcomes-tiny-0-phalanx_prefix_aware.json")
                        .read_text())
    assert len(served) == pa["requests"] and {o["worker"] for o in served} <= {"w0", "w1",
                                                                               "w2", "w3"}
