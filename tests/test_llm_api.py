"""The offline API: seeded sampling, validation of bad input, streaming, the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from phalanx import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, page_size=8, num_pages=512, max_num_batched_tokens=256)


def _rand_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2040, (int(torch.randint(1, 80, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def test_seeded_request_same_alone_and_in_batch(llm):
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234,
                            ignore_eos=True)
    prompt = _rand_prompts(1, seed=7)[0]
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=target)[0].outputs[0].token_ids

    others = _rand_prompts(7, seed=8)
    other_params = [SamplingParams(temperature=t, max_tokens=m, seed=s, ignore_eos=True)
                    for t, m, s in zip([0, 1.0, 0.5, 1.3, 0, 0.7, 2.0], [5, 30, 12, 3, 40, 24, 9], range(7))]
    batch = llm.generate(prompt_token_ids=others[:3] + [prompt] + others[3:],
                         sampling_params=other_params[:3] + [target] + other_params[3:])
    assert batch[3].outputs[0].token_ids == alone
    assert len(set(alone)) > 3, "a sampled run should not be a constant stream"

    other_seed = llm.generate(prompt_token_ids=[prompt], sampling_params=target.with_seed(99))
    assert other_seed[0].outputs[0].token_ids != alone


def test_unseeded_sampling_runs_and_differs_between_requests(llm):
    p = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    prompt = _rand_prompts(1, seed=3)[0]
    a, b = llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=p)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[""]), "prompt"),
    (dict(prompt_token_ids=[[]]), "prompt"),
    (dict(prompt_token_ids=[[1, 2, 999999]]), "prompt_token_ids"),
    (dict(prompt_token_ids=[list(range(1024))]), "context"),
    (dict(prompts=["a", "b"], sampling_params=[SamplingParams()]), "sampling_params"),
    (dict(), "exactly one"),
    (dict(prompts=["a"], prompt_token_ids=[[1]]), "exactly one"),
    (dict(prompts=[3]), "prompts"),
])
def test_bad_input_raises_and_engine_stays_usable(llm, kwargs, match):
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=good)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=match):
        llm.generate(**kwargs)
    assert not llm.engine.has_unfinished(), "a refused batch must leave nothing queued"
    after = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=good)[0].outputs[0].token_ids
    assert after == before
    llm.engine.pool.check_integrity()


def test_bad_construction_arguments(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path))  # a folder without config.json
    with pytest.raises(ValueError, match="page_size"):
        LLM(tiny_model, page_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model, max_model_len=10**6)
    with pytest.raises(ValueError, match="max_recoveries"):
        LLM(tiny_model, max_recoveries=-1)
    with pytest.raises(ValueError, match="ep_exchange"):
        LLM(tiny_model, ep_exchange="auto")


def test_request_too_large_for_pool_is_refused(tiny_model):
    llm = LLM(tiny_model, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="num_pages"):
        llm.generate(prompt_token_ids=[list(range(40))], sampling_params=SamplingParams(max_tokens=4))
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) <= 4


def test_text_prompts_stream_and_stop_tokens(llm):
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate("The quick brown fox", p)
    assert out.prompt == "The quick brown fox"
    assert out.outputs[0].text == llm.decode(out.outputs[0].token_ids)
    assert list(llm.stream("The quick brown fox", p)) == out.outputs[0].token_ids

    stop_at = out.outputs[0].token_ids[4]
    first = out.outputs[0].token_ids.index(stop_at)
    stopped = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=10,
                                                                  stop_token_ids=[stop_at]))[0]
    assert stopped.outputs[0].token_ids == out.outputs[0].token_ids[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop"


def test_default_model_and_cli(tmp_path):
    env = dict(os.environ, PHALANX_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "phalanx.cli", "generate", "Hello there", "--max-tokens", "6", "--json"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(data["token_ids"]) <= 6 and data["prompt_token_ids"]
    assert (tmp_path / "cache" / "tiny-qwen3-moe-v2" / "config.json").is_file()

    res = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr

    bad = subprocess.run(cmd[:5] + ["--max-tokens", "0"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "max_tokens" in bad.stderr


@pytest.mark.slow
def test_cli_dp_layout_matches_single_rank(tiny_model, llm):
    """`--dp 2` runs two rank actors on a local Ray; the tokens stay the single-rank
    engine's (this module's in-process one: the CLI's single-rank path has its own test
    above, so no second process is started for the reference)."""
    cmd = [sys.executable, "-m", "phalanx.cli", "generate", "Hello there", "--max-tokens", "6",
           "--json", "--model", tiny_model, "--collective-timeout", "20", "--dp", "2"]
    group = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert group.returncode == 0, group.stderr[-2000:]
    got = json.loads(group.stdout.strip().splitlines()[-1])
    assert got["prompt_token_ids"] == llm.tokenizer.encode("Hello there", add_special_tokens=False)
    single = llm.generate(prompt_token_ids=[got["prompt_token_ids"]],
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert got["token_ids"] == single.outputs[0].token_ids and len(got["token_ids"]) == 6
