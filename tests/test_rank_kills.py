"""Rank processes SIGKILLed from outside (pids from Ray's state) at seeded random moments
of a streamed load through the SDK (`start_local`: the server's own request path, driver
thread, router and request records), in the default disaggregated layout and a
colocated DP×EP group: a second death while the group re-forms (three times in a row),
two ranks at once, a prefill and a decode rank at once, a decode rank while the prefill
instance re-forms. Every stream, greedy or seeded
sampled, must equal the fault-free single-rank run, each token once; afterwards no rank
actor or placement group of a dead epoch is left and every KV pool is back to empty.
Past the restart intensity the streams end with clean 503s and the backend is unhealthy;
deaths spread wider than the window are survived."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from phalanx import LLM, SamplingParams
from phalanx.chaos.drill import Kill, run_drill, streamed_requests
from phalanx.chaos.ranks import rank_processes, sigkill
from phalanx.models.loader import read_model_config
from phalanx.sdk import APIError
from phalanx.server import start_local

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 96
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, page_size=4, num_pages=600)
MODEL = "tiny"


@pytest.fixture(scope="module")
def workload(tiny_model):
    """16 requests, half greedy, half seeded sampling at temperature 0.8, and their
    fault-free texts from the single-rank engine."""
    vocab = read_model_config(tiny_model).vocab_size
    requests = streamed_requests(STREAMS, vocab, MAX_TOKENS, random.Random(11))
    offline = LLM(tiny_model, **ENGINE)
    outs = offline.generate(prompt_token_ids=[r[0] for r in requests],
                            sampling_params=[SamplingParams(**body) for _, body in requests])
    return requests, [offline.decode(o.outputs[0].token_ids) for o in outs]


def _client(tiny_model, layout: dict, **kw):
    return start_local(tiny_model, model_name=MODEL, collective_timeout_s=5.0, **layout,
                       **ENGINE, **kw)


def _left_behind(client) -> dict:
    """Rank actors and placement groups beyond those of the live epochs, and KV pages
    still in use, once every request has ended."""
    driver = client.backend._driver
    group = driver._client
    sups = ([*group.decode_groups, *group.prefill] if hasattr(group, "prefill")
            else group.supervisors)
    live_pids = {p for s in sups for p in s.pids}
    alive = [r.pid for r in rank_processes()]
    pgs = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
    group.leader_stats()  # TimeoutError while a group is still re-forming
    # Every leader's KV pool passes check_integrity and has every page free again.
    pools = ray.get([s.leaders[i].kv_check.remote() for s in sups for i in range(s.dp)])
    return {"extra_ranks": sorted(set(alive) - live_pids),
            "missing_ranks": sorted(live_pids - set(alive)),
            "extra_pgs": len(pgs) - sum(s.dp for s in sups),
            "kv_used": [p for p in pools if p["free"] != p["pages"]]}


def _settled_view(client, timeout_s: float = 30.0) -> dict:
    """`_left_behind` once the layout serves again (the driver re-forms lazily)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return _left_behind(client)
        except TimeoutError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


LAYOUTS = {"disagg": {}, "dp2": dict(dp=2)}
PLANS = {
    # a decode rank first: every stream waits for its group, so the streams are still
    # open while the later kills land (a prefill death alone lets decoding go on)
    "death-during-reformation-x3": [Kill(role="decode")] + [Kill(during_formation=True)] * 3,
    "two-at-once": [Kill(role=("decode", "decode"))],
    "prefill-and-decode-at-once": [Kill(role=("prefill", "decode"))],
    # the decode group loses a rank while the prefill instance re-forms (seconds)
    "decode-dies-while-prefill-reforms": [Kill(role="prefill"), Kill(role="decode", delay_s=(0.2, 0.5))],
    "dp2-death-during-reformation-x3": [Kill()] + [Kill(during_formation=True)] * 3,
    "dp2-two-at-once": [Kill(role=("group", "group"))],
}


class SharedClients:
    """One client per layout, shared by the kill plans of this module: each plan starts
    on the layout the previous plan left (re-formed, settled and checked clean by
    `_settled_view`), so a layout that went through a drill must serve the next one with
    the same tokens. Their budget is wide (50 re-formations per 600 s): these plans
    check survival, the budget has tests of its own below. A plan that fails closes its
    client, so the next plan starts on a fresh one; so does the layout's last plan."""

    def __init__(self, tiny_model: str) -> None:
        self.tiny_model, self.clients = tiny_model, {}

    async def get(self, layout: str):
        """The layout's client; any other layout's is closed first (a drill's killer and
        `_left_behind` see every rank process on this machine)."""
        for other in [k for k in self.clients if k != layout]:
            await self.discard(other)
        if layout not in self.clients:
            self.clients[layout] = _client(self.tiny_model, LAYOUTS[layout], max_recoveries=50)
        return self.clients[layout]

    async def discard(self, layout: str) -> None:
        client = self.clients.pop(layout, None)
        if client is not None:
            await client.close()


@pytest.fixture(scope="module")
def shared(tiny_model):
    clients = SharedClients(tiny_model)
    yield clients
    for layout in list(clients.clients):
        asyncio.run(clients.discard(layout))


@pytest.mark.parametrize("name", list(PLANS))
async def test_streams_survive_external_kills(shared, workload, name):
    requests, references = workload
    layout = _layout_of(name)
    client = await shared.get(layout)
    try:
        await _drill_and_check(client, requests, references, name)
    except BaseException:
        await shared.discard(layout)
        raise
    if name == [n for n in PLANS if _layout_of(n) == layout][-1]:
        await shared.discard(layout)  # its last plan: no idle ranks beside the next tests


