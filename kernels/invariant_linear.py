"""A linear layer whose every output row has the same bits whatever rows share the call.

CPU GEMMs (MKL, oneDNN) pick their kernel by the number of rows, and the kernels sum in
different orders: on the 2-core VM a float32 row's bits differ between 1, 2-3 and 4+ rows,
and with two threads in a tail of fewer than 4 rows. Rows padded with zeros to a multiple
of `CPU_ROW_QUANTUM` always meet the same kernel, so a request's logits do not depend on
its batch (ARCHITECTURE §5: a seeded replay after a recovery is exact only so;
tests/test_batch_invariance.py). At a one-row decode the padding costs the CPU a 4-row
GEMM where a GEMV would run: the same weight bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton
from .batch_invariant import batch_invariant_on

__all__ = ["row_invariant_linear", "CPU_ROW_QUANTUM"]

CPU_ROW_QUANTUM = 4


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on CPU, x's rows (leading dims flattened) padded
    with zero rows to a multiple of `CPU_ROW_QUANTUM`. On a GPU in the batch-invariant
    mode (kernels/batch_invariant.py) the Triton GEMM of kernels/gpu/invariant_gemm.py;
    otherwise ``F.linear``."""
    if x.device.type != "cpu" or x.dim() < 2:
        if batch_invariant_on() and use_triton(x) and x.dim() >= 2 and weight.dtype == x.dtype:
            from .gpu.invariant_gemm import invariant_linear_triton

            return invariant_linear_triton(x, weight, bias)
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = -m % CPU_ROW_QUANTUM
    out = F.linear(F.pad(rows, (0, 0, 0, pad)) if pad else rows, weight, bias)
    return (out[:m] if pad else out).reshape(*x.shape[:-1], weight.shape[0])
