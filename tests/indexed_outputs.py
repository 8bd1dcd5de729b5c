"""Test helper: generate through a multi-rank `LLM`'s submit/poll and check that every
output's index follows the previous one (each token once, none skipped), across
recoveries."""

from __future__ import annotations

from collections.abc import Sequence


def generate_indexed(llm, prompts, params) -> list[list[int]]:
    """Each prompt's tokens as the caller sees them; `params`: one `SamplingParams` for
    all, or one per prompt."""
    per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    rids = llm._submit([list(p) for p in prompts], per)
    seen: dict[str, list[int]] = {rid: [] for rid in rids}
    pending = set(rids)
    while pending:
        for out in llm._poll():
            got = seen[out.request_id]
            assert out.index == len(got), (out.request_id, out.index, len(got))
            got.extend(out.new_token_ids)
            if out.finished:
                pending.discard(out.request_id)
    return [seen[rid] for rid in rids]


def sampled_cases(prompts, max_tokens: int):
    """Requests that use every sampling field (seeded draws, penalties, bias, min_tokens,
    logprobs, prompt logprobs): (prompts, params) to run beside greedy ones."""
    from phalanx import SamplingParams
    from phalanx.engine.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9999},
                                               "s": {"type": "string", "maxLength": 5}},
              "required": ["n", "s"], "additionalProperties": False}
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=max_tokens,
                       ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.3,
                       repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=1, logprobs=0,
                       logit_bias={5: 3.0, 9: -2.0}, min_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=11, max_tokens=max_tokens,
                       min_tokens=2, logprobs=1, prompt_logprobs=0),
        SamplingParams(temperature=0.8, seed=5, max_tokens=3 * max_tokens, logprobs=0,
                       structured=StructuredOutput.json_schema(schema)),
    ]
    return [list(prompts[i % len(prompts)]) for i in range(len(params))], params


def generate_reported(llm, prompts, params) -> list[tuple[list[int], list, list]]:
    """(tokens, their logprobs, prompt logprobs) per prompt through submit/poll, each
    output's index following the previous one and its logprobs aligned with its tokens."""
    rids = llm._submit([list(p) for p in prompts], list(params))
    seen = {rid: ([], [], None) for rid in rids}
    pending = set(rids)
    while pending:
        for out in llm._poll():
            if out.request_id not in seen:
                continue
            tokens, logprobs, prompt = seen[out.request_id]
            assert out.index == len(tokens), (out.request_id, out.index, len(tokens))
            tokens.extend(out.new_token_ids)
            if out.logprobs is not None:
                assert [lp.token for lp in out.logprobs] == out.new_token_ids
                logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                assert out.index == 0 and prompt is None, "prompt logprobs come once"
                seen[out.request_id] = (tokens, logprobs, out.prompt_logprobs)
            if out.finished:
                pending.discard(out.request_id)
    return [seen[rid] for rid in rids]


def assert_same_reports(got, want, params) -> None:
    """A layout's `generate_reported` equals the single engine's (tokens exactly,
    logprobs up to float rounding of another sharding)."""
    import pytest

    for (tokens, logprobs, prompt), (w_tokens, w_logprobs, w_prompt), p in zip(got, want, params):
        assert tokens == w_tokens, p
        if p.logprobs is not None:
            assert [lp.logprob for lp in logprobs] == \
                pytest.approx([lp.logprob for lp in w_logprobs], abs=2e-3)
        if p.prompt_logprobs is not None:
            assert prompt is not None and prompt[0] is None and len(prompt) == len(w_prompt)
            assert [lp.logprob for lp in prompt[1:]] == \
                pytest.approx([lp.logprob for lp in w_prompt[1:]], abs=2e-3)
