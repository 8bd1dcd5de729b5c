"""A row's result does not depend on the rows that share its batch (ARCHITECTURE §5): the
CPU path's linears pad their rows to a multiple of `CPU_ROW_QUANTUM` (a CPU GEMM picks its
kernel by row count, and a float32 row's bits changed with it), so a request's logprobs
are the same bits alone or beside others, and a seeded request's tokens cannot flip at a
near-tie because of the company it keeps. And prefill attention computes each row as
decode does its query, so a re-prefill of emitted tokens (after a KV loss) reproduces
their logprobs bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phalanx import LLM, SamplingParams
from phalanx.kernels.invariant_linear import row_invariant_linear

TARGET = "The quick brown fox jumps over the lazy dog"
OTHERS = ["Hello there, my friend", "One two three four five six", "A B C",
          "Lorem ipsum dolor sit amet, consectetur", "To be or not to be"]


@pytest.mark.parametrize("shape", [(1024, 512), (96, 40), (128, 768)])
def test_each_row_has_its_bits_in_any_company(shape):
    g = torch.Generator().manual_seed(sum(shape))
    n, k = shape
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    alone = torch.cat([row_invariant_linear(x[i:i + 1], w, b) for i in range(40)])
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 40):
        assert torch.equal(row_invariant_linear(x[:m], w, b), alone[:m]), m
    assert torch.equal(row_invariant_linear(x[:6].reshape(2, 3, k), w, b).reshape(6, n), alone[:6])
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert row_invariant_linear(x[:0], w).shape == (0, n)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, max_num_seqs=16, num_pages=512)


def test_a_requests_logprobs_are_the_same_bits_alone_or_batched(llm):
    assert_alone_equals_batched(llm)


def assert_alone_equals_batched(llm) -> None:
    """A seeded request's (token, logprob) pairs alone equal them beside 1, 2, 3, 5 others."""
    target = SamplingParams(temperature=1.0, max_tokens=40, seed=5, logprobs=0, ignore_eos=True)
    (alone,) = llm.generate([TARGET], target)
    want = [(lp.token, lp.logprob) for lp in alone.outputs[0].logprobs]
    for k in (1, 2, 3, 5):
        company = [SamplingParams(temperature=1.0, max_tokens=40 - 7 * i, seed=9 + i, ignore_eos=True)
                   for i in range(k)]
        out = llm.generate([TARGET] + OTHERS[:k], [target] + company)[0]
        assert [(lp.token, lp.logprob) for lp in out.outputs[0].logprobs] == want, k


def test_a_reprefill_of_emitted_tokens_gives_the_decodes_bits(llm):
    assert_reprefill_equals_decode(llm)


def assert_reprefill_equals_decode(llm) -> None:
    """After a KV loss a request is prefilled again from prompt + emitted tokens: each
    emitted token's logprob under that prefill (`prompt_logprobs`) is the bits it had
    when it was decoded, so the replay continues exactly."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=5, logprobs=0, ignore_eos=True)
    (out,) = llm.generate([TARGET], params)
    prompt, emitted = out.prompt_token_ids, out.outputs[0].token_ids
    (again,) = llm.generate(prompt_token_ids=[prompt + emitted[:20]], sampling_params=SamplingParams(
        temperature=1.0, max_tokens=1, prompt_logprobs=0))
    decoded = [(lp.token, lp.logprob) for lp in out.outputs[0].logprobs[:20]]
    prefilled = [(lp.token, lp.logprob) for lp in again.prompt_logprobs[len(prompt):]]
    assert prefilled == decoded


@pytest.mark.slow
def test_experts_on_one_rank_or_over_an_ep_group_give_the_same_bits(llm, tiny_model):
    """A token's slots are summed in slot order, in float32, both by the experts'
    reference on one rank and by the EP combine of a DP2 group (comm/dispatch.py): so a
    re-prefill on a one-rank prefill group reproduces what a DP×EP decode group decoded."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=5, logprobs=0, ignore_eos=True)
    (alone,) = llm.generate([TARGET], params)
    group = LLM(tiny_model, max_num_seqs=16, num_pages=512, dp=2)
    try:
        spread = group.generate([TARGET, OTHERS[0]], [params, params])[0]
    finally:
        group.close()
    assert [(lp.token, lp.logprob) for lp in spread.outputs[0].logprobs] == \
        [(lp.token, lp.logprob) for lp in alone.outputs[0].logprobs]


def test_the_mode_is_a_checked_option(tiny_model):
    """`batch_invariant` is a bool; on a GPU, FP8 weights are refused with it (their
    linears quantize activations at prefill and not at decode), on CPU taken (the
    reference dequantizes, the same for every row)."""
    from phalanx.llm import engine_config

    assert engine_config(tiny_model, batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant"):
        engine_config(tiny_model, device="cuda", quantization="fp8", batch_invariant=True)
    assert engine_config(tiny_model, quantization="fp8", batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant"):
        engine_config(tiny_model, batch_invariant="yes")


def test_the_flag_reaches_the_engine_config(tiny_model):
    """`phalanx serve --batch-invariant` (and `generate`'s) down to the engine's config."""
    from phalanx.cli import build_parser
    from phalanx.server.engine_backend import EngineBackend

    for command in ("serve", "generate"):
        extra = ["hi"] if command == "generate" else []
        args = build_parser().parse_args([command, "--model", tiny_model, "--batch-invariant", *extra])
        assert args.batch_invariant is True
        assert build_parser().parse_args([command, "--model", tiny_model, *extra]).batch_invariant is False
    assert EngineBackend.from_model_dir(tiny_model, batch_invariant=True).config.batch_invariant
