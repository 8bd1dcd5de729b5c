"""Triton RMSNorm, fused residual-add + RMSNorm, and SwiGLU ``silu_and_mul``.

Contracts: :func:`phalanx.kernels.norm.rms_norm_ref`,
:func:`phalanx.kernels.norm.add_rms_norm_ref`,
:func:`phalanx.kernels.activation.silu_and_mul_ref`. One program per row; statistics in
float32; the roundings of the torch reference are reproduced (the normalized value is
cast to the input dtype before the weight multiply; ``silu(gate)`` is rounded to the
input dtype before the ``* up``), so bf16 results match the reference to the last bit
up to the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm_triton", "add_rms_norm_triton", "silu_and_mul_triton", "row_rstd", "norm_warps"]


@triton.jit
def row_rstd(x, H, eps):
    """``rsqrt(mean(x^2) + eps)`` of one row ``x`` [BLOCK_H] (zeros past H), float32. The
    sum's order follows x's register layout: a kernel that repeats a row's norm (the
    batch-invariant GEMM's fold, kernels/gpu/invariant_gemm.py) loads the row as
    ``_rms_norm_kernel`` does, with `norm_warps` warps, to get these bits."""
    h = x.to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
    B, H, sxa, sxb, sra, srb, eps,
    HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Rows are addressed as [A, B] (a = row // B, b = row % B) with element strides
    # (sxa, sxb) so strided views such as q = qkv[:, :q].view(T, heads, hd) need no copy;
    # the last dim is contiguous. Outputs are contiguous [A*B, H].
    row = tl.program_id(0).to(tl.int64)
    a = row // B
    b = row % B
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    x = tl.load(x_ptr + a * sxa + b * sxb + cols, mask=m, other=0.0)
    in_ty = x.dtype
    if HAS_RES:
        r = tl.load(r_ptr + a * sra + b * srb + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)
        tl.store(res_out_ptr + row * H + cols, x, mask=m)
    normed = (x.to(tl.float32) * row_rstd(x, H, eps)).to(in_ty)  # HF: round before the weight multiply
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` [..., H] as [A, B, H] with a contiguous last dim (copies only if needed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() > 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x


def _launch_norm(x, residual, weight, eps):
    H = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if x.numel() == 0:
        return out, res_out
    x3 = _as_rows(x)
    r3 = _as_rows(residual) if residual is not None else x3
    n_rows = x3.shape[0] * x3.shape[1]
    block_h = triton.next_power_of_2(H)
    _rms_norm_kernel[(n_rows,)](
        x3, r3, weight, out, res_out if res_out is not None else out,
        x3.shape[1], H, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), float(eps),
        HAS_RES=residual is not None, BLOCK_H=block_h, num_warps=norm_warps(H),
    )
    return out, res_out


def norm_warps(H: int) -> int:
    """Warps of a row's program: by the row's width alone."""
    block_h = triton.next_power_of_2(H)
    return 1 if block_h <= 256 else (4 if block_h <= 2048 else 8)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; see ``rms_norm_ref``. Returns a new contiguous tensor."""
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; see ``add_rms_norm_ref``. Inputs untouched."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    return _launch_norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, sx, BLOCK: tl.constexpr):
    # x row: [gate (I) | up (I)] at x_ptr + row * sx; out contiguous [rows, I].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * sx + I + cols, mask=m, other=0.0).to(tl.float32)
    ty = g.dtype
    g = g.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)  # F.silu rounds to the input dtype
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]``; see ``silu_and_mul_ref``."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"last dim must be even (cat(gate, up)), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = min(1024, triton.next_power_of_2(inter))
    grid = (x2.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, inter, x2.stride(0), BLOCK=block, num_warps=4)
    return out
