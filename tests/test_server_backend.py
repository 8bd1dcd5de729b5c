"""`EngineBackend` against the `ServingBackend` contract, without HTTP."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from phalanx import LLM, SamplingParams
from phalanx.server import EngineBackend, ServingBackend, TokenDelta

GREEDY = SamplingParams(temperature=0, max_tokens=10)
LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)


@pytest.fixture(scope="module")
def backend(tiny_model):
    be = EngineBackend.from_model_dir(tiny_model, max_num_seqs=8, num_pages=256)
    yield be
    asyncio.run(be.close())


async def _collect(backend: ServingBackend, rid: str, ids: list[int],
                   params: SamplingParams) -> list[TokenDelta]:
    return [d async for d in backend.generate(rid, ids, params)]


async def _idle(backend: ServingBackend) -> None:
    async with asyncio.timeout(30):
        while True:
            s = backend.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_usage"] == 0:
                return
            await asyncio.sleep(0.01)


def test_attributes_and_stats(backend, tiny_model):
    assert isinstance(backend, ServingBackend)
    assert backend.model_name == "qwen3_moe" and backend.max_model_len == 1024
    assert backend.tokenizer.decode(backend.tokenizer.encode("hello")) == "hello"
    stats = backend.stats()
    for key in ("num_waiting", "num_running", "kv_usage", "prefix_hit_rate"):
        assert isinstance(stats[key], (int, float)), key
    assert backend.healthy()
    with pytest.raises(ValueError, match="model"):
        EngineBackend.from_model_dir(tiny_model + "/nope")


async def test_deltas_tile_the_output_and_match_offline(backend, tiny_model):
    prompts = [[5, 6, 7, 8], [100, 200, 300], [42] * 20]
    offline = LLM(tiny_model).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    runs = await asyncio.gather(*(_collect(backend, f"tile-{i}", p, GREEDY)
                                  for i, p in enumerate(prompts)))
    for deltas, ref in zip(runs, offline):
        tokens = []
        for d in deltas:
            assert d.index == len(tokens)
            tokens += d.token_ids
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert tokens == ref.outputs[0].token_ids
        assert deltas[-1].finish_reason == ref.outputs[0].finish_reason
    await _idle(backend)


@pytest.mark.parametrize("ids, match", [([], "prompt"), ([1, 10 ** 6], "vocabulary"),
                                        ([3] * 1024, "context")])
async def test_invalid_request_raises_before_first_delta(backend, ids, match):
    with pytest.raises(ValueError, match=match):
        await anext(backend.generate("bad", ids, GREEDY))
    deltas = await _collect(backend, "bad", [1, 2, 3], GREEDY)  # the id is free again
    assert deltas[-1].finished


async def test_duplicate_request_id_is_refused(backend):
    gen = backend.generate("dup", [1, 2, 3], LONG)
    first = await anext(gen)
    assert first.index == 0
    with pytest.raises(ValueError, match="already in use"):
        await anext(backend.generate("dup", [4, 5], GREEDY))
    await gen.aclose()
    await _idle(backend)


async def test_abort_ends_the_stream_and_frees_kv(backend):
    gen = backend.generate("to-abort", [9, 8, 7], LONG)
    await anext(gen)
    assert backend.stats()["kv_usage"] > 0 or backend.stats()["num_running"] > 0
    await backend.abort("to-abort")
    rest = [d async for d in gen]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    await backend.abort("to-abort")  # idempotent
    await backend.abort("never-existed")
    await _idle(backend)


async def test_consumer_leaving_early_aborts(backend):
    async with aclosing(backend.generate("leaver", [11, 12, 13], LONG)) as gen:
        async for d in gen:
            if d.index >= 3:
                break
    await _idle(backend)

    async def consume():
        async for _ in backend.generate("cancelled", [14, 15], LONG):
            pass
    task = asyncio.create_task(consume())
    async with asyncio.timeout(30):
        while backend.stats()["num_running"] == 0:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _idle(backend)


async def test_close_aborts_consumers_and_refuses_new_work(tiny_model):
    be = EngineBackend.from_model_dir(tiny_model, max_num_seqs=4, num_pages=128)
    gen = be.generate("r", [1, 2, 3], LONG)
    await anext(gen)
    await be.close()
    rest = [d async for d in gen]
    assert rest[-1].finish_reason == "abort"
    assert not be.healthy()
    with pytest.raises(RuntimeError):
        await anext(be.generate("after", [1, 2], GREEDY))
    await be.close()  # idempotent
