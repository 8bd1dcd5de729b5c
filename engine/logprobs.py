"""Log-probabilities reported with tokens: the chosen token's, its rank, the top-k.

A `TokenLogprob` says how likely one token was under one distribution: for a sampled
token the distribution it was drawn from (see `SamplingParams`), for a prompt token the
model's own (log-softmax of the raw logits: nothing was sampled there). A token that a
filter removed has logprob `-inf`; the HTTP layer writes it as -9999.0, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["TokenLogprob", "token_logprobs"]


@dataclass(slots=True)
class TokenLogprob:
    """`token`'s log-probability and rank (1: the most likely), and the `top` most
    likely tokens with theirs, best first (as many as asked for; ties by token id)."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: list[int]
                   ) -> list[TokenLogprob]:
    """One `TokenLogprob` per row of `logprobs` (`[R, vocab]`, float32) for the row's
    `tokens[r]` with its `k[r]` best alternatives; one read-back for all rows."""
    if logprobs.shape[0] == 0:
        return []
    chosen = logprobs.gather(1, tokens.view(-1, 1))
    # Rank 1 + how many tokens are strictly more likely (NaN-free: -inf compares fine).
    ranks = (logprobs > chosen).sum(dim=1) + 1
    width = max(k)
    top_v, top_i = (torch.topk(logprobs, width, dim=1, sorted=True) if width
                    else (logprobs[:, :0], tokens.view(-1, 1)[:, :0]))
    host = [t.cpu() for t in (chosen.view(-1), ranks, top_v, top_i, tokens.view(-1))]
    chosen_h, ranks_h, top_vh, top_ih, tokens_h = (t.tolist() for t in host)
    return [TokenLogprob(tokens_h[r], chosen_h[r], ranks_h[r],
                         list(zip(top_ih[r][:k[r]], top_vh[r][:k[r]])))
            for r in range(len(k))]
