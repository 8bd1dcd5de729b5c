"""Greedy tokens of the engine equal Hugging Face transformers on the same weights.

Sixteen or more prompts of 1-300 tokens go in together, with chunked prefill forced
(a small token budget), prefix-cache hits (prompts sharing long prefixes) and
preemption (a pool too small for every request at once).
"""

from __future__ import annotations

import pytest
import torch

from phalanx import LLM, SamplingParams

MAX_NEW = 12


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab - 8, (n,), generator=g).tolist()  # no special tokens

    lengths = [1, 2, 3, 7, 16, 17, 31, 64, 100, 129, 200, 255, 300]
    prompts = [rand(n) for n in lengths]
    system = rand(160)  # a long shared prefix, as with a shared system prompt
    prompts += [system + rand(n) for n in (1, 9, 40, 77)]
    prompts.append(list(prompts[-1]))  # an identical prompt: every full page is cached
    return prompts


def hf_greedy(folder: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None  # compare plain greedy, no early stop
    outs = []
    with torch.inference_mode():
        for p in prompts:
            # An explicit mask: without one, generate masks every prompt token equal to
            # the pad id.
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def tied_moe_model(tmp_path_factory) -> str:
    """Qwen3-MoE with tied input/output embeddings (no lm_head.weight in the file)."""
    from phalanx.models.tiny import tiny_variant_config, write_random_checkpoint, write_tokenizer

    folder = tmp_path_factory.mktemp("tied")
    cfg = dict(tiny_variant_config("qwen3_moe"), tie_word_embeddings=True)
    write_tokenizer(folder)
    return str(write_random_checkpoint(folder, cfg, seed=1))


def _count_chunked_steps(llm: LLM) -> list[int]:
    """Counts scheduled items that computed only part of a sequence's pending tokens."""
    sched = llm.engine.scheduler
    real = sched.schedule
    chunks = [0]

    def schedule():
        batch = real()
        chunks[0] += sum(1 for seq, n in batch.items if seq.num_computed_tokens + n < seq.num_tokens)
        return batch

    sched.schedule = schedule
    return chunks


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3", "qwen2_moe", "llama", "qwen3_moe_tied"])
def test_greedy_matches_transformers(kind, model_dirs, tied_moe_model):
    folder = tied_moe_model if kind == "qwen3_moe_tied" else model_dirs(kind)
    # 8 sequences of up to 312 tokens need ~160 pages of 4; 120 forces preemption.
    llm = LLM(folder, max_num_seqs=8, max_num_batched_tokens=96, page_size=4, num_pages=120)
    assert llm.config.model.tie_word_embeddings == (kind == "qwen3_moe_tied")
    chunked = _count_chunked_steps(llm)
    prompts = make_prompts(llm.config.model.vocab_size)
    assert len(prompts) >= 16 and max(map(len, prompts)) == 300
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert chunked[0] > 0, "the 96-token budget must split long prompts"

    expected = hf_greedy(folder, prompts, MAX_NEW)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
        assert out.outputs[0].finish_reason == "length"

    stats = llm.engine.stats()
    assert stats["prefix_hit_tokens"] > 0, "shared prefixes should hit the cache"
    assert outs[-1].num_cached_tokens >= 160, "the identical prompt reuses its full pages"
    assert outs[-1].num_cached_tokens < len(prompts[-1]), "the last token is always recomputed"
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_free_pages == 120


def test_prefix_cache_and_layouts_do_not_change_tokens(tiny_model):
    """The same prompts through very different engine settings give the same tokens."""
    prompts = make_prompts(2048, seed=3)[:10]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for kw in (dict(page_size=16, num_pages=1024, max_num_batched_tokens=4096),
               dict(page_size=1, num_pages=3000, max_num_batched_tokens=7, enable_prefix_caching=False),
               dict(page_size=8, num_pages=60, max_num_batched_tokens=33, max_num_seqs=3)):
        llm = LLM(tiny_model, **kw)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                                   sampling_params=params)])
    assert runs[0] == runs[1] == runs[2]
