"""Gated activation kernels (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import use_triton

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU gate: ``silu(gate) * up``.

    Args:
        x: [..., 2*I], the concatenation ``cat(gate, up)`` along the last dim
           (the output of the fused gate_up projection), any float dtype.

    Returns:
        [..., I] in ``x.dtype``; computed as ``F.silu(gate) * up`` exactly like
        HF (``act_fn(gate) * up`` after ``chunk(2, dim=-1)``).
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dim must be even (cat(gate, up)), got {x.shape[-1]}")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate ``silu(gate) * up``. See :func:`silu_and_mul_ref` for the contract.

    Runs the Triton kernel when :func:`~phalanx.kernels.backend.use_triton` says so.
    """
    if use_triton(x):
        from .gpu.norm import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
