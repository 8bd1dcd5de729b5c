"""Dense linear layers: ``F.linear`` semantics, a Triton skinny GEMM for few rows.

At decode a projection sees M = batch rows (1..16 at small batch) against a weight of
millions of elements: the cost is the weight stream, and cuBLAS's M = 1 kernels reach
about half the HBM bandwidth there (bench/NOTES.md). :func:`linear` sends such calls to
:func:`phalanx.kernels.gpu.linear.skinny_linear_triton` and everything else (prefill,
big batches, CPU tensors, odd dtypes or layouts) to ``F.linear``.

Not wired into the model: on the H200 (graph replay, 48-layer Qwen3-30B-A3B shape) the
default tiles made the batch-1 step slower than cuBLAS (1220 vs ~1050 µs/step for qkv +
o + router); with the sweep's best tiles (qkv 64/128, o 16/256 split 2, router 16/256
split 8) the model gained 1% at batch 1 (1020 vs 1043 µs/step, replay 3.45 vs 3.49 ms)
and lost 1.4% at batch 16 (bench/NOTES.md, v6), so it stays on ``F.linear``. What
would make it pay: programmatic dependent launch with the weight tile loaded before the
wait on the previous kernel (bench/probes/pdl_gpu.py), which cuBLAS cannot do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton

__all__ = ["linear", "linear_ref", "use_skinny", "SKINNY_MAX_M"]

SKINNY_MAX_M = 16  # most rows of x for the Triton path (its x tile is 16 rows)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear(x, weight, bias)`` = ``x @ weight.T + bias``."""
    return F.linear(x, weight, bias)


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` takes the Triton path for these arguments.

    True iff :func:`~phalanx.kernels.backend.use_triton` ``(x)``, ``x`` is 2-D with
    1..``SKINNY_MAX_M`` rows, ``weight`` is 2-D [N, K] with a contiguous last dim, and
    x, weight (and bias, 1-D [N]) share one dtype among bf16 / fp16 / fp32.
    """
    if x.dim() != 2 or not 1 <= x.shape[0] <= SKINNY_MAX_M or x.dtype not in _DTYPES:
        return False
    if weight.dim() != 2 or weight.dtype != x.dtype or weight.shape[1] != x.shape[1] or weight.stride(1) != 1:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],)):
        return False
    return use_triton(x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [M, K], weight [N, K], bias [N] or None -> [M, N].

    Output in ``x.dtype``, float32 accumulation. Takes the Triton skinny GEMM when
    :func:`use_skinny` says so (one or two launches, no host sync: CUDA-graph
    capturable), else ``F.linear``. Results of the two paths agree within float32
    accumulation-order rounding, not bit for bit.
    """
    if use_skinny(x, weight, bias):
        from .gpu.linear import skinny_linear_triton

        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
