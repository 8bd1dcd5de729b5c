"""The EP width changed while serving (issue 28): through the SDK's in-process client (the
server's request path: driver thread, router, request records) on a colocated DP=4
layout, and on the disaggregated layout's DP=4 decode side (one prefill instance,
untouched), each starting as two DP×EP groups of two. The `cost_model` policy reads cost tables
from a file; under a burst of requests it moves to one group of four, and back to two
groups once the burst is over, while two long streams run through both changes. Every
stream, greedy or seeded sampled, equals the single-rank engine's, each token once."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from phalanx import LLM, SamplingParams
from phalanx.chaos.drill import streamed_requests
from phalanx.models.loader import read_model_config
from phalanx.policies.ep_cost import CostTables, Grid
from phalanx.server import start_local

pytestmark = pytest.mark.slow

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=256, page_size=4, num_pages=600)


def crossover_tables() -> CostTables:
    """Test input, not a measurement: costs under which two groups of two win at light
    load and one group of four under a burst (a narrow group computes more distinct
    experts per rank; the wide one pays a larger exchange; one-rank groups are costly)."""
    widths = (1.0, 2.0, 4.0)
    return CostTables(
        exchange=Grid(widths, (1.0, 64.0), ((0.0, 0.0), (0.0, 0.0), (2000.0, 2000.0))),
        experts=Grid((0.0, 16.0), (0.0, 1024.0), ((0.0, 0.0), (16000.0, 16000.0))),
        attention=Grid((0.0,), (0.0,), ((0.0,),)),
        overhead=Grid(widths, (0.0,), ((10000.0,), (0.0,), (0.0,))),
        source="test input")


@pytest.fixture(scope="module")
def workload(tiny_model):
    """Two long streams (320 tokens: at the move back they are a third of the way in, or
    less), a burst of 28 short ones, and the single-rank engine's texts of all of them
    (one reference pass for both layouts)."""
    vocab = read_model_config(tiny_model).vocab_size
    rng = random.Random(3)
    long = streamed_requests(2, vocab, 320, rng)
    burst = streamed_requests(28, vocab, 40, rng)
    offline = LLM(tiny_model, **ENGINE)
    outs = offline.generate(prompt_token_ids=[r[0] for r in long + burst],
                            sampling_params=[SamplingParams(**body) for _, body in long + burst])
    return long, burst, [offline.decode(o.outputs[0].token_ids) for o in outs]


async def _text(client, prompt, body) -> str:
    return "".join([c.text async for c in client.stream(prompt, **body)])


def _layouts(client) -> tuple[str, int]:
    group = client.backend._driver._client
    side = getattr(group, "decodes", None)  # the disaggregated layout's decode side
    return str(group.layout if side is None else side.layout), group.reshapes


async def _until(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.1)
    return False


# The disaggregated decode side's policy also counts the requests still queued for or
# inside the prefill instance (`DisaggClient._upstream`): without them it read a light load
# right after each change and narrowed, then widened again, for as long as the burst lasted.
@pytest.mark.parametrize("layout", [dict(tp=1, dp=4), dict(prefill_tp=1, decode_dp=4)],
                         ids=["colocated", "disaggregated"])
async def test_cost_model_moves_two_groups_to_one_and_back_mid_stream(tiny_model, tmp_path,
                                                                     workload, layout):
    long, burst, references = workload
    costs = tmp_path / "costs.json"
    costs.write_text(crossover_tables().to_json())
    client = start_local(tiny_model, model_name="tiny", **layout, ep_policy="cost_model",
                         ep_groups=2, ep_costs=str(costs), collective_timeout_s=10.0,
                         ep_options={"interval_s": 0.3, "min_interval_s": 0.0, "margin": 0.1,
                                     "itl_target_ms": 1e6}, **ENGINE)
    try:
        assert _layouts(client) == ("2x2", 0)
        seen: list[str] = []

        async def watch() -> None:
            while True:
                layout = _layouts(client)[0]
                if not seen or seen[-1] != layout:
                    seen.append(layout)
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        streams = [asyncio.create_task(_text(client, p, b)) for p, b in long]
        await asyncio.sleep(1.0)
        assert _layouts(client) == ("2x2", 0), "two light streams keep two groups"
        burst_texts = await asyncio.gather(*(_text(client, p, b) for p, b in burst))
        wide = _layouts(client)
        assert wide[1] >= 1, "the burst widened the layout to one group"
        assert await _until(lambda: _layouts(client)[0] == "2x2" and _layouts(client)[1] >= 2,
                            60.0), _layouts(client)
        assert not all(s.done() for s in streams), "the long streams ran through both changes"
        long_texts = await asyncio.gather(*streams)
        watcher.cancel()
        changes = client.backend._driver._client.ep.changes  # decisions that changed it
    finally:
        await client.close()
    print("layouts seen:", seen)
    assert "1x4" in seen, seen
    assert changes == 2, f"one change each way, no flapping: {changes} changes, seen {seen}"
    assert long_texts + burst_texts == references
