"""Triton: the exponential race of `kernels/sampling.py` in one pass per row: the noise
is hashed in registers, so the kernel reads the probabilities once and writes a token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _mix(x, mul: tl.constexpr):
    x = x ^ (x >> 16)
    x = (x * mul) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _race_kernel(p_ptr, seeds_ptr, best_ptr, index_ptr, vocab, stride, chunk,
                 MUL0: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                 GOLD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, c): the race over tokens [c * chunk, (c + 1) * chunk) of the row;
    its winner's value and index go to slot (row, c)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo_tok = c * chunk
    hi_tok = tl.minimum(lo_tok + chunk, vocab)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    lo = seed & 0xFFFFFFFF
    hi = (seed >> 32) & 0xFFFFFFFF
    best = tl.full((), -1.0, tl.float32)
    best_i = tl.full((), 0, tl.int64)
    for start in range(lo_tok, hi_tok, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi_tok
        p = tl.load(p_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=0.0)
        h = _mix(offs.to(tl.int64) ^ lo, MUL0)
        h = _mix(h ^ hi, MUL1)
        h = _mix((h + GOLD) & 0xFFFFFFFF, MUL2)
        u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
        e = (-tl.log(u)).to(tl.float32)
        q = tl.where(mask, p / e, -1.0)
        m = tl.max(q, axis=0)
        i = tl.argmax(q, axis=0).to(tl.int64)
        better = m > best  # strict: an earlier block keeps a tie, as torch.argmax
        best_i = tl.where(better, start + i, best_i)
        best = tl.where(better, m, best)
    slots = tl.num_programs(1)
    tl.store(best_ptr + row * slots + c, best)
    tl.store(index_ptr + row * slots + c, best_i)


BLOCK = 2048
CHUNK = 8 * BLOCK  # tokens per program: a 152k vocabulary is 10 programs per row


def exponential_race_triton(probs: torch.Tensor, seeds: torch.Tensor, mul: tuple[int, int, int],
                            golden: int) -> torch.Tensor:
    """`kernels.sampling.exponential_race_ref` with its hash constants `mul`, `golden`."""
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(1) != 1:
        raise ValueError(f"probs must be a row-contiguous [B, V] float32 tensor, got "
                         f"{tuple(probs.shape)} {probs.dtype}")
    rows, vocab = probs.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=probs.device)
    index = torch.empty(rows, chunks, dtype=torch.int64, device=probs.device)
    _race_kernel[(rows, chunks)](probs, seeds.to(torch.int64).contiguous(), best, index, vocab,
                                 probs.stride(0), CHUNK, mul[0], mul[1], mul[2], golden,
                                 BLOCK=BLOCK)
    # The first chunk holding the row's maximum: ties go to the lowest index, as argmax.
    return index.gather(1, torch.argmax(best, dim=1, keepdim=True)).squeeze(1)
