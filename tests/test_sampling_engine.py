"""Sampling parity in the engine: prompt and token logprobs against Hugging Face
`transformers` on the same weights, `n` choices seeded seed + i, penalties surviving a
resume, `LLM.chat`."""

from __future__ import annotations

import pytest
import torch

from phalanx import LLM, SamplingParams
from phalanx.actors.resume import resume_from


@pytest.fixture(scope="module")
def llm(tiny_model):
    # A small token budget and page count: prompts are chunked, some requests preempted.
    return LLM(tiny_model, max_num_seqs=6, max_num_batched_tokens=40, page_size=4, num_pages=90)


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab - 8, (n,), generator=g).tolist() for n in (2, 9, 33, 70, 121)]


def test_prompt_and_token_logprobs_equal_transformers(llm, hf):
    prompts = _prompts(llm.config.model.vocab_size)
    shared = prompts[3][:64] + prompts[1]  # its first pages are cached by then: not reused
    prompts.append(shared)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0]
        want = _hf_logprobs(hf, prompt + gen.token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token == prompt[pos]
            assert lp.logprob == pytest.approx(float(want[pos - 1, prompt[pos]]), abs=2e-4)
            v = want[pos - 1, prompt[pos]]  # ranks among near-ties depend on rounding
            assert 1 + int((want[pos - 1] > v + 1e-3).sum()) <= lp.rank \
                <= 1 + int((want[pos - 1] > v - 1e-3).sum())
            assert [t for t, _ in lp.top] == torch.topk(want[pos - 1], 2).indices.tolist()
        assert out.num_cached_tokens == 0
        for k, lp in enumerate(gen.logprobs):  # greedy: the distribution at temperature 1
            row = want[len(prompt) - 1 + k]
            assert lp.token == gen.token_ids[k] == int(torch.argmax(row))
            assert lp.rank == 1 and lp.logprob == pytest.approx(float(row.max()), abs=2e-4)
            assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
        assert gen.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in gen.logprobs))


def test_n_choices_are_seeded_seed_plus_i(llm):
    prompt = _prompts(llm.config.model.vocab_size)[2]
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, max_tokens=8, seed=41,
                            ignore_eos=True, frequency_penalty=0.4)
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    single = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, ignore_eos=True,
                            frequency_penalty=0.4)
    for i, choice in enumerate(out.outputs):
        (alone,) = llm.generate(prompt_token_ids=[prompt], sampling_params=single.with_seed(41 + i))
        assert choice.token_ids == alone.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # Unseeded: the choices still differ from one another.
    (free,) = llm.generate(prompt_token_ids=[prompt],
                           sampling_params=SamplingParams(n=3, max_tokens=8, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in free.outputs}) == 3


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_a_resumed_request_continues_with_the_same_tokens(llm, cut):
    """What recovery does (`resume_from`): the prompt plus the tokens already out, the
    params adjusted; penalties, min_tokens and logprobs continue unchanged."""
    prompt = _prompts(llm.config.model.vocab_size)[1]
    eos = llm.config.model.eos_token_ids[0]
    params = SamplingParams(temperature=0.8, max_tokens=14, seed=7, presence_penalty=0.6,
                            frequency_penalty=0.9, repetition_penalty=1.4, min_tokens=12,
                            logit_bias={eos: 6.0}, logprobs=2)
    (full,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    ids = full.outputs[0].token_ids
    tokens, resumed, base = resume_from(prompt, params, ids[:cut])
    (rest,) = llm.generate(prompt_token_ids=[tokens], sampling_params=resumed)
    assert base == cut and ids[cut:] == rest.outputs[0].token_ids
    assert [lp.logprob for lp in full.outputs[0].logprobs[cut:]] == \
        pytest.approx([lp.logprob for lp in rest.outputs[0].logprobs], abs=1e-5)
    assert eos not in ids[:12]  # min_tokens held EOS back despite its bias


def test_chat_renders_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=5)
    (out,) = llm.chat(messages, params)
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    (same,) = llm.generate(prompt_token_ids=[ids], sampling_params=params)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    two = llm.chat([messages, messages[1:]], params)
    assert len(two) == 2 and two[0].outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], params)
