"""The warm-up plan (engine/warmup.py) and what it leaves behind: it fits the engine's
limits, covers the shapes it names, and an engine that served it forgets it (no cached
page, no counted hit, the same tokens afterwards as an engine that never warmed up).
That nothing compiles after it on a GPU is tests/test_gpu.py's."""

from __future__ import annotations

from phalanx import SamplingParams
from phalanx.engine.llm_engine import LLMEngine
from phalanx.engine.warmup import WARMUP_PREFIX, run_warmup, warmup_rounds
from phalanx.llm import engine_config

from test_hf_oracle import make_prompts

LIMITS = dict(vocab_size=1000, max_model_len=2048, max_num_seqs=64,
              max_num_batched_tokens=512, graph_max_batch=32, kv_tokens=64 * 1024)


def test_the_plan_fits_the_limits_and_covers_the_shapes():
    rounds = warmup_rounds(**LIMITS)
    alone = {len(r.requests[0][0]) for r in rounds if r.name.startswith("alone-")}
    assert {1, 16, 17, 64, 65, 128, 129, 511, 512, 513, 529} <= alone  # tiles, residues, chunks
    assert all(r.name.replace("alone", "hit") in {x.name for x in rounds}
               for r in rounds if r.name.startswith("alone-"))
    batches = {len(r.requests) for r in rounds if r.name.startswith("batch-")}
    assert {2, 17, 33, 48, 64} <= batches  # past the largest graph (32) and the most seqs
    for r in rounds:
        tokens = sum(len(p) + sp.max_tokens for p, sp in r.requests)
        assert tokens <= LIMITS["kv_tokens"] // 2, r.name
        for prompt, params in r.requests:
            assert len(prompt) + params.max_tokens <= LIMITS["max_model_len"], r.name
            assert all(8 <= t < LIMITS["vocab_size"] - 8 for t in prompt)
            assert params.ignore_eos and (params.greedy or params.seed is not None)
    sampled = [p for r in rounds for _, p in r.requests if not p.greedy]
    assert any(p.top_p < 1 for p in sampled) and any(p.top_k > 0 for p in sampled)
    assert any(p.logprobs for p in sampled) and any(p.repetition_penalty != 1 for p in sampled)
    assert warmup_rounds(**LIMITS) == rounds  # the same plan every start


def test_a_small_cache_gets_a_smaller_plan():
    rounds = warmup_rounds(**dict(LIMITS, kv_tokens=800, max_num_seqs=8))
    for r in rounds:
        assert sum(len(p) + sp.max_tokens for p, sp in r.requests) <= 400, r.name
        assert len(r.requests) <= 8


def test_an_engine_forgets_its_warm_up(tiny_model):
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, num_pages=300)
    prompts = make_prompts(2048, seed=5)[:6]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)

    def tokens(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"r{i}"] for i in range(len(prompts))]

    fresh = LLMEngine(engine_config(tiny_model, **kw))
    assert fresh.warm_up() is None  # CPU: nothing to compile
    expected = tokens(fresh)
    engine = LLMEngine(engine_config(tiny_model, **kw))
    cfg = engine.config
    report = run_warmup(engine, warmup_rounds(
        cfg.model.vocab_size, cfg.max_model_len, 8, 64, 0, engine.num_pages * 4))
    assert report.requests > 100 and report.steps > report.rounds
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] == stats["prefix_query_tokens"] == 0
    assert stats["num_running"] == stats["num_waiting"] == stats["num_preemptions"] == 0
    assert not engine.pool.cached and engine.pool.num_free_pages == engine.num_pages
    assert not any(rid.startswith(WARMUP_PREFIX) for rid in engine.sequences)
    engine.pool.check_integrity()
    assert tokens(engine) == expected
