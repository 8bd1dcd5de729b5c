"""Whether a prompt can run on an engine (plain logic: the engine and the disaggregated
driver both check with it, the driver without a call to a rank)."""

from __future__ import annotations

from typing import Sequence as Seq

from ..config import EngineConfig
from .sampling_params import SamplingParams

__all__ = ["check_prompt"]


def check_prompt(prompt_token_ids: Seq[int], params: SamplingParams, config: EngineConfig,
                 num_pages: int) -> list[int]:
    """The prompt as a list; ValueError naming what is wrong: no tokens, ids outside the
    vocabulary (prompt, `logit_bias`, `allowed_token_ids`, bad words), no room left in the
    context to generate, or more pages of `num_pages` than the pool has for the prompt and
    its `max_tokens`."""
    tokens = list(prompt_token_ids)
    if not tokens:
        raise ValueError("prompt: must contain at least one token")
    vocab = config.model.vocab_size
    bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
    named = (("logit_bias", [t for t, _ in params.logit_bias]),
             ("allowed_token_ids", params.allowed_token_ids or ()),
             ("bad_words", [t for word in params.bad_words_token_ids for t in word]))
    for field, ids in named:
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise ValueError(f"{field}: token ids {outside[:5]} outside the vocabulary [0, {vocab})")
    limit = config.max_model_len
    if len(tokens) >= limit:
        raise ValueError(f"prompt: {len(tokens)} tokens leave no room to generate in the "
                         f"model's context of {limit} tokens")
    page_size = config.cache.page_size
    longest = min(len(tokens) + params.max_tokens, limit)
    if -(-longest // page_size) > num_pages:
        raise ValueError(f"num_pages: {num_pages} pages of {page_size} tokens cannot "
                         f"hold one request of {longest} tokens")
    return tokens
