"""The server under NVIDIA AIPerf (`aiperf profile`), a load generator nobody here wrote.

AIPerf builds its own request bodies (chat, completions and the Responses API, streamed
and whole, with `stream_options`, `max_completion_tokens`, `ignore_eos`, multi-turn
sessions that resend their history), reads SSE its own way and scrapes `/metrics` before, during and after
its run. Every request AIPerf sent must succeed; the text it received must equal what
the offline `LLM` generates greedily for the very body it sent (raw export); the usage
the server reported must match that generation; and the server's Prometheus counters,
as AIPerf scraped them over its run, must count exactly AIPerf's requests and tokens.

AIPerf runs from its own venv (`bench/aiperf_client.py`), made on first use (in the
background from the start of the test run).
"""

from __future__ import annotations

import os
import sys

import pytest

from phalanx import LLM, SamplingParams
from phalanx.server import EngineBackend

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from aiperf_client import (Scenario, aiperf_python, profile, response_text,  # noqa: E402
                           response_usage)
from app_server import serving  # noqa: E402

import background_jobs  # noqa: E402

MODEL = "tiny-aiperf"
SCENARIOS = {
    "chat-stream": Scenario("chat-stream", "chat", streaming=True, requests=8, concurrency=4),
    "completions-stream": Scenario("completions-stream", "completions", streaming=True,
                                   requests=6, concurrency=3, osl=9),
    "completions-whole": Scenario("completions-whole", "completions", streaming=False,
                                  requests=4, concurrency=0, rate=20.0, isl=24, osl=7),
    "chat-sessions": Scenario("chat-sessions", "chat", streaming=False, conversations=2,
                              turns=3, concurrency=2, isl=16, osl=6),
    "responses-stream": Scenario("responses-stream", "responses", streaming=True, requests=4,
                                 concurrency=2, isl=20, osl=8),
}


def _make_venv(background: bool) -> background_jobs.Job:
    code = f"import sys; sys.path.insert(0, {BENCH!r}); import aiperf_client; aiperf_client.aiperf_python()"
    return background_jobs.launch(lambda folder: [[sys.executable, "-c", code]], background=background)


background_jobs.ahead(__file__, __file__, _make_venv)


@pytest.fixture(scope="module")
def aiperf():
    """AIPerf's python; its venv made ahead in the background (`background_jobs`) when
    it was missing: what that run left undone (or failed at) is done here, its errors raised."""
    job = background_jobs.take(__file__)
    if job is not None:
        try:
            job.wait(timeout_s=900)
        finally:
            job.close()
    return aiperf_python()


@pytest.fixture(scope="module")
def backend(tiny_model):
    return EngineBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=8,
                                        num_pages=512)


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend, stream_resume_s=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, max_num_seqs=8, num_pages=512)


def _offline_answer(offline: LLM, body: dict):
    """What the offline engine generates for one AIPerf request body (greedy, EOS
    ignored, as the body asks)."""
    assert body.get("temperature") == 0 and body.get("ignore_eos") is True, body
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens",
                                                             body.get("max_output_tokens")))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if "messages" in body:
        (out,) = offline.chat(body["messages"], params)
    elif "input" in body:  # the Responses API: instructions, then the input messages
        system = [{"role": "system", "content": body["instructions"]}] \
            if body.get("instructions") else []
        (out,) = offline.chat(system + [_text_message(m) for m in body["input"]], params)
    else:
        (out,) = offline.generate([body["prompt"]], params)
    return out


def _text_message(item: dict) -> dict:
    content = item["content"]
    if not isinstance(content, str):
        content = "".join(part["text"] for part in content)
    return {"role": item["role"], "content": content}


def _counter_total(run, name: str) -> float:
    (series,) = run.server_metrics[name]["series"]
    stats = series["stats"]
    return stats["total"] if "total" in stats else stats["count"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_aiperf_run_matches_offline_and_metrics(name, aiperf, server, offline, tiny_model, tmp_path):
    scenario = SCENARIOS[name]
    run = profile(aiperf, server.url, MODEL, tiny_model, scenario, tmp_path, seed=7)

    assert run.summary["request_count"]["avg"] == scenario.expected_requests, run.summary
    assert not run.summary.get("error_summary"), run.summary["error_summary"]
    assert len(run.records) == scenario.expected_requests
    completion_total = prompt_total = 0
    for rec in run.records:
        body = rec["payload"]
        assert int(rec["status"]) == 200, rec
        assert bool(body.get("stream")) == scenario.streaming
        want = _offline_answer(offline, body)
        assert response_text(rec) == want.outputs[0].text, body
        usage = response_usage(rec)
        assert usage is not None, "no usage object (streams ask for it in stream_options)"
        assert usage["completion_tokens"] == len(want.outputs[0].token_ids) == scenario.osl
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)
        completion_total += usage["completion_tokens"]
        prompt_total += usage["prompt_tokens"]
    if scenario.conversations:  # later turns resend the history, the replies included
        turns = sorted(len(r["payload"]["messages"]) for r in run.records)
        assert turns == sorted([1, 3, 5] * scenario.conversations), turns

    # the server's own counters, as AIPerf scraped them over exactly its run
    assert _counter_total(run, "phalanx:e2e_request_latency_seconds") == scenario.expected_requests
    assert _counter_total(run, "phalanx:generation_tokens") == completion_total
    assert _counter_total(run, "phalanx:prompt_tokens") == prompt_total
