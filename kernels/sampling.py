"""The sampler's random draw: an exponential race over a batch's probabilities with
counter-hash noise (torch reference; Triton on CUDA tensors).

Row b draws token `argmax_i p[b, i] / E[b, i]` with `E[b, i] ~ Exp(1)`, i.e. token i with
probability `p[b, i]`. `E[b, i] = -log(u)`, `u` from a hash of (seeds[b], i) computed in
exact integer arithmetic and turned into a float64 in (0, 1), then rounded to float32: the
same noise on every device, so a request draws the same tokens on CPU and GPU, alone or
batched, and after recovery.
"""

from __future__ import annotations

import torch

from .backend import use_triton

__all__ = ["exponential_noise", "exponential_race", "exponential_race_ref"]

M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: products of 32-bit values stay below 2**63, so int64
# arithmetic never overflows.
MUL = (0x7FEB352D, 0x6A5D39E9, 0x2C1B3C6D)
GOLDEN = 0x9E3779B9


def _mix(x: torch.Tensor, mul: int) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * mul) & M32
    return x ^ (x >> 15)


def exponential_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` Exp(1) draws, float32: row b, token t from hash(seeds[b], t)."""
    t = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    lo, hi = (seeds & M32)[:, None], ((seeds >> 32) & M32)[:, None]
    h = _mix(t ^ lo, MUL[0])
    h = _mix(h ^ hi, MUL[1])
    h = _mix((h + GOLDEN) & M32, MUL[2])
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)  # in (0, 1)
    return (-torch.log(u)).to(torch.float32)


def exponential_race_ref(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Token per row of `probs` (`[B, V]` float32, rows summing to 1); `seeds`: `[B]`
    int64 (non-negative, < 2**63). The first maximal index wins a tie."""
    return torch.argmax(probs / exponential_noise(seeds, probs.shape[1]), dim=1)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """`exponential_race_ref`, one fused pass per row on a GPU (no `[B, V]` noise)."""
    if use_triton(probs):
        from .gpu.sampling import exponential_race_triton
        return exponential_race_triton(probs, seeds, MUL, GOLDEN)
    return exponential_race_ref(probs, seeds)
