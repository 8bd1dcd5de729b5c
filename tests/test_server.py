"""The HTTP server end to end: a real aiohttp server over `EngineBackend` (tiny model,
CPU), driven with the official `openai` client and raw HTTP.

One server per module (on its own thread and event loop, like a separate process);
greedy outputs are compared with the offline `LLM` on the same model.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from phalanx import LLM, SamplingParams
from app_server import serving
from spy_backend import SpyBackend

MODEL = "tiny-test"
KEY = "test-key"
BODY_CAP = 64 * 1024
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def _prompts(n: int) -> list[str]:
    """Distinct short prompts (no shared full KV page between them)."""
    return [f"{WORDS[i % 8]} {i} {WORDS[(i * 3 + 1) % 8]} is the name of" for i in range(n)]


@pytest.fixture(scope="module")
def backend(tiny_model):
    return SpyBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=16,
                                     num_pages=512)


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend, api_key=KEY, max_body_bytes=BODY_CAP, stream_resume_s=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model, max_num_seqs=64)
    yield llm
    llm.close()


def _reference(llm: LLM, prompts: list, max_tokens: int) -> list[tuple[str, int, str]]:
    """(text, completion tokens, finish reason) of greedy offline generation."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    if isinstance(prompts[0], str):
        outs = llm.generate(prompts, params)
    else:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(llm.decode(o.outputs[0].token_ids), len(o.outputs[0].token_ids),
             o.outputs[0].finish_reason) for o in outs]


def _chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
async def client(server):
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


async def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


async def _idle(backend) -> None:
    """Wait until the engine holds no request and no KV page."""
    await _wait_for(lambda: (lambda s: s["num_running"] == 0 and s["num_waiting"] == 0
                             and s["kv_usage"] == 0.0)(backend.stats()), "engine idle")


# -- the happy paths ------------------------------------------------------------------
async def test_models_and_health(client, server):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as s:  # /health needs no key
        async with s.get(server.url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"


async def test_completion_matches_offline(client, offline):
    prompt = _prompts(1)[0]
    [(text, n, reason)] = _reference(offline, [prompt], 12)
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                          temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == text and out.choices[0].finish_reason == reason
    prompt_tokens = len(offline.tokenizer.encode(prompt, add_special_tokens=False))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, n)
    assert out.usage.total_tokens == prompt_tokens + n


async def test_token_and_multi_prompts(client, offline):
    prompts = _prompts(3)[1:]
    refs = _reference(offline, prompts, 6)
    ids = offline.tokenizer.encode(prompts[0], add_special_tokens=False)
    single = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert single.choices[0].text == refs[0][0]
    multi = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=6,
                                            temperature=0)
    assert [(c.index, c.text) for c in multi.choices] == [(0, refs[0][0]), (1, refs[1][0])]
    assert multi.usage.completion_tokens == refs[0][1] + refs[1][1]
    texts = ["", ""]
    async for chunk in await client.completions.create(model=MODEL, prompt=prompts, max_tokens=6,
                                                       temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [refs[0][0], refs[1][0]]


async def test_return_token_ids_on_both_routes(client, offline):
    """vLLM's `return_token_ids`: each stream chunk's choice carries the ids it adds (their
    concatenation is the offline engine's tokens), the whole response its choice's ids;
    absent unless asked for."""
    prompt = _prompts(1)[0]
    ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
    want = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=9, ignore_eos=True))[0].outputs[0].token_ids
    body = dict(model=MODEL, prompt=prompt, max_tokens=9, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    got: list[int] = []
    async for chunk in await client.completions.create(stream=True, **body):
        for c in chunk.choices:
            got += c.model_extra["token_ids"]
    assert got == want
    whole = await client.completions.create(**body)
    assert whole.choices[0].model_extra["token_ids"] == want
    plain = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4,
        extra_body={"return_token_ids": True})
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens


async def stream_completion(client, prompt: str, max_tokens: int):
    """(text, finish reason of every chunk, usage) of one streamed greedy completion."""
    text, reasons, usage = "", [], None
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    return text, reasons, usage


def check_streams(prompts, refs, results) -> None:
    """Each streamed result equals its offline reference: text, one final finish reason,
    completion tokens."""
    for prompt, (text, n, reason), (got, reasons, usage) in zip(prompts, refs, results):
        assert got == text, prompt
        assert reasons[-1] == reason and all(r is None for r in reasons[:-1])
        assert usage.completion_tokens == n


