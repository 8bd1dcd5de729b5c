"""The async SDK against a real server (EngineBackend, tiny model, CPU)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from phalanx import LLM, SamplingParams
from phalanx.sdk import (APIConnectionError, APIError, AsyncClient, ChatCompletionChunk,
                         Completion)
from phalanx.sdk.sse import iter_sse_data
from phalanx.server import BackgroundServer, EngineBackend, create_app
from app_server import serving

MODEL = "tiny-sdk"
KEY = "sdk-key"


@pytest.fixture(scope="module")
def backend(tiny_model):
    return EngineBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=8,
                                        num_pages=256)


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model)


@pytest.fixture
async def client(server):
    async with AsyncClient(server.url, api_key=KEY, max_retries=1) as c:
        yield c


def _ref(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    out = llm.generate(prompt_token_ids=[prompt_ids],
                       sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return llm.decode(out.outputs[0].token_ids), len(out.outputs[0].token_ids), \
        out.outputs[0].finish_reason


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


async def test_complete_and_stream(client, offline):
    prompt = "the sdk says"
    text, n, reason = _ref(offline, _ids(offline, prompt), 9)
    done = await client.complete(prompt, max_tokens=9, temperature=0)  # model: the listed one
    assert isinstance(done, Completion) and done.model == MODEL
    assert done.text == text and done.choices[0].finish_reason == reason
    assert done.usage.completion_tokens == n

    chunks = [c async for c in client.stream(prompt, max_tokens=9, temperature=0,
                                             stream_options={"include_usage": True})]
    assert "".join(c.text for c in chunks) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-2].choices[0].finish_reason == reason


async def test_chat_and_chat_stream(client, offline):
    messages = [{"role": "user", "content": "hello sdk"}]
    rendered = offline.tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    text, n, _ = _ref(offline, _ids(offline, rendered), 7)
    reply = await client.chat(messages, model=MODEL, max_tokens=7, temperature=0)
    assert reply.text == text and reply.usage.completion_tokens == n
    chunks = [c async for c in client.chat_stream(messages, max_completion_tokens=7,
                                                  temperature=0)]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.text for c in chunks) == text


async def test_models(client):
    listed = await client.models()
    assert [m.id for m in listed.data] == [MODEL] and listed.data[0].max_model_len == 1024


async def test_error_bodies_raise_typed_errors_without_retry(client, server):
    with pytest.raises(APIError) as e:
        await client.complete("x", model="other", max_tokens=2)
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
    with pytest.raises(APIError) as e:
        await client.complete("x", max_tokens=0)
    assert (e.value.status, e.value.type, e.value.param) == (400, "invalid_request_error",
                                                             "max_tokens")
    with pytest.raises(APIError) as e:
        async for _ in client.stream("x", max_tokens=-1):
            pass
    assert e.value.status == 400
    assert client.retries == 0  # 4xx is never retried
    async with AsyncClient(server.url, api_key="wrong") as bad:
        with pytest.raises(APIError) as e:
            await bad.models()
    assert e.value.status == 401 and e.value.code == "invalid_api_key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_retries_a_refused_connection(backend):
    port = _free_port()
    client = AsyncClient(f"http://127.0.0.1:{port}", api_key=KEY, model=MODEL, max_retries=100,
                         backoff_s=0.02, max_backoff_s=0.05)
    task = asyncio.create_task(client.complete("retry me", max_tokens=3, temperature=0))
    async with asyncio.timeout(30):
        while client.retries == 0:  # the first attempt was refused: nobody listens yet
            await asyncio.sleep(0.01)
    late = BackgroundServer(lambda: create_app(backend, api_key=KEY), port=port).start()
    try:
        done = await task
        assert done.usage.completion_tokens >= 1 and client.retries >= 1
    finally:
        await client.close()
        late.stop()


async def test_gives_up_after_max_retries():
    client = AsyncClient(f"http://127.0.0.1:{_free_port()}", model=MODEL, max_retries=2,
                         backoff_s=0.0)
    async with client:
        with pytest.raises(APIConnectionError):
            await client.complete("nobody home")
    assert client.retries == 2


async def test_sse_parser_handles_any_chunking():
    body = (b": comment\n\ndata: {\"a\": 1}\n\nevent: x\r\ndata: {\"b\":\r\ndata: 2}\r\n\r\n"
            b"data: [DONE]\n\ndata: {\"after\": 0}\n\n")
    for size in (1, 2, 3, 7, len(body)):
        async def pieces():
            for i in range(0, len(body), size):
                yield body[i:i + size]
        assert [p async for p in iter_sse_data(pieces())] == [b'{"a": 1}', b'{"b":\n2}']
