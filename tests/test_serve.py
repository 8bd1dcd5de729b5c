"""`phalanx serve` end to end: a real subprocess in the default layout (prefill TP=1
streaming KV to decode DP=2 on a local Ray cluster, tiny model, CPU), driven with the
official `openai` client. Greedy outputs equal the offline single-rank `LLM`'s; bad
input gets its 4xx and the server keeps serving; SIGINT shuts it down with exit code 0.

One server for the module; the SIGINT test runs last and ends it.
"""

from __future__ import annotations

import re
import asyncio

import aiohttp
import pytest
from openai import AsyncOpenAI

from phalanx import LLM

from serve_process import ServeProcess
from test_server import (BASE_FAMILIES, BODY_CAP, KEY, MODEL, _chat_ids, _prompts, _reference,
                         check_streams, scrape_metrics, send_bad_case, stream_completion)

SYSTEM = ("You are a careful assistant who answers in one short sentence and never "
          "repeats the question back to the user. ")  # shared prefix: several full pages
BAD = ("malformed json", "wrong type", "max_tokens 0", "unknown model", "prompt over context",
       "token outside vocab", "body over cap", "missing key", "unknown route")


@pytest.fixture(scope="module")
def serve(tiny_model, tmp_path_factory):
    proc = ServeProcess(["--model", tiny_model, "--port", "0", "--served-model-name", MODEL,
                         "--api-key", KEY, "--max-body-bytes", str(BODY_CAP),
                         "--num-pages", "512", "--max-num-seqs", "64"],
                        tmp_path_factory.mktemp("serve"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model, max_num_seqs=64)
    yield llm
    llm.close()


@pytest.fixture
async def client(serve):
    async with AsyncOpenAI(base_url=serve.url + "/v1", api_key=KEY, max_retries=0,
                           timeout=120) as c:
        yield c


async def test_ready_line_health_and_layout(serve, client):
    assert serve.url.startswith("http://127.0.0.1:")
    sides = sorted({side for side, _, _ in serve.placement()})
    assert sides == ["decode", "prefill instance 0"], serve.stderr()[-2000:]
    # the disaggregated default: two decode ranks' KV, counted before the ready line
    assert re.search(r"phalanx: KV cache holds [1-9][\d,]* tokens; started in [\d.]+ s",
                     serve.stderr()), serve.stderr()[-2000:]
    # start-up's objects frozen out of the collector's reach (server/gc_freeze.py)
    assert re.search(r"phalanx: froze [1-9][\d,]* start-up objects .* ms after\)",
                     serve.stderr()), serve.stderr()[-2000:]
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    async with aiohttp.ClientSession() as s:
        async with s.get(serve.url + "/health") as r:
            assert r.status == 200


async def test_completion_and_chat_match_offline(client, offline):
    prompt = _prompts(1)[0]
    [(text, n, reason)] = _reference(offline, [prompt], 12)
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                          temperature=0)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (text, reason)
    assert out.usage.completion_tokens == n

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    ids = _chat_ids(offline, messages)
    [(text, n, reason)] = _reference(offline, [ids], 10)
    reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                 temperature=0)
    assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), n)
    streamed, usage = "", None
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        for c in chunk.choices:
            streamed += c.delta.content or ""
        usage = chunk.usage or usage
    assert streamed == text and usage.completion_tokens == n


async def test_64_concurrent_streams_match_offline(client, offline):
    prompts = [(SYSTEM if i % 2 else "") + p for i, p in enumerate(_prompts(64))]
    refs = _reference(offline, prompts, 10)
    results = await asyncio.gather(*(stream_completion(client, p, 10) for p in prompts))
    check_streams(prompts, refs, results)


async def test_metrics_parse(serve, client):
    families = await scrape_metrics(client, serve.url, BASE_FAMILIES + (
        "phalanx_backend_healthy", "phalanx_router_prefix_hit_estimate", "phalanx_recoveries"))
    assert families["phalanx_backend_healthy"].samples[0].value == 1.0


@pytest.mark.parametrize("case", BAD)
async def test_bad_input_gets_4xx_and_server_keeps_serving(case, serve, client):
    await send_bad_case(serve.url, case)
    out = await client.completions.create(model=MODEL, prompt="still alive", max_tokens=2)
    assert out.usage.completion_tokens >= 1


async def test_sigint_shuts_down_cleanly(serve):
    """Runs last (file order): ends the module's server."""
    assert serve.interrupt() == 0, serve.stderr()[-4000:]
    err = serve.stderr()
    assert "phalanx: shutting down" in err and "phalanx: stopped" in err
    assert "Traceback" not in err, err[-4000:]
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with s.get(serve.url + "/health"):
                pass
