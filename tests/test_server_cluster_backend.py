"""`ClusterBackend` over a fake in-thread multi-rank client: the router decides where each
request goes, outputs reach consumers exactly once and in order (replays dropped, gaps
fail the request), a failed cluster ends every request with a 503 and turns /health 503.
No Ray, no model: the fake produces tokens from the prompt.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import aiohttp
import pytest

from phalanx.actors.supervisor import GroupFailure, RankDeath
from phalanx.engine.outputs import StepOutput
from phalanx.engine.sampling_params import SamplingParams
from phalanx.router import Router, page_hashes
from phalanx.server import BackgroundServer, OpenAIError, create_app
from phalanx.server.cluster_backend import ClusterBackend
from phalanx.server.cluster_driver import DriverConfig

VOCAB = 1000
PAGE = 4


@dataclass(slots=True)
class IndexedOutput(StepOutput):
    """A StepOutput tagged with the output index of its first token."""

    index: int = -1


def expected(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + 7 * i) % VOCAB for i in range(n)]


@dataclass(slots=True)
class _Req:
    prompt: list[int]
    max_tokens: int
    emitted: int = 0


@dataclass
class FakeClient:
    """Duck-typed GroupClient/DisaggClient: one token per request per poll."""

    dp: int = 2
    prefill_instances: int = 0
    replay: bool = False  # re-send every previous output before the next one
    gap_for: str = ""  # this request skips index 1
    reqs: dict = field(default_factory=dict)
    placed: dict = field(default_factory=dict)
    aborted: list = field(default_factory=list)
    threads: set = field(default_factory=set)
    fail: Exception | None = None
    closed: bool = False
    held: dict = field(default_factory=dict)  # group -> page hashes of its prompts
    evicted: dict | None = None  # set: report evictions (group -> hashes) instead

    def topology(self) -> dict:
        return {"dp": self.dp, "prefill_instances": self.prefill_instances, "page_size": PAGE,
                "prefill_page_size": PAGE, "num_pages": 256, "prefill_num_pages": 256}

    def submit(self, rid: str, tokens: list[int], params: SamplingParams, placement) -> None:
        self.threads.add(threading.get_ident())
        if max(tokens) >= VOCAB:
            raise ValueError(f"prompt: token {max(tokens)} is outside the vocabulary")
        group = placement.dp_group
        self.placed[rid] = (group, placement.prefill_instance if self.prefill_instances else None)
        self.held.setdefault(group, set()).update(page_hashes(tokens, PAGE))
        self.reqs[rid] = _Req(list(tokens), params.max_tokens)

    def poll(self) -> list[StepOutput]:
        self.threads.add(threading.get_ident())
        time.sleep(0.002)
        if self.fail is not None:
            raise self.fail
        outs: list[StepOutput] = []
        for rid, r in list(self.reqs.items()):
            toks = expected(r.prompt, r.max_tokens)
            if self.replay:
                outs.extend(IndexedOutput(rid, [t], epoch=1, index=i)
                            for i, t in enumerate(toks[:r.emitted]))
            i = r.emitted + (1 if rid == self.gap_for and r.emitted == 1 else 0)
            done = i + 1 >= r.max_tokens
            outs.append(IndexedOutput(rid, [toks[i]], done, "length" if done else None, 3,
                                      epoch=1, index=i))
            r.emitted = i + 1
            if done:
                del self.reqs[rid]
        return outs

    def abort(self, rid: str) -> None:
        self.threads.add(threading.get_ident())
        self.aborted.append(rid)
        self.reqs.pop(rid, None)

    def leader_stats(self) -> dict:
        if self.fail is not None:  # how an idle cluster learns of a dead rank
            raise self.fail
        on = [sum(1 for rid in self.reqs if self.placed[rid][0] == g) for g in range(self.dp)]
        stats = [{"num_waiting": 0, "num_running": n, "kv_usage": 0.25, "num_pages": 256,
                  "prefix_hit_tokens": 1, "prefix_query_tokens": 4} for n in on]
        return {"decode": stats, "prefill": [{"num_waiting": 1}] * self.prefill_instances}

    def held_prefixes(self) -> dict:
        if self.evicted is not None:  # incremental reports (actors/held_reports.py)
            return {"decode": [{"evicted": sorted(self.evicted.get(g, ()))} for g in range(self.dp)],
                    "prefill": [{"evicted": []} for _ in range(self.prefill_instances)]}
        return {"decode": [sorted(self.held.get(g, ())) for g in range(self.dp)],
                "prefill": [[] for _ in range(self.prefill_instances)]}

    def close(self) -> None:
        self.closed = True


class SpyRouter(Router):
    """Records every placement decision."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.decisions: dict[str, tuple] = {}
        self.forgotten: list[tuple] = []  # (group, evicted hashes) per incremental report

    def forget_prefixes(self, group, evicted, as_of=None):
        self.forgotten.append((group, sorted(evicted)))
        return super().forget_prefixes(group, evicted, as_of)

    def route(self, request, **kw):
        group = super().route(request, **kw)
        self.decisions[request.request_id] = (group, None)
        return group

    def route_prefill(self, request, **kw):
        instance = super().route_prefill(request, **kw)
        self.decisions[request.request_id] = (self.decisions[request.request_id][0], instance)
        return instance