async def test_64_concurrent_streams_match_offline(client, offline, backend):
    prompts = _prompts(64)
    refs = _reference(offline, prompts, 8)
    results = await asyncio.gather(*(stream_completion(client, p, 8) for p in prompts))
    check_streams(prompts, refs, results)
    for prompt, (_, _, usage) in zip(prompts, results):
        assert usage.prompt_tokens == len(offline.tokenizer.encode(prompt, add_special_tokens=False))
    await _idle(backend)


async def test_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    ids = _chat_ids(offline, messages)
    [(text, n, reason)] = _reference(offline, [ids], 10)
    out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                               temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text and out.choices[0].finish_reason == reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), n)

    streamed, roles, usage = "", [], None
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        for c in chunk.choices:
            streamed += c.delta.content or ""
            roles.append(c.delta.role)
        usage = chunk.usage or usage
    assert streamed == text and roles[0] == "assistant"
    assert usage.completion_tokens == n


async def test_stop_strings(client, offline):
    prompt = _prompts(5)[4]
    [(text, _, _)] = _reference(offline, [prompt], 16)
    stop = text[4:7]
    expected = text[:text.find(stop)]
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                          temperature=0, stop=[stop, "\x00never"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = ""
    async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                       temperature=0, stop=stop, stream=True):
        streamed += chunk.choices[0].text
    assert streamed == expected


BASE_FAMILIES = ("phalanx_requests", "phalanx:time_to_first_token_seconds",
                 "phalanx:inter_token_latency_seconds", "phalanx:num_requests_waiting",
                 "phalanx:kv_cache_usage_perc", "phalanx_prefix_cache_hit_rate",
                 "phalanx:num_requests_running")


async def scrape_metrics(client, url: str, families_needed=BASE_FAMILIES) -> dict:
    """After one completion, /metrics parsed by family name; every needed family is there
    and time-to-first-token counted it."""
    await client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in families_needed:
        assert name in families, name
    ttft = [s for s in families["phalanx:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")]
    assert ttft[0].value >= 1
    return families


async def test_metrics_parse(client, server):
    families = await scrape_metrics(client, server.url)
    ok = [s for s in families["phalanx_requests"].samples if s.name == "phalanx_requests_total"
          and s.labels == {"route": "/v1/completions", "status": "200"}]
    assert ok and ok[0].value >= 1


