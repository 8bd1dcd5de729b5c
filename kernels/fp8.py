"""FP8 weights in the block-scaled format of Qwen3/DeepSeek FP8 checkpoints: torch reference.

A checkpoint's quantized weight ``W [N, K]`` is stored as ``float8_e4m3fn`` with one float32
``weight_scale_inv`` per 128 x 128 block (``[ceil(N/128), ceil(K/128)]``): ``W ~= q * s``
blockwise. phalanx keeps the scales **per row and K-block** (``[N, ceil(K/128)]``, each
block's scale repeated over its 128 rows): the same numbers, but a shard that cuts rows
anywhere (q/k/v heads, gate/up halves, a TP rank's rows) keeps exactly its rows' scales,
and pieces concatenate along N whatever their alignment. Cutting K (a row-parallel
projection's columns) must fall on block bounds (`slice_k_blocks`). Expert stacks carry a
leading expert dimension on both.

The reference computes with the weights dequantized (``q.float() * s``) in the
activations' dtype: in float32 that is exactly what a float32 checkpoint holding the
dequantized weights computes, which the tests use as the oracle. The Triton kernels
(`gpu/fp8_linear.py`, `gpu/moe_fp8.py`) dequantize weight tiles in registers the same
way at decode, and at prefill quantize activations per token and 128-column group
(`quantize_groups`, the reference for their interpreter tests) for FP8 tensor-core dots.
"""

from __future__ import annotations

import torch

from .backend import use_triton
from .invariant_linear import row_invariant_linear

__all__ = ["BLOCK", "FP8", "FP8_MAX", "check_k_cut", "dequantize", "expand_block_scales", "fp8_linear",
           "fp8_linear_ref", "f16_grid", "quantize_blocks", "quantize_groups", "slice_k_blocks"]

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (q ``[..., N, K]`` fp8, block scales ``[..., ceil(N/128),
    ceil(K/128)]`` float32) with ``q * s`` approximating w per 128 x 128 block (the block's
    largest magnitude maps to 448; an all-zero block gets scale 1)."""
    *lead, n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    padded = w.new_zeros((*lead, nb * BLOCK, kb * BLOCK), dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    tiles = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].to(FP8)
    return q.contiguous(), scale


def expand_block_scales(block_scales: torch.Tensor, n: int) -> torch.Tensor:
    """Block scales ``[..., ceil(N/128), KB]`` -> per-row scales ``[..., N, KB]``."""
    return block_scales.float().repeat_interleave(BLOCK, dim=-2)[..., :n, :].contiguous()


def check_k_cut(k: int, start: int, stop: int) -> None:
    """ValueError unless columns ``[start, stop)`` of a K-wide weight fall on 128-column
    blocks (or end at K)."""
    if start % BLOCK or (stop % BLOCK and stop != k):
        raise ValueError(f"an FP8 weight's columns can be cut only on {BLOCK}-column blocks: "
                         f"[{start}, {stop}) of {k} (choose a TP size whose shards align)")


def slice_k_blocks(scales: torch.Tensor, k: int, start: int, stop: int) -> torch.Tensor:
    """Per-row scales of the columns ``[start, stop)`` of a K-wide weight (`check_k_cut`)."""
    check_k_cut(k, start, stop)
    return scales[..., start // BLOCK:_blocks(stop)].contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., N, K]`` fp8 with per-row scales ``[..., N, ceil(K/128)]`` -> ``dtype``."""
    k = q.shape[-1]
    s = scales.float().repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scales), bias)`` in ``x.dtype`` (the reference)."""
    return row_invariant_linear(x, dequantize(q, scales, x.dtype), bias)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp8_linear_ref`'s contract; the Triton kernel (`gpu/fp8_linear.py`: FP8
    activations past 16 rows) when :func:`~phalanx.kernels.backend.use_triton` says so."""
    if use_triton(x) and x.dim() == 2:
        from .gpu.fp8_linear import fp8_linear_triton

        return fp8_linear_triton(x, q, scales, bias)
    return fp8_linear_ref(x, q, scales, bias)


def _row_groups(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` in float32 as ``[M, ceil(K/128), 128]``, the last group zero-padded."""
    m, k = x.shape
    padded = x.new_zeros((m, _blocks(k) * BLOCK), dtype=torch.float32)
    padded[:, :k] = x.float()
    return padded.view(m, -1, BLOCK)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [M, K]`` -> (fp8 ``[M, K]``, scales ``[M, ceil(K/128)]``): each row's
    128-column groups scaled so their largest magnitude maps to 448 (what the FP8 GEMMs
    do on the fly)."""
    m, k = x.shape
    groups = _row_groups(x)
    kb = groups.shape[1]
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, kb * BLOCK)[:, :k]
    return q.to(FP8).contiguous(), scale


def f16_grid(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` as the FP8 kernels' ``SCALE_AFTER`` mode dots it (`gpu/fp8_quant.f16_rows`),
    in float32: each row's 128-column groups scaled by the power of two that puts their
    largest magnitude in ``[2^14, 2^15)``, rounded to float16, scaled back. Exact for
    bf16 and fp16 values within 2^28 of their group's largest."""
    m, k = x.shape
    groups = _row_groups(x)
    kb = groups.shape[1]
    exp = torch.frexp(groups.abs().amax(dim=-1))[1] - 1  # amax = m * 2^exp, m in [1, 2)
    p = torch.ldexp(torch.ones_like(groups[..., 0]), (exp - 14).clamp(min=-126))
    return ((groups / p[..., None]).half().float() * p[..., None]).view(m, kb * BLOCK)[:, :k]
