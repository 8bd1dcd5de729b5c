"""Overlapped steps (`EngineConfig.overlap_steps`): a steady decode step launches the next
one before returning. On CPU the forward is synchronous, so this checks the bookkeeping:
the same tokens as without overlap, aborts and arrivals while a step is in flight, page
growth at page boundaries, and a full pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phalanx.engine.llm_engine import LLMEngine
from phalanx.engine.sampling_params import SamplingParams
from phalanx.llm import engine_config


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2040, (int(torch.randint(1, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def _params(i: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=5 + 3 * i,
                              ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True)


def _engine(tiny_model, overlap: bool, **kw) -> LLMEngine:
    cfg = engine_config(tiny_model, page_size=4, max_num_batched_tokens=64, **kw)
    return LLMEngine(dataclasses.replace(cfg, overlap_steps=overlap))


def _run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
         aborts: dict[int, list[str]] = {}) -> tuple[dict[str, list[int]], int]:
    """Step to completion adding/aborting requests before the given step numbers;
    tokens per request (checked to arrive in index order) and steps launched ahead."""
    tokens: dict[str, list[int]] = {}
    step, ahead = 0, 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            got = tokens.setdefault(out.request_id, [])
            assert out.index == len(got), (out.request_id, out.index, len(got))
            got.extend(out.new_token_ids)
        ahead += engine._ahead is not None
        step += 1
        assert step < 1000
    assert engine.pool.num_free_pages == engine.num_pages or engine.pool.enable_prefix_caching
    engine.pool.check_integrity()
    return tokens, ahead


def _workload() -> dict[int, list]:
    prompts = _prompts(8, seed=3)
    arrivals: dict[int, list] = {}
    for i, prompt in enumerate(prompts):
        arrivals.setdefault(0 if i < 5 else 6 * i, []).append((f"r{i}", prompt, _params(i)))
    return arrivals


def test_overlapped_steps_give_the_same_tokens(tiny_model):
    base, ahead0 = _run(_engine(tiny_model, overlap=False), _workload())
    over, ahead = _run(_engine(tiny_model, overlap=True), _workload())
    assert ahead0 == 0 and ahead > 10
    assert over == base
    assert all(len(over[f"r{i}"]) == _params(i).max_tokens for i in range(8))


def test_abort_while_a_step_is_in_flight(tiny_model):
    wl = _workload()
    base, _ = _run(_engine(tiny_model, overlap=False), wl)
    engine = _engine(tiny_model, overlap=True)
    over, _ = _run(engine, wl, aborts={5: ["r3", "r4"]})
    assert not engine.sequences
    for rid in base:
        if rid in ("r3", "r4"):
            assert over[rid] == base[rid][:len(over[rid])] and len(over[rid]) < len(base[rid])
        else:
            assert over[rid] == base[rid]
    # Every request aborted with a step in flight: the engine still serves the next one.
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("x", prompt, params)
    engine.add_request("y", prompt, params)
    while engine._ahead is None:
        engine.step()
    engine.abort_request("x")
    engine.abort_request("y")
    assert engine._ahead is not None  # launched for x and y, both aborted since
    assert not engine.has_unfinished() and engine.step() == [] and engine._ahead is None
    ref = _run(_engine(tiny_model, overlap=False), {0: [("z", prompt, params)]})[0]
    assert _run(engine, {0: [("z", prompt, params)]})[0] == ref


@pytest.mark.parametrize("num_pages", [14, 29])
def test_small_pool_falls_back_to_scheduling(tiny_model, num_pages):
    """Too few pages for one more token each: no step is launched ahead of a
    preemption, and the tokens still equal a large pool's."""
    arrivals = {0: [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
                    for i, p in enumerate(_prompts(4, seed=5))]}
    big, _ = _run(_engine(tiny_model, overlap=False, num_pages=512), arrivals)
    engine = _engine(tiny_model, overlap=True, num_pages=num_pages, enable_prefix_caching=False)
    small, _ = _run(engine, arrivals)
    assert small == big
    assert engine.scheduler.num_preemptions > 0 or num_pages == 29


