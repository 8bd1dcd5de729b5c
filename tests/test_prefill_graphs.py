"""Prefill graphs (engine/prefill_graphs.py) on CPU: the buckets, and the replay's
padding. A stand-in graph re-runs the captured forward over the static buffers, so the
CPU checks exactly what the GPU replays read: a workload of prefix hits, chunked prompts,
mixed steps and sampled rows gives the eager engine's tokens with most steps replayed,
and a step that does not fit runs eagerly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phalanx.config import EngineConfig
from phalanx.engine.llm_engine import LLMEngine
from phalanx.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from phalanx.engine.sampling_params import SamplingParams
from phalanx.llm import engine_config


def test_buckets():
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(15) == [] and prefill_buckets(0) == []


class _Replay:
    """Stands in for a captured CUDA graph on CPU: replaying runs the forward again over
    the same static buffers into the same output tensor."""

    def __init__(self, graphs: PrefillGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.logits[self.size].copy_(self.graphs._forward(self.size))


def _with_graphs(engine: LLMEngine, max_tokens: int) -> PrefillGraphs:
    r = engine.runner
    graphs = PrefillGraphs(r.model, r.caches, max_tokens, engine.config.scheduler.max_num_seqs,
                           engine.config.max_model_len, r.page_size, torch.device("cpu"))
    with torch.inference_mode():
        for size in graphs.sizes:
            graphs.logits[size] = graphs._forward(size).clone()
            graphs.graphs[size] = _Replay(graphs, size)
    r.prefill_graphs = graphs
    return graphs


def _run(engine: LLMEngine, waves: list[list[tuple[str, list[int], SamplingParams]]]
         ) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for wave in waves:
        for rid, prompt, params in wave:
            engine.add_request(rid, prompt, params)
        for _ in range(3):  # the next wave arrives while these decode: mixed steps
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.pool.check_integrity()
    return tokens


def _waves() -> list[list]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 2040, (37,), generator=g).tolist()
    waves = []
    for w in range(4):
        wave = []
        for i in range(3):
            n = int(torch.randint(1, 30, (1,), generator=g))
            tail = torch.randint(3, 2040, (n,), generator=g).tolist()
            prompt = (shared + tail) if i != 2 else tail * (w + 1)  # hits and fresh prompts
            params = (SamplingParams(temperature=0.9, top_k=40, seed=7 + i + w, max_tokens=6,
                                     ignore_eos=True) if i == 1 else
                      SamplingParams(temperature=0.0, max_tokens=5 + w, ignore_eos=True))
            wave.append((f"w{w}r{i}", prompt, params))
        waves.append(wave)
    waves.append([("long", torch.randint(3, 2040, (90,), generator=g).tolist(),
                   SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))])
    return waves


@pytest.mark.parametrize("max_num_seqs", [8, 24])  # 24: bucket 16 has fewer rows
def test_replayed_steps_give_the_eager_tokens(tiny_model, max_num_seqs):
    cfg = engine_config(tiny_model, page_size=4, max_num_batched_tokens=32,
                        max_num_seqs=max_num_seqs)
    want = _run(LLMEngine(cfg), _waves())
    engine = LLMEngine(cfg)
    graphs = _with_graphs(engine, 32)
    eager = []
    run_eager = engine.runner._run_eager
    engine.runner._run_eager = lambda inputs, *a, **k: (eager.append(inputs.decode_only),
                                                        run_eager(inputs, *a, **k))[1]
    got = _run(engine, _waves())
    assert got == want
    # every step that is not decode-only fits a bucket of 32 (steps carry <= 32 tokens)
    assert graphs.replays >= 10 and eager and all(eager)


def test_a_step_past_the_buckets_is_refused(tiny_model):
    engine = LLMEngine(engine_config(tiny_model, page_size=4, max_num_seqs=4))
    graphs = _with_graphs(engine, 16)
    assert graphs.fits(16, 4, 4) and not graphs.fits(17, 1, 1) and not graphs.fits(8, 5, 1)
    assert not graphs.fits(0, 0, 0) and not graphs.fits(3, 1, 5)  # more logits than rows
    host = {"input_ids": torch.zeros(17, dtype=torch.int64)}
    host.update(seq_lens=torch.ones(1, dtype=torch.int32),
                logits_indices=torch.zeros(1, dtype=torch.int64),
                block_tables=torch.zeros((1, 16), dtype=torch.int32))
    with pytest.raises(ValueError, match="fits no bucket"):
        graphs.run(host)


def test_config_refuses_a_bucket_under_16(tiny_model):
    cfg = engine_config(tiny_model)
    with pytest.raises(ValueError, match="cuda_graph_max_prefill"):
        dataclasses.replace(cfg, cuda_graph_max_prefill=8)
    assert isinstance(dataclasses.replace(cfg, cuda_graph_max_prefill=0), EngineConfig)
