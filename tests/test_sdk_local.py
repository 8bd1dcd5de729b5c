"""The in-process SDK client: `LocalClient` / `start_local`, the `AsyncClient` API without
HTTP. Single-rank (no Ray) for the API surface and errors; one colocated DP=2 cluster on
local Ray for the routed path (`GroupClient` under `ClusterBackend`): a rank killed
mid-stream is recovered (same text), and past the recovery budget it is final (503,
unhealthy). Greedy outputs equal the offline `LLM`'s.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from phalanx import LLM
from phalanx.sdk import APIError, ChatCompletionChunk, Completion
from phalanx.server import LocalClient, start_local

from test_server import _chat_ids, _prompts, _reference

MODEL = "tiny-local"


@pytest.fixture(scope="module")
def offline(tiny_model):
    llm = LLM(tiny_model)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def local(tiny_model):
    client = start_local(tiny_model, tp=1, dp=1, model_name=MODEL, max_num_seqs=8,
                         num_pages=256)
    yield client
    asyncio.run(client.close())


async def test_single_rank_needs_no_ray(local):
    assert isinstance(local, LocalClient) and type(local.backend).__name__ == "EngineBackend"
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert [m.id for m in (await local.models()).data] == [MODEL]


async def test_complete_and_stream_match_offline(local, offline):
    prompts = _prompts(3)
    refs = _reference(offline, prompts, 10)
    done = await local.complete(prompts[0], max_tokens=10, temperature=0)
    assert isinstance(done, Completion) and done.text == refs[0][0]
    assert done.usage.completion_tokens == refs[0][1] and done.model == MODEL
    chunks = [c async for c in local.stream(prompts[1], max_tokens=10, temperature=0,
                                            stream_options={"include_usage": True})]
    assert "".join(c.text for c in chunks if c.choices) == refs[1][0]
    assert chunks[-1].usage.completion_tokens == refs[1][1]
    multi = await local.complete(prompts, max_tokens=10, temperature=0)
    assert [c.text for c in multi.choices] == [r[0] for r in refs]


async def test_chat_and_chat_stream_match_offline(local, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    [(text, n, _)] = _reference(offline, [_chat_ids(offline, messages)], 8)
    reply = await local.chat(messages, max_tokens=8, temperature=0)
    assert reply.text == text and reply.usage.completion_tokens == n
    chunks = [c async for c in local.chat_stream(messages, max_tokens=8, temperature=0)]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.text for c in chunks) == text


@pytest.mark.parametrize("params, status, param", [
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(model="gpt-9"), 404, "model"),
    (dict(prompt=[1, 10 ** 6]), 400, "prompt"),
    (dict(frobnicate=1), 400, "frobnicate"),
])
async def test_errors_are_api_errors(local, params, status, param):
    kw = {"prompt": "hello", "max_tokens": 2, **params}
    with pytest.raises(APIError) as err:
        await local.complete(kw.pop("prompt"), **kw)
    assert (err.value.status, err.value.param) == (status, param)
    assert (await local.complete("still fine", max_tokens=2)).usage.completion_tokens >= 1


async def test_breaking_out_of_a_stream_aborts(local):
    async for _ in local.stream("a long one", max_tokens=200, ignore_eos=True):
        break
    for _ in range(500):
        if local.backend.stats()["num_pending"] == 0 and local.backend.stats()["num_running"] == 0:
            break
        await asyncio.sleep(0.01)
    assert local.backend.stats()["num_running"] == 0


async def test_start_local_cluster_routes_matches_offline_recovers_and_fails_503(tiny_model, offline):
    import ray

    from phalanx import SamplingParams

    client = start_local(tiny_model, tp=1, dp=2, model_name=MODEL, max_num_seqs=16,
                         num_pages=256, collective_timeout_s=5, max_recoveries=1)
    try:
        assert type(client.backend).__name__ == "ClusterBackend"
        prompts = _prompts(8)
        refs = _reference(offline, prompts, 8)
        outs = await asyncio.gather(*(client.complete(p, max_tokens=8, temperature=0)
                                      for p in prompts))
        assert [o.text for o in outs] == [r[0] for r in refs]
        streamed = "".join([c.text async for c in client.stream(prompts[0], max_tokens=8,
                                                                 temperature=0)])
        assert streamed == refs[0][0]
        per_group = client.backend.router.decode.stats.per_target
        assert sum(per_group.values()) == 9 and set(per_group) <= {0, 1}

        # A rank dies mid-stream: the group is re-formed, the stream goes on with the
        # same text as without the fault, and /metrics counts one recovery.
        group = client.backend._driver._client
        [long_ref] = offline.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=48,
                                                                  ignore_eos=True))
        chunks, killed = [], False
        async for c in client.stream(prompts[1], max_tokens=48, temperature=0, ignore_eos=True):
            chunks.append(c.text)
            if len(chunks) == 3 and not killed:
                ray.kill(group.supervisor.actors[1], no_restart=True)
                killed = True
        assert "".join(chunks) == offline.decode(long_ref.outputs[0].token_ids)
        assert group.recoveries == 1 and group.epoch == 2
        for _ in range(200):  # the stats view refreshes in the background
            if client.backend.stats().get("recoveries") == 1.0:
                break
            await asyncio.sleep(0.05)
        assert client.backend.stats()["recoveries"] == 1.0 and client.backend.healthy()

        # Past its restart intensity (1 within the default window) a rank death is
        # final: 503, unhealthy.
        ray.kill(group.supervisor.actors[1], no_restart=True)
        with pytest.raises(APIError) as err:
            for _ in range(100):  # until the failure is seen (at most one deadline)
                await client.complete(prompts[1], max_tokens=64, ignore_eos=True)
        assert err.value.status == 503 and err.value.code == "backend_failed"
        assert not client.backend.healthy() and client.backend.stats()["healthy"] == 0.0
    finally:
        await client.close()
    assert not sys.modules["ray"].is_initialized()
