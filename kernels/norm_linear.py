"""The residual add + RMSNorm in front of a projection, as one operation.

A decoder layer norms its residual stream twice, and each normed row goes straight into
a projection (qkv; the router's, whose normed rows the experts then read). At a few rows
the norm is a launch of its own that costs a few µs for a few KB (bench/NOTES.md, the
B=1 profile), so :func:`norm_linear` folds it into the projection's GEMV
(:mod:`phalanx.kernels.gpu.gemv`) when that kernel takes the call, and otherwise runs the
norm kernel and the projection one after the other. Both paths keep
:func:`norm_linear_ref`'s contract and roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import project, use_gemv
from .norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

__all__ = ["norm_linear", "norm_linear_ref"]

Normed = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, normed, new_residual)``: ``new_residual = x + residual`` rounded to x's dtype
    (``x`` itself when ``residual`` is None), ``normed = rms_norm_ref(new_residual)`` and
    ``y = F.linear(normed, weight, bias)``."""
    if residual is None:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), normed, new_residual


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scales: torch.Tensor | None = None, want_normed: bool = False) -> Normed:
    """:func:`norm_linear_ref`'s ``(y, normed, new_residual)``; ``normed`` may be None
    unless ``want_normed``. ``scales``: the weight is FP8 codes (never fused)."""
    fused = (scales is None and use_gemv(x, weight, bias) and norm_weight.dtype == x.dtype
             and norm_weight.shape == (x.shape[1],)
             and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))
    if fused:
        from .gpu.gemv import gemv_triton

        return gemv_triton(x, weight, bias, norm=(residual, norm_weight, eps), want_normed=want_normed)
    if residual is None:
        normed, new_residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return project(normed, weight, bias, scales), normed, new_residual
