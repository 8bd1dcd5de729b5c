"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded per position.

Every row is sampled on its own: the random draw for (seed, position) comes from a
generator seeded with exactly that pair, and every filter works within the row. So a
seeded request yields the same tokens alone, in any batch, and after recovery.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from .sampling_params import SamplingParams


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for one (request seed, token position)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((int(seed) % (1 << 128)).to_bytes(16, "little"))
    h.update(int(position).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Scaled, filtered float32 logits of one row; removed tokens are -inf."""
    x = logits.float()
    x = (x - x.max()) / p.temperature  # shifted first: a tiny temperature must not overflow
    vocab = x.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def sample_row(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    """One token from a row of logits for the token at `position`."""
    if p.greedy:
        return int(torch.argmax(logits))
    if p.seed is None:
        raise ValueError("sampled requests need a seed (the engine assigns one on admission)")
    probs = torch.softmax(filter_logits(logits, p), dim=-1)
    gen = torch.Generator(device=logits.device).manual_seed(position_seed(p.seed, position))
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i.
    noise = torch.empty(probs.shape, dtype=torch.float32, device=logits.device).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           positions: Sequence[int]) -> list[int]:
    """Sample one token per row; `positions[i]` is the index the new token will take."""
    if logits.shape[0] != len(params) or len(params) != len(positions):
        raise ValueError(f"{logits.shape[0]} rows, {len(params)} params, {len(positions)} positions")
    if not params:
        return []
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_row(logits[i], p, positions[i]) for i, p in enumerate(params)]
