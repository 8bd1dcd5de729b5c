"""Dense linear layers: ``F.linear`` semantics, Triton kernels for few rows.

At decode a projection sees M = batch rows against a weight of millions of elements: the
cost is the weight stream, and cuBLAS's M = 1 kernels reach about half the HBM bandwidth
there (bench/NOTES.md). Two Triton paths:

* :func:`phalanx.kernels.gpu.gemv.gemv_triton` for M <= ``GEMV_MAX_M`` (1): the weight
  tile in registers, launched with programmatic dependent launch on sm90+ so its weight
  reads overlap the kernel before it (cuBLAS cannot); also the fused residual add +
  RMSNorm in front of a projection (:mod:`phalanx.kernels.norm_linear`). The model's
  projections take it (:func:`project`).
* :func:`phalanx.kernels.gpu.linear.skinny_linear_triton` for M <= 16: a ``tl.dot``
  skinny GEMM. Not used by the model: with the sweep's best tiles it gained 1% at batch 1
  and lost 1.4% at batch 16 against cuBLAS (bench/NOTES.md, v6). :func:`linear`
  dispatches to it above ``GEMV_MAX_M`` rows.

Everything else (prefill, big batches, CPU tensors, odd dtypes or layouts) is ``F.linear``,
on CPU through :func:`row_invariant_linear`, which in the batch-invariant mode
(kernels/batch_invariant.py) takes every GPU linear too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .batch_invariant import batch_invariant_on
from .invariant_linear import row_invariant_linear

__all__ = ["linear", "linear_ref", "project", "use_gemv", "use_skinny", "GEMV_FP8", "GEMV_MAX_M",
           "GEMV_ROW_BYTES", "SKINNY_MAX_M"]

SKINNY_MAX_M = 16  # most rows of x for the skinny GEMM (its x tile is 16 rows)
# Most rows of x for the GEMV (kernels/gpu/gemv.py takes up to 4; each row is a pass over
# the tile). On the H200 a 48-layer chain of qkv/o/router at M = 4 took 1721 µs against
# cuBLAS's 1317 (at M = 1: 701 against 1304), so only single rows take it.
GEMV_MAX_M = 1
# One weight row (K rounded up to a power of two) must fit a GEMV program's tile: the
# GEMV_TILE_BYTES of kernels/gpu/gemv.py (tests/test_gemv_triton.py checks they agree).
GEMV_ROW_BYTES = 64 << 10
# Whether FP8 codes take the GEMV too (dequantized in its registers). On: at batch 1 on
# one H200, 48 layers, FP8 decode ran 339 tok/s with it against 295 with the FP8 linear,
# tokens equal (bench/decode_gpu.py --quantization fp8 --baselines fp8linear gives the
# rows without it); the interpreter tests run it either way.
GEMV_FP8 = True
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear(x, weight, bias)`` = ``x @ weight.T + bias``."""
    return F.linear(x, weight, bias)


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` takes the Triton path for these arguments.

    True iff :func:`~phalanx.kernels.backend.use_triton` ``(x)``, ``x`` is 2-D with
    1..``SKINNY_MAX_M`` rows, ``weight`` is 2-D [N, K] with a contiguous last dim, and
    x, weight (and bias, 1-D [N]) share one dtype among bf16 / fp16 / fp32; never in the
    batch-invariant mode (kernels/batch_invariant.py), whose linears are one GEMM.
    """
    if batch_invariant_on() or x.dim() != 2 or not 1 <= x.shape[0] <= SKINNY_MAX_M or x.dtype not in _DTYPES:
        return False
    if weight.dim() != 2 or weight.dtype != x.dtype or weight.shape[1] != x.shape[1] or weight.stride(1) != 1:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],)):
        return False
    return use_triton(x)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             scales: torch.Tensor | None = None) -> bool:
    """Whether the GEMV takes these arguments: :func:`use_skinny`'s conditions with
    1..``GEMV_MAX_M`` rows, and one weight row (K rounded up to a power of two) within a
    program's 64 KiB tile. With ``scales``, the weight is FP8 codes with float32 scales
    [N, ceil(K/128)] (kernels/fp8.py), taken only when `GEMV_FP8` is on, and the rest of
    the conditions are the same. Never in the batch-invariant mode."""
    if batch_invariant_on() or x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_M:
        return False
    if scales is None:
        return _gemv_row_fits(x, x.element_size()) and use_skinny(x, weight, bias)
    if not GEMV_FP8:
        return False
    from .fp8 import BLOCK, FP8

    if weight.dim() != 2 or weight.dtype != FP8 or weight.stride(1) != 1 or x.dtype not in _DTYPES:
        return False
    n, k = weight.shape
    if k != x.shape[1] or scales.dtype != torch.float32 or scales.shape != (n, -(-k // BLOCK)):
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,)):
        return False
    return scales.stride(1) == 1 and _gemv_row_fits(x, 1) and use_triton(x)


def _gemv_row_fits(x: torch.Tensor, elem_bytes: int) -> bool:
    return (1 << max(0, int(x.shape[1]) - 1).bit_length()) * elem_bytes <= GEMV_ROW_BYTES


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            scales: torch.Tensor | None = None) -> torch.Tensor:
    """A model projection ``x @ weight.T + bias``: FP8 codes with ``scales``
    (:func:`phalanx.kernels.fp8.fp8_linear`), the GEMV for a few rows (:func:`use_gemv`),
    else :func:`row_invariant_linear`."""
    if use_gemv(x, weight, bias, scales):
        from .gpu.gemv import gemv_triton

        return gemv_triton(x, weight, bias, scales=scales)[0]
    if scales is not None:
        from .fp8 import fp8_linear

        return fp8_linear(x, weight, scales, bias)
    return row_invariant_linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [M, K], weight [N, K], bias [N] or None -> [M, N].

    Output in ``x.dtype``, float32 accumulation. Takes the GEMV when :func:`use_gemv`
    says so, else the Triton skinny GEMM when :func:`use_skinny` does (one or two
    launches, no host sync: CUDA-graph capturable), else :func:`row_invariant_linear`. Results of the
    paths agree within float32 accumulation-order rounding, not bit for bit.
    """
    if use_gemv(x, weight, bias):
        from .gpu.gemv import gemv_triton

        return gemv_triton(x, weight, bias)[0]
    if use_skinny(x, weight, bias):
        from .gpu.linear import skinny_linear_triton

        return skinny_linear_triton(x, weight, bias)
    return row_invariant_linear(x, weight, bias)
