"""RMSNorm kernels (torch reference; numerically identical to HF ``Qwen3MoeRMSNorm``)."""

from __future__ import annotations

import torch

from .backend import use_triton

__all__ = ["rms_norm", "rms_norm_ref", "add_rms_norm", "add_rms_norm_ref"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dim, bit-exact with HF ``Qwen3MoeRMSNorm``.

    Args:
        x: [..., H], any float dtype.
        weight: [H]. Usually the same dtype as ``x``.
        eps: added to the mean square before ``rsqrt``.

    Returns:
        ``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)``, shape [..., H].
        Statistics are computed in float32; the normalized value is rounded to
        ``x.dtype`` *before* the weight multiply (HF order). The result dtype is
        the type promotion of ``weight.dtype`` and ``x.dtype``.
    """
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. See :func:`rms_norm_ref` for the contract.

    Runs the Triton kernel when :func:`~phalanx.kernels.backend.use_triton` says so.
    """
    if use_triton(x):
        from .gpu.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference fused residual-add + RMSNorm.

    Args:
        x: [..., H] (e.g. the attention / MoE block output).
        residual: [..., H], same shape as ``x``.
        weight, eps: as in :func:`rms_norm_ref`.

    Returns:
        ``(normed, new_residual)`` where ``new_residual = (x + residual)`` in
        ``x.dtype`` and ``normed = rms_norm(new_residual, weight, eps)``.
        Inputs are not modified.
    """
    new_residual = (x + residual).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual-add + RMSNorm. See :func:`add_rms_norm_ref` for the contract.

    Runs the Triton kernel when :func:`~phalanx.kernels.backend.use_triton` says so.
    """
    if use_triton(x):
        from .gpu.norm import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