def _backend(fake: FakeClient, policy: str = "prefix_aware", **kw) -> ClusterBackend:
    router = SpyRouter(page_size=PAGE, groups=range(fake.dp),
                       prefill_instances=range(fake.prefill_instances), policy=policy)
    return ClusterBackend(fake, model_name="fake", max_model_len=4096, tokenizer=None,
                          router=router, config=DriverConfig(load_interval_s=0.05, **kw))


async def _run(backend: ClusterBackend, rid: str, prompt: list[int], n: int):
    deltas = []
    async for d in backend.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=n)):
        deltas.append(d)
    return deltas


def _check_tiling(deltas, prompt, n) -> None:
    index = 0
    for d in deltas:
        assert d.index == index
        index += len(d.token_ids)
    assert [t for d in deltas for t in d.token_ids] == expected(prompt, n)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert deltas[-1].num_cached_tokens == 3


@pytest.mark.parametrize("replay", [False, True], ids=["plain", "replayed"])
async def test_tokens_once_in_order(replay):
    fake = FakeClient(replay=replay)
    backend = _backend(fake)
    try:
        prompts = [[i + 1] * (5 + i) for i in range(12)]
        results = await asyncio.gather(*(_run(backend, f"r{i}", p, 9)
                                         for i, p in enumerate(prompts)))
        for p, deltas in zip(prompts, results):
            _check_tiling(deltas, p, 9)
        assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads
    finally:
        await backend.close()
    assert fake.closed


async def test_placement_follows_the_router():
    fake = FakeClient(dp=4)
    backend = _backend(fake)
    try:
        shared = list(range(1, 33))  # 8 full pages
        await _run(backend, "first", shared + [40, 41], 3)
        for i in range(4):  # one after another, load ~0: the prefix decides
            await _run(backend, f"again{i}", shared + [50 + i], 3)
        await asyncio.gather(*(_run(backend, f"c{i}", [100 + i] * 9, 4) for i in range(8)))
        router: SpyRouter = backend.router
        assert fake.placed == router.decisions
        groups = {router.decisions[f"again{i}"][0] for i in range(4)}
        assert groups == {router.decisions["first"][0]}
        assert router.decode.inflight() == []
    finally:
        await backend.close()


async def test_incremental_prefix_reports_drop_only_evicted_pages():
    """Leaders that report evictions instead of full lists: the router keeps the pages
    nobody evicted and drops exactly the evicted ones (with the pages below them)."""
    fake = FakeClient(dp=2, evicted={})
    backend = _backend(fake, prefix_interval_s=0.02)
    try:
        shared = list(range(1, 33))  # 8 full pages
        await _run(backend, "first", shared + [40, 41], 3)
        router: SpyRouter = backend.router
        group = router.decisions["first"][0]
        hashes = page_hashes(shared, PAGE)
        await _until(lambda: len(router.forgotten) >= 3)  # a few empty reports went by
        assert backend.router.decode.tree.match(shared).get(group) == len(shared)
        fake.evicted = {group: set(hashes[4:])}  # the last four pages of the prompt left
        await _until(lambda: any(g == group and e for g, e in list(router.forgotten)))
        await _until(lambda: backend.router.decode.tree.match(shared).get(group) == 4 * PAGE)
    finally:
        await backend.close()


async def _until(predicate, timeout: float = 10.0) -> None:
    """Poll `predicate` (it reads router state the driver thread mutates: a read that
    races a mutation counts as not yet)."""
    def holds() -> bool:
        try:
            return bool(predicate())
        except RuntimeError:  # dictionary changed size during iteration
            return False

    async with asyncio.timeout(timeout):
        while not holds():
            await asyncio.sleep(0.01)


