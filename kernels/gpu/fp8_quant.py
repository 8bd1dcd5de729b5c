"""Triton FP8 activation quantization: per token and 128-column group (`kernels/fp8.py`).

Contract: :func:`phalanx.kernels.fp8.quantize_groups` — each row's 128-column groups
scaled so that their largest magnitude maps to 448 (an all-zero group gets scale 1),
codes rounded to nearest-even ``float8_e4m3fn``.

`e4m3_round` rounds explicitly, in float32, to a value ``float8_e4m3fn`` holds exactly,
so the final conversion is exact: Triton's interpreter rounds float32 -> fp8 wrongly when
the rounding carries into the exponent (125.9 -> 64), and the GPU's ``cvt.rn`` gives the
same codes as this rounding, so tests under the interpreter see what the GPU computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["quantize_groups_triton", "e4m3_round", "f16_rows"]

GROUP = 128
FP8_MAX = 448.0
_RNE = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + _RNE) - _RNE rounds |y| < 2**22 to the nearest even integer


@triton.jit
def e4m3_round(v):
    """``v`` (float32, |v| <= 448) rounded to nearest-even on the e4m3 grid: 3 mantissa
    bits, normal exponents from -6, subnormal step 2**-9."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(exp-3), a power of two
    y = v / step  # exact: |y| < 16
    return ((y + _RNE) - _RNE) * step


@triton.jit
def f16_rows(a):
    """``a [R, 128]`` -> (``a / p`` in float16, ``p [R]`` float32): per row the power of two
    ``p`` that puts its largest magnitude in [2^14, 2^15) (`kernels/fp8.f16_grid`); bf16
    and fp16 values within 2^28 of it convert exactly."""
    amax = tl.max(tl.abs(a.to(tl.float32)), axis=1)
    field = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15)  # biased exponent
    p = ((field - 14) << 23).to(tl.float32, bitcast=True)
    inv = ((268 - field) << 23).to(tl.float32, bitcast=True)  # 1 / p, exact
    return (a.to(tl.float32) * inv[:, None]).to(tl.float16), p


@triton.jit
def quantize_group_tile(x, FP8_MAX_C: tl.constexpr, AXIS: tl.constexpr = 1):
    """``x`` [R, 128] float32 -> (codes [R, 128] fp8, scales [R] float32); with AXIS 0
    ``x`` is [128, R], one group a column (the transposed tile)."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX_C), 1.0)
    s = scale[:, None] if AXIS == 1 else scale[None, :]
    q = tl.clamp(tl.math.div_rn(x, s), -FP8_MAX_C, FP8_MAX_C)  # IEEE division, as torch
    return e4m3_round(q).to(tl.float8e4nv), scale


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, sx_m, sq_m, ss_m, ss_g,
                  ROWS: tl.constexpr, GROUP_C: tl.constexpr, FP8_MAX_C: tl.constexpr):
    # Program (rb, g): rows rb*ROWS.., columns of group g; rows M..M_OUT-1 (padding) get
    # what a row of zeros quantizes to (codes 0, scale 1).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP_C + tl.arange(0, GROUP_C)
    cm = cols[None, :] < K
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * sx_m + cols[None, :], mask=(rows < M)[:, None] & cm,
                other=0.0).to(tl.float32)
    q, scale = quantize_group_tile(x, FP8_MAX_C)
    ro = rows < M_OUT
    tl.store(q_ptr + r64[:, None] * sq_m + cols[None, :], q, mask=ro[:, None] & cm)
    tl.store(s_ptr + r64 * ss_m + g * ss_g, scale, mask=ro)


def quantize_groups_triton(x: torch.Tensor, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (fp8 ``[M, K]``, float32 scales ``[M, ceil(K/128)]``); one launch,
    no host sync. ``m_major``: the layout cuBLAS's block-scaled GEMM takes
    (`fp8_linear.CUBLAS_BLOCKWISE`): rows padded to a multiple of 4 (``M4``; a padding row
    is a row of zeros: codes 0, scale 1) and the scales ``[M4, KB]`` with stride ``(1, M4)``."""
    m, k = x.shape
    kb = triton.cdiv(k, GROUP)
    m_out = -(-m // 4) * 4 if m_major else m
    q = torch.empty((m_out, k), dtype=torch.float8_e4m3fn, device=x.device)
    if m_major:
        s = torch.empty((kb, m_out), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = 4
    _quant_kernel[(triton.cdiv(m_out, rows), kb)](
        x, q, s, m, m_out, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        ROWS=rows, GROUP_C=GROUP, FP8_MAX_C=FP8_MAX, num_warps=4)
    return q, s
