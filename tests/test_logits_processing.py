"""Allow-lists, bad words, penalties, logit bias, min_tokens and logprobs of the batched
sampler against plain per-row reference formulas (the OpenAI / vLLM definitions written
out in Python)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from phalanx.engine.logits_processors import RowHistory, process_logits
from phalanx.engine.sampler import sample_batch
from phalanx.engine.sampling_params import SamplingParams

VOCAB = 40
EOS = (7,)


def _reference(logits: list[float], row: RowHistory, eos=EOS) -> list[float]:
    """One row's processed logits, term by term."""
    p, x = row.params, list(logits)
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    allowed_only = list(x)
    outs = row.outputs()
    for word in p.bad_words_token_ids:
        if len(word) - 1 <= len(outs) and outs[len(outs) - len(word) + 1:] == list(word[:-1]):
            x[word[-1]] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    if row.num_output < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = -math.inf
    seen = set(row.prompt()) | set(row.outputs())
    for t in seen:
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(outs):
        x[t] -= p.frequency_penalty * outs.count(t) + p.presence_penalty
    if p.allowed_token_ids is not None and all(v == -math.inf for v in x):
        return allowed_only  # the allow-list is never broken
    return x


def _random_row(rng: random.Random) -> RowHistory:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
    base = rng.randrange(0, len(prompt))
    history = prompt[len(prompt) - base:] + output
    tail = tuple(history[-rng.randrange(1, 3):]) if history else ()
    words = rng.choice([(), ((rng.randrange(VOCAB),),), (tail + (rng.randrange(VOCAB),),
                                                        (rng.randrange(VOCAB), 5))])
    allowed = rng.choice([None, None, tuple(rng.sample(range(VOCAB), rng.randrange(1, 6))),
                          (EOS[0], 3)])
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.randrange(1 << 30),
        presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.7, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.0]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(3))},
        min_tokens=rng.choice([0, 0, 5, 30]), max_tokens=40,
        stop_token_ids=rng.choice([(), (3,), (3, 11)]), ignore_eos=rng.random() < 0.3,
        output_base=base, allowed_token_ids=allowed, bad_words_token_ids=words)
    return RowHistory(params, prompt, output)


@pytest.mark.parametrize("seed", range(6))
def test_processed_logits_equal_the_reference_formulas(seed):
    rng = random.Random(seed)
    rows = [_random_row(rng) for _ in range(9)]
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    got = process_logits(logits.clone(), rows, EOS)
    for i, row in enumerate(rows):
        want = torch.tensor(_reference(logits[i].tolist(), row))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-4)


