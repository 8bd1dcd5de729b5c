"""`/metrics` in vLLM's names (`phalanx:` for `vllm:`, the `model_name` label), so a vLLM
dashboard works after a prefix change: a served request moves the token counters, the
finish-reason counter and the request histograms; the backend's totals become counters
that never go back, also when a re-formed group's ranks count from 0 again."""

from __future__ import annotations

import aiohttp
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from phalanx.server import EngineBackend
from phalanx.server.metrics import ServerMetrics
from app_server import serving

MODEL = "tiny-metrics"
VLLM_FAMILIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                 "prefix_cache_queries", "prefix_cache_hits", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds")


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_backend_totals_are_counters_that_never_go_back():
    m = ServerMetrics("m")
    label = (("model_name", "m"),)
    for total in (10, 25, 4, 9):  # 4: the group re-formed, its ranks count from 0
        got = _samples(m.render({"prefix_query_tokens": total, "num_preemptions": 1}).decode())
    assert got[("phalanx:prefix_cache_queries_total", label)] == 25 + 9
    assert got[("phalanx:num_preemptions_total", label)] == 1


@pytest.fixture(scope="module")
def server(tiny_model):
    backend = EngineBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=8,
                                           num_pages=256)
    with serving(backend) as srv:
        yield srv


async def test_a_served_request_in_vllms_names(server):
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        for _ in range(2):  # the second finds the first one's prompt pages
            await c.completions.create(model=MODEL, prompt="alpha bravo charlie delta " * 8,
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            text = await r.text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"phalanx:" + n for n in VLLM_FAMILIES} <= names, sorted(names)
    got = _samples(text)
    label = (("model_name", MODEL),)
    assert got[("phalanx:request_success_total",
                (("finished_reason", "length"), ("model_name", MODEL)))] == 2
    assert got[("phalanx:generation_tokens_total", label)] == 10
    assert got[("phalanx:request_generation_tokens_count", label)] == 2
    assert got[("phalanx:request_generation_tokens_sum", label)] == 10
    assert got[("phalanx:request_decode_time_seconds_count", label)] == 2
    assert got[("phalanx:request_queue_time_seconds_count", label)] == 2
    assert got[("phalanx:request_prefill_time_seconds_count", label)] == 2
    assert got[("phalanx:request_prefill_time_seconds_sum", label)] > 0
    queries = got[("phalanx:prefix_cache_queries_total", label)]
    hits = got[("phalanx:prefix_cache_hits_total", label)]
    assert queries > 0 and 0 < hits <= queries
    assert got[("phalanx:num_requests_running", label)] == 0


def test_the_grafana_dashboard_reads_only_exported_metrics(tiny_model):
    """Every metric the repo's dashboard queries is one the server exports."""
    import json
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "deploy", "grafana-dashboard.json")
    with open(path) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|total)$", "", n)
            for e in exprs for n in re.findall(r"phalanx[:_][a-z0-9_]+", e)}
    stats = {"healthy": 1, "width": 2, "desired_width": 2, "microbatch_share": 0.5}
    text = ServerMetrics("m").render(stats).decode()
    exported = {f.name for f in text_string_to_metric_families(text)}
    assert used and used <= exported, sorted(used - exported)


class _Idle:
    """A backend that serves nothing: enough for the routes that read its stats."""

    model_name, max_model_len, tokenizer = "idle", 64, None

    async def generate(self, request_id, prompt_token_ids, params):  # pragma: no cover
        raise ValueError("idle")
        yield

    async def abort(self, request_id):
        pass

    def stats(self):
        return {"num_waiting": 0, "num_running": 0, "kv_usage": 0.0, "prefix_hit_rate": 0.0}

    async def close(self):
        pass

    def healthy(self):
        return True


@pytest.mark.parametrize("open_metrics", [False, True])
async def test_metrics_without_key_opens_metrics_only(open_metrics):
    """`--metrics-without-key`: Prometheus and AIPerf read `/metrics` with no key (vLLM's
    way); every other route still wants it. Without the flag `/metrics` wants it too."""
    with serving(_Idle(), api_key="k", metrics_without_key=open_metrics) as srv:
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/metrics") as r:
                assert r.status == (200 if open_metrics else 401)
            async with s.get(srv.url + "/v1/models") as r:
                assert r.status == 401
            async with s.get(srv.url + "/metrics", headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200 and "phalanx:" in await r.text()