async def test_disaggregated_placement_and_release():
    fake = FakeClient(dp=2, prefill_instances=2)
    backend = _backend(fake, policy="round_robin")
    try:
        await asyncio.gather(*(_run(backend, f"d{i}", [i + 1] * 6, 5) for i in range(6)))
        router: SpyRouter = backend.router
        assert fake.placed == router.decisions
        assert sorted(g for g, _ in router.decisions.values()) == [0, 0, 0, 1, 1, 1]
        assert sorted(p for _, p in router.decisions.values()) == [0, 0, 0, 1, 1, 1]
        assert router.decode.inflight() == [] and router.prefill.inflight() == []
        for _ in range(200):
            if backend.stats().get("router_decisions") == 6:
                break
            await asyncio.sleep(0.01)
        stats = backend.stats()
        assert stats["router_decisions"] == 6 and stats["num_prefill_instances"] == 2
        assert stats["kv_usage"] == pytest.approx(0.25) and stats["healthy"] == 1.0
        assert stats["prefix_hit_rate"] == 0.0  # prompts run on the prefill side here
    finally:
        await backend.close()


async def test_gap_fails_only_that_request():
    fake = FakeClient(gap_for="bad")
    backend = _backend(fake)
    try:
        good = asyncio.create_task(_run(backend, "good", [3, 4, 5], 6))
        with pytest.raises(RuntimeError, match="inconsistent output"):
            await _run(backend, "bad", [6, 7], 6)
        _check_tiling(await good, [3, 4, 5], 6)
        assert "bad" in fake.aborted and backend.healthy()
    finally:
        await backend.close()


async def test_refused_request_raises_valueerror_before_any_delta():
    backend = _backend(FakeClient())
    try:
        with pytest.raises(ValueError, match="^prompt"):
            await _run(backend, "x", [1, VOCAB + 5], 3)
        with pytest.raises(ValueError):
            await _run(backend, "empty", [], 3)
        assert backend.router.decode.inflight() == []
        _check_tiling(await _run(backend, "x", [1, 2], 3), [1, 2], 3)  # the id is free again
    finally:
        await backend.close()


async def test_consumer_leaving_aborts():
    fake = FakeClient()
    backend = _backend(fake)
    try:
        agen = backend.generate("leave", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
        async with aclosing(agen):
            first = await agen.__anext__()
            assert first.index == 0
        for _ in range(500):
            if "leave" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "leave" in fake.aborted
        assert backend.router.decode.inflight() == []
    finally:
        await backend.close()


async def test_close_aborts_what_is_in_flight():
    fake = FakeClient()
    backend = _backend(fake)
    agen = backend.generate("long", [9, 9], SamplingParams(temperature=0, max_tokens=10_000))
    first = await agen.__anext__()
    await backend.close()
    rest = [d async for d in agen]
    assert first.index == 0 and rest[-1].finish_reason == "abort"
    assert fake.closed and "long" in fake.aborted and not backend.healthy()
    with pytest.raises(RuntimeError, match="closed"):
        await _run(backend, "after", [1], 2)


async def test_group_failure_is_503_and_unhealthy():
    fake = FakeClient()
    backend = _backend(fake)
    try:
        agen = backend.generate("victim", [5, 5], SamplingParams(temperature=0, max_tokens=10_000))
        await agen.__anext__()
        fake.fail = GroupFailure(1, [RankDeath(1, 1, "process died")])
        with pytest.raises(OpenAIError) as err:
            async for _ in agen:
                pass
        assert err.value.status == 503 and err.value.code == "backend_failed"
        assert "rank 1: process died" in err.value.message
        assert not backend.healthy() and backend.stats()["healthy"] == 0.0
        with pytest.raises(OpenAIError):
            await _run(backend, "later", [1, 2], 2)
    finally:
        await backend.close()
    assert fake.closed


def test_failed_cluster_answers_503_over_http(tiny_model):
    from transformers import AutoTokenizer

    fake = FakeClient()
    backend = ClusterBackend(fake, model_name="fake", max_model_len=512,
                             tokenizer=AutoTokenizer.from_pretrained(tiny_model))
    srv = BackgroundServer(lambda: create_app(backend)).start()

    async def check() -> None:
        body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 3}
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 3
            fake.fail = GroupFailure(1, [RankDeath(0, 1, "process died")])
            for _ in range(1000):
                async with s.get(srv.url + "/health") as r:
                    if r.status == 503:
                        break
                await asyncio.sleep(0.01)
            assert r.status == 503
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 503
                err = (await r.json())["error"]
                assert err["type"] == "server_error" and err["code"] == "backend_failed"
            async with s.get(srv.url + "/metrics") as r:
                assert "phalanx_backend_healthy 0.0" in await r.text()

    try:
        asyncio.run(check())
    finally:
        srv.run(backend.close())
        srv.stop()