def test_overlap_is_validated(tiny_model):
    cfg = engine_config(tiny_model)
    assert cfg.overlap_steps is True
    with pytest.raises(ValueError, match="overlap_steps"):
        dataclasses.replace(cfg, overlap_steps="yes")


def test_greedy_steps_launch_before_their_tokens_are_read(tiny_model):
    """All-greedy steps launch the next step with the tokens still on the device; a
    request that stops on a token meanwhile keeps exactly its tokens, the others too."""
    prompts = _prompts(4, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base, _ = _run(_engine(tiny_model, overlap=False),
                   {0: [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]})
    stop = base["r1"][4]
    want = dict(base, r1=base["r1"][:base["r1"].index(stop) + 1])
    stopping = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    arrivals = {0: [(f"r{i}", p, stopping if i == 1 else greedy) for i, p in enumerate(prompts)]}
    engine = _engine(tiny_model, overlap=True)
    fed = []
    real = engine.runner.greedy_tokens
    engine.runner.greedy_tokens = lambda *a: (fed.append(1), real(*a))[1]
    got, ahead = _run(engine, arrivals)
    assert got == want and len(got["r1"]) < 12
    assert len(fed) >= 5 and ahead >= 5
    assert _run(_engine(tiny_model, overlap=False), arrivals)[0] == want


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_overlapped_equal_serial(tiny_model, seed):
    """Random arrivals, aborts, stop tokens, greedy and seeded sampling, and pools small
    enough to preempt: with steps overlapped every request that is not aborted gets the
    serial engine's tokens, and an aborted one a prefix of them."""
    import random

    rng = random.Random(seed)
    prompts = _prompts(10, seed=100 + seed)
    arrivals: dict[int, list] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.9]), top_p=0.9,
                                seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, 14),
                                ignore_eos=True, stop_token_ids=[rng.randrange(2048)])
        arrivals.setdefault(rng.choice([0, 0, rng.randint(1, 12)]), []).append((f"r{i}", prompt, params))
    aborts = {rng.randint(2, 10): [f"r{rng.randrange(10)}"]}
    num_pages = rng.choice([40, 512])
    base, _ = _run(_engine(tiny_model, overlap=False, num_pages=512), arrivals)
    # a stop token the serial run actually met, so that some request stops on one
    rid = max(base, key=lambda r: len(base[r]))
    if len(base[rid]) > 3:
        for wl in arrivals.values():
            for j, (r, p, sp) in enumerate(wl):
                if r == rid:
                    wl[j] = (r, p, dataclasses.replace(sp, stop_token_ids=[base[rid][2]]))
        base, _ = _run(_engine(tiny_model, overlap=False, num_pages=512), arrivals)
    over, ahead = _run(_engine(tiny_model, overlap=True, num_pages=num_pages), arrivals, aborts)
    aborted = {r for rs in aborts.values() for r in rs}
    for r, want in base.items():
        got = over.get(r, [])
        if r in aborted:
            assert got == want[:len(got)], r
        else:
            assert got == want, r
    assert ahead > 0


def test_prefill_chunks_and_admissions_are_launched_ahead(tiny_model):
    """Not only steady decode: a step launches whatever the scheduler gives next (here
    the rest of a chunked prefill, then a newly admitted request's prompt), and the
    tokens still equal the serial engine's."""
    prompt = list(range(100, 190))  # 90 tokens: two chunks of the 64-token budget
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = _engine(tiny_model, overlap=True)
    engine.add_request("a", prompt, params)
    assert engine.step() == []  # first chunk; the second is launched before returning
    ahead_batch = engine._ahead[0]
    assert [(s.request_id, n) for s, n in ahead_batch.items] == [("a", 26)]
    engine.add_request("b", prompt[:30], params)  # joins the step after the launched one
    got, _ = _run(engine, {})
    want, _ = _run(_engine(tiny_model, overlap=False),
                   {0: [("a", prompt, params)], 2: [("b", prompt[:30], params)]})
    assert got == want
