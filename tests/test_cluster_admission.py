"""The cluster driver with admission on (`DriverConfig.admission`): requests wait at the
router until a DP group has room, every token still arrives once and in order, a held
request that is aborted never reaches a rank, and a failure ends held requests too.
Fake in-thread client (tests/test_server_cluster_backend.py), no Ray, no model."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass

import pytest

from phalanx.actors.supervisor import GroupFailure, RankDeath
from phalanx.engine.sampling_params import SamplingParams
from phalanx.router.admission import AdmissionConfig
from phalanx.server import OpenAIError
from phalanx.server.cluster_backend import ClusterBackend
from phalanx.server.cluster_driver import DriverConfig
from test_server_cluster_backend import PAGE, FakeClient, SpyRouter, _check_tiling, _run


@dataclass
class CountingClient(FakeClient):
    """Remembers the most requests any group ran at once."""

    most: int = 0

    def submit(self, rid, tokens, params, placement) -> None:
        super().submit(rid, tokens, params, placement)
        g = placement.dp_group
        self.most = max(self.most, sum(1 for r in self.reqs if self.placed[r][0] == g))


def _backend(fake: FakeClient, **admission) -> ClusterBackend:
    router = SpyRouter(page_size=PAGE, groups=range(fake.dp), policy="prefix_aware")
    config = DriverConfig(load_interval_s=0.05, admission=AdmissionConfig(**admission))
    return ClusterBackend(fake, model_name="fake", max_model_len=4096, tokenizer=None,
                          router=router, config=config)


async def _until_one_is_held(backend: ClusterBackend) -> None:
    """Waits (up to 2 s) for the published stats to show one request held at the router."""
    for _ in range(200):
        if backend.stats().get("num_held") == 1.0:
            return
        await asyncio.sleep(0.01)
    assert backend.stats()["num_held"] == 1.0


def test_driver_config_takes_a_mapping_and_refuses_other_things():
    assert DriverConfig(admission={"max_requests": 3}).admission == AdmissionConfig(max_requests=3)
    with pytest.raises(TypeError, match="admission"):
        DriverConfig(admission=3)
    with pytest.raises(ValueError, match="AdmissionConfig"):
        DriverConfig(admission={"max_requests": -2})


async def test_held_requests_all_complete_once_in_order_and_groups_stay_under_the_bound():
    fake = CountingClient(dp=2)
    backend = _backend(fake, max_requests=2)
    try:
        prompts = [[i + 1] * (5 + i) for i in range(12)]
        results = await asyncio.gather(*(_run(backend, f"r{i}", p, 9)
                                         for i, p in enumerate(prompts)))
        for p, deltas in zip(prompts, results):
            _check_tiling(deltas, p, 9)
        assert fake.most == 2  # 12 requests at once, never more than 2 on a group
        assert backend.router.decode.inflight() == [] and len(fake.placed) == 12
        driver = backend._driver
        assert driver.admission.placed == 12 and len(driver.admission) == 0
    finally:
        await backend.close()


async def test_a_held_request_that_is_aborted_never_reaches_a_rank():
    fake = CountingClient(dp=1)
    backend = _backend(fake, max_requests=1)
    try:
        busy = backend.generate("busy", [3, 3], SamplingParams(temperature=0, max_tokens=10_000))
        await busy.__anext__()
        waiting = backend.generate("held", [4, 4], SamplingParams(temperature=0, max_tokens=5))
        task = asyncio.ensure_future(waiting.__anext__())
        await _until_one_is_held(backend)
        assert "held" not in fake.placed
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await waiting.aclose()
        async with aclosing(busy):
            pass
        for _ in range(500):
            if "busy" in fake.aborted and not backend._driver.admission:
                break
            await asyncio.sleep(0.01)
        assert "held" not in fake.placed and len(backend._driver.admission) == 0
        _check_tiling(await _run(backend, "next", [1, 2], 3), [1, 2], 3)
    finally:
        await backend.close()


async def test_a_failure_ends_held_requests_with_503():
    fake = CountingClient(dp=1)
    backend = _backend(fake, max_requests=1)
    try:
        live = backend.generate("live", [5, 5], SamplingParams(temperature=0, max_tokens=10_000))
        await live.__anext__()
        held = asyncio.ensure_future(_run(backend, "held", [6, 6], 4))
        await _until_one_is_held(backend)
        fake.fail = GroupFailure(1, [RankDeath(1, 1, "process died")])
        with pytest.raises(OpenAIError) as err:
            await held
        assert err.value.status == 503 and "held" not in fake.placed
        with pytest.raises(OpenAIError):
            async for _ in live:
                pass
    finally:
        await backend.close()


def test_the_servers_hold_follows_the_engines_batch_unless_told():
    from phalanx.config import SchedulerConfig
    from phalanx.server.launch import admission_for

    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024)
    auto = admission_for(sched)
    assert (auto.max_requests, auto.max_queued_tokens) == (17, 2048) and auto.holds
    assert admission_for(sched, 3).max_requests == 3
    assert not admission_for(sched, 0).holds
    with pytest.raises(ValueError, match="router_hold"):
        admission_for(sched, -1)


def test_serve_refuses_a_negative_hold():
    from phalanx.cli import build_parser
    from phalanx.server.serve_checks import check_serve_args

    args = build_parser().parse_args(["serve", "--router-hold", "-2"])
    with pytest.raises(ValueError, match="--router-hold"):
        check_serve_args(args)
