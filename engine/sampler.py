"""Token sampling for a whole batch at once: processors, temperature, top-k, top-p,
min-p, a seeded draw per (request, position), and the logprobs asked for.

Every operation is batched over the rows (no per-row tensor work), yet each row depends
only on itself: the random draw of a row comes from a counter-based hash of (the row's
position seed, token id), computed with integer tensor ops, so a seeded request yields
the same tokens alone, in any batch, on any device, and after recovery. Sampling is an
exponential race: the arg-max of `p_i / E_i` with `E_i ~ Exp(1)` draws `i` with
probability `p_i`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..kernels.sampling import exponential_race
from .logits_processors import RowHistory, process_logits
from .logprobs import TokenLogprob, token_logprobs
from .sampling_params import SamplingParams

__all__ = ["SampleResult", "position_seed", "filter_logits", "sample_batch", "sample",
           "sample_row", "RowHistory"]

def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one (request seed, token position)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((int(seed) % (1 << 128)).to_bytes(16, "little"))
    h.update(int(position).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass(slots=True)
class SampleResult:
    """A token per row and, for rows that asked, its `TokenLogprob` (else None)."""

    tokens: list[int]
    logprobs: list[Optional[TokenLogprob]] = field(default_factory=list)


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Scaled, filtered float32 logits `[B, vocab]` (removed tokens -inf). Greedy rows
    are scaled by 1 and not filtered."""
    device, vocab = x.device, x.shape[1]
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                         dtype=torch.float32, device=device)[:, None]
    # Shifted first: a tiny temperature must not overflow.
    x = (x - x.max(dim=1, keepdim=True).values) / temps
    ks = [p.top_k if not p.greedy and 0 < p.top_k < vocab else vocab for p in params]
    tops = [p.top_p if not p.greedy else 1.0 for p in params]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in tops):
        k = torch.tensor(ks, device=device)[:, None]
        top_p = torch.tensor([p if p < 1.0 else float("inf") for p in tops], device=device)[:, None]
        fast = _top_k_top_p_candidates(x, k, top_p, max([k_ for k_ in ks if k_ < vocab], default=0))
        x = fast if fast is not None else _top_k_top_p_sorted(x, k, top_p)
    min_ps = [p.min_p if not p.greedy else 0.0 for p in params]
    if any(min_ps):
        probs = torch.softmax(x, dim=1)
        floor = torch.tensor(min_ps, device=device)[:, None] * probs.max(dim=1, keepdim=True).values
        x = x.masked_fill(probs < floor, float("-inf"))
    return x


CANDIDATES = 1024  # top-k/top-p look at the best this many tokens first


def _top_k_top_p_sorted(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k (keep logits >= the k-th largest; `k == vocab`: off) then top-p (keep the
    smallest prefix, by probability, whose mass reaches `top_p`; inf: off) over a full
    sort of each row."""
    sorted_x, order = torch.sort(x, dim=1, descending=True)
    kth = sorted_x.gather(1, k - 1)
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=1)
    # The first token always stays: its mass before it is 0.
    drop_sorted = (torch.cumsum(probs, dim=1) - probs) >= top_p
    return x.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted),
                         float("-inf"))


def _top_k_top_p_candidates(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                            largest_k: int) -> Optional[torch.Tensor]:
    """`_top_k_top_p_sorted` from each row's `CANDIDATES` best tokens (a partial top-k
    instead of a full sort: ~4x less on a 152k vocabulary). A row for which that is not
    exact (its top-p prefix, or a tie at its k-th value, reaches past the candidates) is
    done by the full sort alone, so a row's result never depends on the other rows. None
    when the vocabulary is not larger than the candidates."""
    vocab = x.shape[1]
    cand = max(CANDIDATES, largest_k)
    if cand >= vocab:
        return None
    vals, idx = torch.topk(x, cand, dim=1)
    topped = k < vocab
    kth = torch.where(topped, vals.gather(1, k.clamp(max=cand) - 1), float("-inf"))
    vals = vals.masked_fill(vals < kth, float("-inf"))
    lse = torch.logsumexp(x.masked_fill(x < kth, float("-inf")), dim=1, keepdim=True)
    probs = torch.exp(vals - lse)
    drop = (torch.cumsum(probs, dim=1) - probs) >= top_p
    exact = (torch.isinf(top_p) | (probs.sum(dim=1, keepdim=True) >= top_p)) \
        & (~topped | (vals[:, -1:] != kth) | torch.isneginf(kth))
    keep = torch.zeros_like(x, dtype=torch.bool).scatter(1, idx, ~drop & ~torch.isneginf(vals))
    keep |= ~(topped | ~torch.isinf(top_p))  # rows with neither filter keep everything
    out = x.masked_fill(~keep, float("-inf"))
    slow = torch.nonzero(~exact[:, 0]).flatten()
    if slow.numel():
        out[slow] = _top_k_top_p_sorted(x[slow], k[slow], top_p[slow])
    return out


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Scaled, filtered float32 logits of one row; removed tokens are -inf."""
    return _filter(logits.float()[None], [p])[0]


def _constrain(x: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of `x` keep only their `allowed` tokens; a row whose processors left
    none of them (min_tokens barring the EOS a finished grammar needs) falls back to the
    allowed tokens alone."""
    sub = x[rows].masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(sub).all(dim=1, keepdim=True)
    x[rows] = torch.where(empty, torch.zeros_like(sub).masked_fill(~allowed, float("-inf")), sub)
    return x


def sample_batch(logits: torch.Tensor, rows: Sequence[RowHistory], positions: Sequence[int],
                 eos_token_ids: Sequence[int] = (),
                 allowed: Optional[tuple[list[int], torch.Tensor]] = None) -> SampleResult:
    """One token per row of `logits` (`[B, vocab]`); `positions[i]`: the index the new
    token takes in its sequence (prompt included); `allowed`: (rows, `[len(rows), vocab]`
    bool) the tokens a grammar allows those rows. Raises ValueError on a shape mismatch
    or a sampled row without a seed."""
    if logits.shape[0] != len(rows) or len(rows) != len(positions):
        raise ValueError(f"{logits.shape[0]} rows, {len(rows)} params, {len(positions)} positions")
    params = [r.params for r in rows]
    if not params:
        return SampleResult([], [])
    if all(p.plain_greedy for p in params):
        return SampleResult(torch.argmax(logits, dim=-1).tolist(), [None] * len(params))
    x = process_logits(logits.float().clone(), rows, eos_token_ids)
    if allowed is not None and allowed[0]:
        x = _constrain(x, *allowed)
    x = _filter(x, params)
    tokens = torch.argmax(x, dim=1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        if any(params[i].seed is None for i in drawn):
            raise ValueError("sampled requests need a seed (the engine assigns one on admission)")
        seeds = torch.tensor([position_seed(params[i].seed, positions[i]) for i in drawn],
                             dtype=torch.int64, device=x.device)
        tokens[drawn] = exponential_race(torch.softmax(x[drawn], dim=1), seeds)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[Optional[TokenLogprob]] = [None] * len(params)
    if wanted:
        lp = torch.log_softmax(x[wanted], dim=1)
        for i, tl in zip(wanted, token_logprobs(lp, tokens[wanted],
                                                [params[i].logprobs for i in wanted])):
            logprobs[i] = tl
    return SampleResult(tokens.tolist(), logprobs)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           positions: Sequence[int]) -> list[int]:
    """Tokens of rows without history (no penalties count anything)."""
    return sample_batch(logits, [RowHistory(p) for p in params], positions).tokens


def sample_row(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    """One token from a row of logits for the token at `position`."""
    return sample(logits[None], [p], [position])[0]