def _layout_of(plan: str) -> str:
    return "dp2" if plan.startswith("dp2") else "disagg"


async def _drill_and_check(client, requests, references, name: str) -> None:
    """`PLANS[name]` against `client`: every stream equal to its reference, each kill
    carried out, nothing left behind once the layout serves again."""
    since = time.time()
    report = await run_drill(client, requests, references, PLANS[name], seed=7)
    summary = report.summary()
    print(name, summary)
    assert not report.killer_error, summary
    assert report.kills and len(report.kills) == sum(
        len(k.role) if isinstance(k.role, tuple) else k.count for k in PLANS[name]), summary
    assert report.identical == STREAMS and not report.errors, summary
    recovery = client.backend._driver._client.recovery
    if "during-reformation" in name:  # the later kills landed while it re-formed
        assert sum(e[1] == "form_failed" and e[0] >= since for e in recovery.events) >= 1, \
            recovery.events
    assert client.backend.healthy()
    left = _settled_view(client)
    assert left == {"extra_ranks": [], "missing_ranks": [], "extra_pgs": 0, "kv_used": []}, left


async def test_past_the_intensity_503_and_unhealthy(tiny_model, workload):
    """R=1 within 60 s: the first death is re-formed; a second one, while that formation
    runs, is one too many: every open stream ends with a clean 503 and the backend turns
    unhealthy."""
    requests, references = workload
    client = _client(tiny_model, {}, max_recoveries=1, recovery_window_s=60.0)
    try:
        report = await run_drill(client, requests, references,
                                 [Kill(role="decode"), Kill(during_formation=True)], seed=5)
        summary = report.summary()
        print(summary)
        assert len(report.kills) == 2, summary
        assert report.errors and all(status == 503 and code == "backend_failed"
                                     for _, status, code in report.errors), summary
        assert not report.mismatched, summary  # what finished before the end is exact
        assert not client.backend.healthy()
        with pytest.raises(APIError) as err:
            await client.complete(requests[0][0], max_tokens=4)
        assert err.value.status == 503
    finally:
        await client.close()


async def test_deaths_wider_apart_than_the_window_are_survived(tiny_model, workload):
    """R=1 within 4 s: two deaths more than 4 s apart are both recovered."""
    requests, references = workload
    client = _client(tiny_model, {}, max_recoveries=1, recovery_window_s=4.0)
    recovery = client.backend._driver._client.recovery
    try:
        for round_ in range(2):
            if round_:  # the first re-formation began before it formed: > 4 s ago then
                formed = max(e[0] for e in recovery.events if e[1] == "formed")
                await asyncio.sleep(max(0.0, formed + 4.5 - time.time()))
            report = await run_drill(client, requests[:4], references[:4], [Kill(role="decode")],
                                     seed=round_)
            assert report.identical == 4 and not report.errors, report.summary()
        assert client.backend.healthy()
        assert recovery.recoveries == 2
    finally:
        await client.close()


async def test_node_lost_narrows_then_widens_back(tiny_model, workload):
    """A two-worker-node Ray cluster (one CPU per node: every rank on its own node). The
    node of a decode rank leaves: no room for a second decode rank, so the decode group
    re-forms at DP=1 (every expert on the one rank) and the streams finish with the same
    tokens; the node comes back: the group widens back to DP=2, and serves the same
    tokens again. /metrics shows the width throughout."""
    from ray.cluster_utils import Cluster

    requests, references = workload
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    client = None
    try:
        client = _client(tiny_model, {}, replace_timeout_s=3.0)
        group = client.backend._driver._client
        decode_nodes = group.rank_nodes()["decode"]
        victim = next(w for w in workers if w.node_id in decode_nodes)

        async def remove_node_mid_stream():
            await asyncio.sleep(0.3)
            cluster.remove_node(victim)

        drill = asyncio.ensure_future(run_drill(client, requests, references, [], seed=0))
        await remove_node_mid_stream()
        report = await drill
        assert report.identical == STREAMS and not report.errors, report.summary()
        assert group.decode.dp == 1, group.recovery.events
        assert any(e[1] == "formed" and "width 1" in e[4] for e in group.recovery.events)
        stats = await _stats_when(client, lambda s: s.get("width") == 1.0)
        assert stats["desired_width"] == 2.0

        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        for _ in range(300):  # widened back at a poll, within a few seconds
            await client.complete(requests[0][0], max_tokens=2)
            if group.decode.dp == 2 and group.recovery.serving("decode0"):
                break
            await asyncio.sleep(0.1)
        assert group.decode.dp == 2, group.recovery.events
        report = await run_drill(client, requests, references, [], seed=0)
        assert report.identical == STREAMS and not report.errors, report.summary()
        stats = await _stats_when(client, lambda s: s.get("width") == 2.0)
        assert client.backend.healthy()
    finally:
        if client is not None:
            await client.close()
        ray.shutdown()
        cluster.shutdown()


async def _stats_when(client, ok, timeout_s: float = 20.0) -> dict:
    """The backend's stats once `ok(stats)` (the driver refreshes them every ~0.5 s)."""
    end = time.monotonic() + timeout_s
    while True:
        stats = client.backend.stats()
        if ok(stats) or time.monotonic() > end:
            return stats
        await client.complete([1, 2, 3], max_tokens=1)
        await asyncio.sleep(0.2)
