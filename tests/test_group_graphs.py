"""Which steps of a DP×EP group replay CUDA graphs (`GroupGraphs`: the decision is
host logic, tested here without a GPU; the replays themselves run in
tests/test_gpu_groups.py)."""

from __future__ import annotations

import dataclasses

from phalanx.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from phalanx.actors.rank.group_graphs import GroupGraphs
from phalanx.llm import engine_config


def _group(max_batch: int) -> GroupGraphs:
    """A GroupGraphs whose graphs hold every size up to `max_batch` (nothing captured)."""
    graphs = object.__new__(DecodeGraphs)
    graphs.sizes = graph_batch_sizes(max_batch)
    graphs.graphs = dict.fromkeys(graphs.sizes)
    group = object.__new__(GroupGraphs)
    group.graphs = graphs
    return group


def test_every_rank_replays_the_size_of_the_largest_batch():
    group = _group(64)
    assert [group.size(t, 0) for t in (0, 1, 3, 8, 9, 64)] == [1, 1, 4, 8, 16, 64]
    assert group.size(65, 0) is None  # past the largest graph: every rank eager
    assert group.size(3, 1) is None  # some rank's batch is not decode-only


def test_only_peer_groups_of_tp_1_on_gpu_capture(tiny_model):
    gpu = engine_config(tiny_model, dp=2, device="cpu", ep_exchange="peer")
    gpu = dataclasses.replace(gpu, device="cuda")  # the decision reads the config only
    channels = (object(), object())
    assert GroupGraphs.wanted(gpu, 1, channels)
    assert not GroupGraphs.wanted(gpu, 2, channels)  # TP all-reduces poll from the host
    assert not GroupGraphs.wanted(gpu, 1, ())  # exact / padded: host-polled collectives
    assert not GroupGraphs.wanted(dataclasses.replace(gpu, enforce_eager=True), 1, channels)
    assert not GroupGraphs.wanted(dataclasses.replace(gpu, cuda_graph_max_batch=0), 1, channels)
    assert not GroupGraphs.wanted(dataclasses.replace(gpu, device="cpu"), 1, channels)
