"""The server's routes beside generation, as clients use them: `/tokenize` and
`/detokenize` (vLLM's shapes; a chat tokenization equals the ids a chat completion runs
on), `GET /v1/models/{id}` through the `openai` client, `/version`, `HEAD /health`, CORS
preflights and answers (`allowed_origins`, before the API-key check), and a client's
`X-Request-Id` kept on JSON and SSE answers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from phalanx import __version__
from phalanx.server import BackgroundServer, EngineBackend, create_app
from app_server import serving

MODEL = "tiny-routes"
KEY = "routes-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example:3000"


@pytest.fixture(scope="module")
def backend(tiny_model):
    b = EngineBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=8, num_pages=256)
    yield b


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend, api_key=KEY, allowed_origins=[ORIGIN]) as srv:
        yield srv


async def _post(server, path: str, body: dict, headers: dict = AUTH) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + path, json=body, headers=headers) as r:
            return r.status, await r.json(), dict(r.headers)


async def test_tokenize_a_prompt_and_back(server, backend):
    tok = backend.tokenizer
    text = "alpha bravo charlie is the name of"
    status, body, _ = await _post(server, "/tokenize", {"prompt": text, "model": MODEL})
    assert status == 200, body
    assert body["tokens"] == tok.encode(text, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == backend.max_model_len
    assert body["token_strs"] is None
    _, plain, _ = await _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    status, back, _ = await _post(server, "/detokenize", {"tokens": plain["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(plain["tokens"])}


async def test_tokenize_chat_messages_as_a_chat_completion_runs_them(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    status, body, _ = await _post(server, "/tokenize", {"messages": messages})
    assert status == 200, body
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        out = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert body["count"] == out.usage.prompt_tokens
    _, bare, _ = await _post(server, "/tokenize", {"messages": messages,
                                                   "add_generation_prompt": False})
    assert bare["count"] < body["count"] and body["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": "x"}],
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
])
async def test_bad_tokenizer_requests_are_4xx_naming_the_field(server, path, body, status, param):
    got, err, _ = await _post(server, path, body)
    assert got == status, err
    assert err["error"]["param"] == param, err


async def test_model_card_version_and_head_health(server):
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        card = await c.models.retrieve(MODEL)
        assert card.id == MODEL and card.owned_by == "phalanx"
        with pytest.raises(openai.NotFoundError) as info:
            await c.models.retrieve("no-such-model")
        assert info.value.body["code"] == "model_not_found"
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/version") as r:  # no key needed
            assert r.status == 200 and await r.json() == {"version": __version__}
        async with s.head(server.url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with s.get(server.url + "/tokenize", headers=AUTH) as r:
            assert r.status == 405


async def test_cors_preflight_and_answers(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with aiohttp.ClientSession() as s:
        async with s.options(server.url + "/v1/chat/completions", headers=preflight) as r:
            assert r.status == 204  # before the key check: browsers send none here
            assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
        async with s.options(server.url + "/v1/chat/completions",
                             headers={**preflight, "Origin": "http://evil.example"}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        body = {"model": MODEL, "prompt": "alpha", "max_tokens": 3, "stream": True}
        async with s.post(server.url + "/v1/completions", json=body,
                          headers={**AUTH, "Origin": ORIGIN}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "X-Request-Id" in r.headers["Access-Control-Expose-Headers"]
            assert (await r.text()).rstrip().endswith("data: [DONE]")
        async with s.get(server.url + "/v1/models", headers=AUTH) as r:  # no Origin
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def test_no_cors_unless_origins_are_given(backend):
    srv = BackgroundServer(lambda: create_app(backend))
    srv.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/v1/models", headers={"Origin": ORIGIN}) as r:
                assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_clients_request_id_is_kept(server, stream):
    body = {"model": MODEL, "prompt": "alpha", "max_tokens": 2, "stream": stream}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=body,
                          headers={**AUTH, "X-Request-Id": "trace-42.a"}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "trace-42.a"
            await r.read()
        async with s.post(server.url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.headers["X-Request-Id"].startswith("cmpl-")
            await r.read()
        async with s.post(server.url + "/v1/completions", json=body,
                          headers={**AUTH, "X-Request-Id": "x" * 129}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "X-Request-Id"


class SlowBackend(EngineBackend):
    """Each delta 50 ms late: a stream that outlives the shutdown grace."""

    async def generate(self, request_id, prompt_token_ids, params):
        async for delta in super().generate(request_id, prompt_token_ids, params):
            await asyncio.sleep(0.05)
            yield delta


async def test_shutdown_ends_open_requests_with_a_503_after_the_grace(tiny_model):
    """Shut down with a stream and a JSON request open: after the grace each gets a 503
    (`server_shutting_down`): the stream as an error event followed by `[DONE]`, never a
    connection cut mid-event; the backend holds nothing afterwards."""
    backend = SlowBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=8,
                                         num_pages=256)
    srv = BackgroundServer(lambda: create_app(backend, shutdown_grace_s=0.5))
    srv.start()
    body = {"model": MODEL, "prompt": "alpha", "max_tokens": 400, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + "/v1/completions", json={**body, "stream": True}) as r:
                first = await r.content.readline()
                assert first.startswith(b"id: cmpl-"), first
                plain = asyncio.ensure_future(s.post(srv.url + "/v1/completions", json=body))
                await asyncio.sleep(0.3)
                stopping = asyncio.ensure_future(asyncio.to_thread(srv.stop))
                rest = (await r.read()).decode()
            events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", rest[-500:]
            assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
            answer = await plain
            assert answer.status == 503
            assert (await answer.json())["error"]["code"] == "server_shutting_down"
            await stopping
        for _ in range(200):  # the aborts reach the engine thread within moments
            if backend.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.05)
        assert backend.stats()["num_running"] == 0
    finally:
        srv.stop()
        await backend.close()


async def test_stop_token_ids_and_min_p_through_the_openai_client(server, tiny_model):
    """vLLM's `stop_token_ids` ends a choice at the first of those ids (finish reason
    "stop"); `min_p` is honoured (a seeded sampled run equals the offline engine's with
    the same min_p); out-of-range values are 400s naming the field."""
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        free = await c.completions.create(model=MODEL, prompt="alpha bravo", max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
        ids = free.choices[0].token_ids
        stop_at = next(i for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
        cut = await c.completions.create(
            model=MODEL, prompt="alpha bravo", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True,
                        "stop_token_ids": [ids[stop_at]]})
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].token_ids == ids[:stop_at + 1]
        sampled = [await c.completions.create(
            model=MODEL, prompt="alpha bravo", max_tokens=8, temperature=1.0, seed=3,
            extra_body={"min_p": min_p, "ignore_eos": True, "return_token_ids": True})
            for min_p in (0.0, 0.5)]
        for bad in ({"min_p": 1.5}, {"stop_token_ids": [-1]}):
            with pytest.raises(openai.BadRequestError) as info:
                await c.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_body=bad)
            assert info.value.body["param"] == next(iter(bad))
    from phalanx import LLM, SamplingParams
    return_ids = [s.choices[0].token_ids for s in sampled]
    assert return_ids[0] != return_ids[1]  # min_p changed what was drawn
    llm = LLM(tiny_model, max_num_seqs=4)
    try:
        for min_p, got in zip((0.0, 0.5), return_ids):
            prompt = llm.tokenizer.encode("alpha bravo", add_special_tokens=False)
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
                temperature=1.0, seed=3, min_p=min_p, max_tokens=8, ignore_eos=True))
            assert out[0].outputs[0].token_ids == got, min_p
    finally:
        llm.close()
