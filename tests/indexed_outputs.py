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