def test_allow_lists_and_bad_words():
    """Only allowed tokens are drawn; a bad word's last token is barred only after the rest
    of it in the output (not the prompt); a one-token bad word always; min_tokens barring
    every allowed token leaves the allowed tokens, not an empty row."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 3.0
    for seed in range(20):
        p = SamplingParams(temperature=1.5, seed=seed, allowed_token_ids=[2, 30, 31])
        assert sample_batch(logits, [RowHistory(p)], [seed], EOS).tokens[0] in (2, 30, 31)
    word = SamplingParams(temperature=0, bad_words_token_ids=[(4, 9), (12,)])
    logits[0, 12] = 9.0
    after = sample_batch(logits, [RowHistory(word, [1], [4])], [2], EOS).tokens[0]
    in_prompt = sample_batch(logits, [RowHistory(word, [4], [])], [1], EOS).tokens[0]
    assert after not in (9, 12) and in_prompt == 9
    barred = SamplingParams(temperature=0, min_tokens=3, allowed_token_ids=[EOS[0]])
    assert sample_batch(logits, [RowHistory(barred, [1], [])], [1], EOS).tokens == [EOS[0]]


def test_penalties_count_output_tokens_only_and_resumed_output_as_output():
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    x = torch.zeros(1, VOCAB)
    process_logits(x, [RowHistory(p, [1, 1, 2], [2, 2, 5])])
    assert x[0, 1] == 0 and x[0, 2] == -2.5 and x[0, 5] == -1.5
    # The same request resumed: its first output token moved into the prompt.
    resumed = RowHistory(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5,
                                        output_base=1), [1, 1, 2, 2], [2, 5])
    y = torch.zeros(1, VOCAB)
    process_logits(y, [resumed])
    assert torch.equal(x, y)


def test_logit_bias_steers_greedy_and_min_tokens_bars_eos():
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS[0]] = 5.0  # EOS is the arg-max
    biased = SamplingParams(temperature=0, logit_bias={"12": 100})
    held = SamplingParams(temperature=0, min_tokens=3, max_tokens=5)
    out = sample_batch(logits, [RowHistory(biased), RowHistory(held, [1], [4, 4])], [0, 3], EOS)
    assert out.tokens[0] == 12 and out.tokens[1] != EOS[0]
    done = sample_batch(logits[:1], [RowHistory(held, [1], [4, 4, 4])], [4], EOS)
    assert done.tokens == [EOS[0]]


def test_logprobs_are_of_the_distribution_sampled_from():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=g) * 2
    params = [SamplingParams(temperature=0.5, top_k=5, logprobs=3, seed=1),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, seed=2),  # no logprobs asked
              SamplingParams(temperature=1.3, top_p=0.8, logprobs=20, seed=3,
                             frequency_penalty=1.0)]
    rows = [RowHistory(p, [1, 2], [3, 3]) for p in params]
    out = sample_batch(logits, rows, [4, 4, 4, 4], EOS)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        p, lp = params[i], out.logprobs[i]
        x = process_logits(logits[i:i + 1].clone(), [rows[i]], EOS)[0]
        x = x / (p.temperature or 1.0)
        if p.top_k:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -math.inf)
        if p.top_p < 1.0:
            order = torch.sort(x, descending=True)
            probs = torch.softmax(order.values, 0)
            drop = (torch.cumsum(probs, 0) - probs) >= p.top_p
            x[order.indices[drop]] = -math.inf
        want = torch.log_softmax(x, 0)
        assert lp.token == out.tokens[i]
        assert lp.logprob == pytest.approx(float(want[lp.token]), abs=1e-5)
        assert lp.rank == 1 + int((want > want[lp.token]).sum())
        assert len(lp.top) == p.logprobs
        top = torch.topk(want, p.logprobs)
        assert [t for t, _ in lp.top if math.isfinite(_)] == \
            [t for t, v in zip(top.indices.tolist(), top.values.tolist()) if math.isfinite(v)]
        if p.top_k:  # the filtered tokens carry -inf: they could not be drawn
            assert sum(math.isfinite(v) for _, v in lp.top) <= p.top_k
    assert out.logprobs[1].rank == 1  # greedy: the arg-max


def test_a_row_with_processors_alone_equals_it_in_any_batch():
    rng = random.Random(9)
    rows = [_random_row(rng) for _ in range(7)]
    rows = [RowHistory(SamplingParams(**{**{f: getattr(r.params, f) for f in
                                            r.params.__slots__}, "logprobs": 2}),
                       r.prompt_ids, r.output_ids) for r in rows]
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    full = sample_batch(logits, rows, list(range(10, 17)), EOS)
    for i in range(7):
        alone = sample_batch(logits[i:i + 1], [rows[i]], [10 + i], EOS)
        assert alone.tokens[0] == full.tokens[i]
        assert alone.logprobs[0].logprob == pytest.approx(full.logprobs[i].logprob, abs=1e-6)
        assert [t for t, _ in alone.logprobs[0].top] == [t for t, _ in full.logprobs[i].top]
        assert [v for _, v in alone.logprobs[0].top] == \
            pytest.approx([v for _, v in full.logprobs[i].top], abs=1e-6)