# -- bad input ---------------------------------------------------------------------------
_GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
_BAD_CASES = {
    "malformed json": ("POST", "/v1/completions", b'{"model": "x", ', AUTH, 400, None),
    "not an object": ("POST", "/v1/completions", b"[1, 2]", AUTH, 400, None),
    "wrong type": ("POST", "/v1/completions", {**_GOOD, "max_tokens": "5"}, AUTH, 400,
                   "max_tokens"),
    "bool for number": ("POST", "/v1/completions", {**_GOOD, "temperature": True}, AUTH, 400,
                        "temperature"),
    "max_tokens 0": ("POST", "/v1/completions", {**_GOOD, "max_tokens": 0}, AUTH, 400,
                     "max_tokens"),
    "max_tokens negative": ("POST", "/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                             "max_tokens": -3}, AUTH, 400, "max_tokens"),
    "unknown model": ("POST", "/v1/completions", {**_GOOD, "model": "gpt-9"}, AUTH, 404,
                      "model"),
    "prompt over context": ("POST", "/v1/completions", {**_GOOD, "prompt": [5] * 1024}, AUTH,
                            400, "prompt"),
    "text prompt over context": ("POST", "/v1/completions",
                                 {**_GOOD, "prompt": "many words " * 1500}, AUTH, 400, "prompt"),
    "max_tokens over room": ("POST", "/v1/completions", {**_GOOD, "max_tokens": 5000}, AUTH,
                             400, "max_tokens"),
    "token outside vocab": ("POST", "/v1/completions", {**_GOOD, "prompt": [1, 10 ** 6]}, AUTH,
                            400, "prompt"),
    "missing field": ("POST", "/v1/completions", {"model": MODEL}, AUTH, 400, "prompt"),
    "unknown field": ("POST", "/v1/completions", {**_GOOD, "frobnicate": 1}, AUTH, 400,
                      "frobnicate"),
    "n 0": ("POST", "/v1/completions", {**_GOOD, "n": 0}, AUTH, 400, "n"),
    "n too many": ("POST", "/v1/completions", {**_GOOD, "n": 129}, AUTH, 400, "n"),
    "best_of below n": ("POST", "/v1/completions", {**_GOOD, "n": 3, "best_of": 2}, AUTH, 400,
                        "best_of"),
    "best_of streamed": ("POST", "/v1/completions", {**_GOOD, "n": 1, "best_of": 2,
                                                     "stream": True}, AUTH, 400, "best_of"),
    "logprobs 21": ("POST", "/v1/completions", {**_GOOD, "logprobs": 21}, AUTH, 400, "logprobs"),
    "top_logprobs alone": ("POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "top_logprobs": 2}, AUTH, 400, "top_logprobs"),
    "logit_bias key": ("POST", "/v1/completions", {**_GOOD, "logit_bias": {"abc": 1}}, AUTH,
                       400, "logit_bias"),
    "logit_bias value": ("POST", "/v1/completions", {**_GOOD, "logit_bias": {"5": 101}}, AUTH,
                         400, "logit_bias"),
    "logit_bias beyond vocab": ("POST", "/v1/completions",
                                {**_GOOD, "logit_bias": {"99999999": 1}}, AUTH, 400, None),
    "presence_penalty": ("POST", "/v1/completions", {**_GOOD, "presence_penalty": 2.5}, AUTH,
                         400, "presence_penalty"),
    "repetition_penalty": ("POST", "/v1/completions", {**_GOOD, "repetition_penalty": 0},
                           AUTH, 400, "repetition_penalty"),
    "min_tokens over max": ("POST", "/v1/completions", {**_GOOD, "min_tokens": 50}, AUTH, 400,
                            "min_tokens"),
    "empty messages": ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, AUTH,
                       400, "messages"),
    "bad role": ("POST", "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400,
                 "messages[0].role"),
    "body over cap": ("POST", "/v1/completions", {**_GOOD, "prompt": "x" * (BODY_CAP + 10)},
                      AUTH, 413, None),
    "missing key": ("POST", "/v1/completions", _GOOD, {}, 401, None),
    "wrong key": ("GET", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
    "unknown route": ("GET", "/v1/nothing", None, AUTH, 404, None),
    "wrong method": ("GET", "/v1/completions", None, AUTH, 405, None),
}


async def _good_request(client) -> None:
    out = await client.completions.create(model=MODEL, prompt="still alive", max_tokens=2)
    assert out.usage.completion_tokens >= 1


async def send_bad_case(url: str, case: str) -> dict:
    """Send `_BAD_CASES[case]` to the server at `url`; check the status and the OpenAI
    error body's shape (and `param`); return the error object."""
    method, path, body, headers, status, param = _BAD_CASES[case]
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, data=data,
                             headers={**headers, "Content-Type": "application/json"}) as r:
            assert r.status == status, await r.text()
            err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("case", list(_BAD_CASES))
async def test_bad_input_gets_4xx_and_server_keeps_serving(case, server, client, backend):
    err = await send_bad_case(server.url, case)
    if case == "unknown model":
        assert err["code"] == "model_not_found"
    if case in ("prompt over context", "max_tokens over room"):
        assert err["code"] == "context_length_exceeded"
    await _good_request(client)
    await _idle(backend)


async def test_chunked_body_over_cap_is_413(server, client):
    async def chunks():
        for _ in range(20):
            yield b"x" * 8192
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.post(server.url + "/v1/completions", data=chunks()) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"
    await _good_request(client)


async def test_openai_client_sees_typed_errors(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens"
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    await _good_request(client)


# -- disconnects -----------------------------------------------------------------------
async def test_stream_disconnect_aborts_and_frees_kv(server, backend):
    await _idle(backend)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with aiohttp.ClientSession(headers=AUTH) as s:
        resp = await s.post(server.url + "/v1/completions", json=body)
        assert resp.status == 200
        request_id = resp.headers["X-Request-Id"]
        events = 0
        async for line in resp.content:
            events += line.startswith(b"data: ")
            if events == 3:
                break
        assert backend.stats()["kv_usage"] > 0  # the request holds pages while it runs
        resp.close()  # the client goes away mid-stream
    await _wait_for(lambda: request_id in backend.aborted, "abort of the dropped stream")
    await _idle(backend)


async def test_non_stream_disconnect_aborts(server, backend, client):
    await _idle(backend)
    body = {"model": MODEL, "prompt": "another long story", "max_tokens": 600,
            "ignore_eos": True}
    before = len(backend.aborted)
    async with aiohttp.ClientSession(headers=AUTH) as s:
        task = asyncio.create_task(s.post(server.url + "/v1/completions", json=body))
        await _wait_for(lambda: backend.stats()["num_running"] > 0, "request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await _wait_for(lambda: len(backend.aborted) > before, "abort of the dropped request")
    await _idle(backend)
    await _good_request(client)
