"""GPU path: greedy tokens of the tiny model on the GPU equal the CPU engine's.

Skipped without a CUDA device (CI); run on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from phalanx import LLM, SamplingParams

from test_hf_oracle import make_prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    gc.collect()
    torch.cuda.empty_cache()
    yield


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tiny_model_gpu_tokens_equal_cpu(tiny_model, eager):
    prompts = make_prompts(2048, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=96, page_size=4, num_pages=200)
    cpu = LLM(tiny_model, device="cpu", **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    gpu_llm = LLM(tiny_model, device="cuda", dtype="float32", enforce_eager=eager, **kw)
    gpu = gpu_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}"
    assert gpu_llm.engine.stats()["num_preemptions"] > 0
    assert (gpu_llm.engine.runner.graphs is None) == eager


def test_seeded_sampling_gpu_alone_and_in_batch(tiny_model):
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", page_size=16, num_pages=2000)
    target = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=5, ignore_eos=True)
    prompt = list(range(100, 160))
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=target)[0].outputs[0].token_ids
    others = [list(range(i, i + 30 + 7 * i)) for i in range(7)]
    batch = llm.generate(prompt_token_ids=others + [prompt],
                         sampling_params=[SamplingParams(temperature=1.0, max_tokens=25, seed=i,
                                                         ignore_eos=True) for i in range(7)] + [target])
    assert batch[-1].outputs[0].token_ids == alone


def test_kv_pool_sized_from_free_memory(tiny_model):
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    page_bytes = 4 * 2 * 2 * 16 * 16 * 2  # layers x (K, V) x kv_heads x page_size x head_dim x bf16
    assert llm.engine.num_pages * page_bytes > 0.3 * total, "about half the device for the KV cache"
    assert free > 0.3 * total, "and no more than that"


def test_small_batch_after_larger_graphs_keeps_its_tokens(tiny_model):
    """The CUDA graphs share one memory pool; replaying the larger ones must not disturb
    what the small ones keep across launches (the MoE small path's arrival counters)."""
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", page_size=16, num_pages=2000,
              max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(50, 90))
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    others = [list(range(i, i + 20 + 3 * i)) for i in range(16)]
    llm.generate(prompt_token_ids=others, sampling_params=params)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    assert again == alone
