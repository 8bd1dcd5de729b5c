"""`phalanx serve --address ...` on a multi-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head and two worker nodes, one CPU each).

The default layout needs three ranks of one CPU each (prefill TP=1, decode DP=2), so
every rank lands on its own node whatever Ray's placement policy: the decode ranks sit
on two different nodes, and each prompt's KV crosses nodes on its way from prefill to
decode. Greedy outputs equal the offline single-rank `LLM`'s; SIGTERM shuts the server
down cleanly and leaves the cluster itself running (the server only disconnects).
"""

from __future__ import annotations

import asyncio
import signal

import pytest
from openai import AsyncOpenAI

from phalanx import LLM

from serve_process import ServeProcess
from test_server import _prompts, _reference

MODEL = "tiny-multinode"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def serve(cluster, tiny_model, tmp_path_factory):
    proc = ServeProcess(["--model", tiny_model, "--port", "0", "--served-model-name", MODEL,
                         "--address", cluster.address, "--num-pages", "256"],
                        tmp_path_factory.mktemp("serve-multinode"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def test_decode_ranks_on_two_nodes(serve, cluster):
    nodes = {n.node_id for n in cluster.list_all_nodes()}
    placement = serve.placement()
    decode = {node for side, _, node in placement if side == "decode"}
    prefill = {node for side, _, node in placement if side.startswith("prefill")}
    assert len(placement) == 3, serve.stderr()[-2000:]
    assert len(decode) == 2 and decode <= nodes
    assert len(prefill) == 1 and prefill <= nodes - decode


async def test_requests_complete_across_nodes(serve, tiny_model):
    prompts = _prompts(12)
    llm = LLM(tiny_model)
    try:
        refs = _reference(llm, prompts, 8)
    finally:
        llm.close()
    async with AsyncOpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
        async def one(prompt: str) -> str:
            text = ""
            async for chunk in await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True):
                text += chunk.choices[0].text
            return text

        streamed = await asyncio.gather(*(one(p) for p in prompts))
        whole = await client.completions.create(model=MODEL, prompt=prompts[:4], max_tokens=8,
                                                temperature=0)
    assert streamed == [text for text, _, _ in refs]
    assert [c.text for c in whole.choices] == [text for text, _, _ in refs[:4]]


def test_sigterm_leaves_the_cluster_running(serve, cluster):
    assert serve.interrupt(signal.SIGTERM) == 0, serve.stderr()[-4000:]
    assert "phalanx: stopped" in serve.stderr()
    assert cluster.remaining_processes_alive()
