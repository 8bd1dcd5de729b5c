"""Triton GEMV for a few rows (decode at batch <= ``GEMV_MAX_M`` of kernels/linear.py),
optionally with the residual add + RMSNorm in front of the projection fused in.

Contracts: :func:`phalanx.kernels.linear.linear_ref` (``y = x @ weight.T + bias``) and
:func:`phalanx.kernels.norm_linear.norm_linear_ref` (``y`` of the normed rows, the normed
rows, the new residual).

Layout and schedule (a weight stream: qkv 2048 -> 5120, o 4096 -> 2048, router
2048 -> 128 on Qwen3-30B-A3B):

* program ``p`` owns weight rows ``p*BLOCK_N ..`` over the whole K (``BLOCK_K`` = K
  rounded up to a power of two); the tile ``[BLOCK_N, BLOCK_K]`` (at most 64 KiB) is
  loaded into registers *first*, each row along its contiguous K, so every weight byte
  is read once and all of a program's bytes are in flight together;
* ``PDL`` (kernels/gpu/pdl.py): the program lets the next kernel launch, loads its
  weight tile (and the norm weight and bias), and only then waits for the kernel before
  it; so its weight reads overlap the previous kernel's tail and the next kernel's
  overlap this one's. Every program waits, and stores only after the wait;
* ``NORM``: each program recomputes the RMSNorm of its x rows from L2 (K elements, float32
  statistics, the reference's roundings: ``x + residual`` rounded to the dtype, the
  normed value rounded before the weight multiply, the product rounded); program 0
  stores the new residual and, with ``WRITE_NORMED``, the normed rows for the layer's
  other consumers (the experts read them after the router's projection);
* the ``M`` rows (constexpr, <= 4) are dotted one after another with FMA ``tl.sum`` in
  float32, the bias added in float32 before the one rounding: a row's result does not
  depend on M.

Nothing syncs with the host; the grid comes from shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, pdl_launch

__all__ = ["gemv_triton", "gemv_block_n", "gemv_rows", "fp8_form", "GEMV_TILE_BYTES"]

GEMV_TILE_BYTES = 64 << 10  # a program's weight tile (kernels/linear.py's GEMV_ROW_BYTES equals it)
_PROGRAMS = 128  # aim: about one program per SM or more, for bytes in flight
# FP8 weights take half bf16's rows per program, not the 64 KiB tile's twice as many:
# dequantizing is ALU work, and the o projection's 16 rows of 4096 codes ran one 4-warp
# program an SM at 255 registers. One H100, the 48-layer qkv/o/router chain at M = 1
# (kernels_gpu --only gemv, bench/NOTES.md): qkv 16 / o 16 rows 794 us, qkv 8 / o 4 588.
FP8_HALF_ROWS = True
# FP8 codes dotted with x in float32 a 128-column block at a time and each block's sum
# scaled once (`gemv_rows`' FP8 form 2: exact products, no rounding of ``q * s`` to x's
# dtype; per code a conversion and an FMA; sm_90 SASS of the qkv tile 1,152 -> 752
# instructions) instead of each code dequantized as the reference does (form 1). One
# H100, 24 layers, FP8 decode at batch 1: 623 against 607 tok/s (bench/NOTES.md;
# `decode_gpu.py --quantization fp8 --baselines fp8gemvdeq` runs form 1 beside it).
FP8_SUM_AFTER = True


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_ptr, xn_ptr,
    N, K, sx, sr, sw, ss, sy, eps,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    gemv_rows(tl.program_id(0), x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_ptr, xn_ptr,
              N, K, sx, sr, sw, ss, sy, eps, M, BLOCK_N, BLOCK_K, FP8, GROUP, NORM, HAS_RES,
              WRITE_NORMED, HAS_BIAS, PDL)


@triton.jit
def gemv_rows(
    pid, x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_ptr, xn_ptr,
    N, K, sx, sr, sw, ss, sy, eps,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program ``pid``'s rows of y for all M rows of x (the module docstring's schedule).
    FP8 (0: off): w holds e4m3 codes, ``s_ptr`` their scales per row and 128-column block
    (GROUP = min(128, BLOCK_K) columns share a scale within the tile); the codes are loaded
    as [BLOCK_N, BLOCK_K / GROUP, GROUP], a scale block per middle index (a 2-D tile
    reshaped to the blocks ran a 48-layer chain at M = 1 in 840 µs against 797 on one H100,
    bench/NOTES.md). Form 1 dequantizes each code as kernels/fp8.dequantize does (in x's
    dtype); form 2 (`FP8_SUM_AFTER`) sums each block's code * x in float32, then scales."""
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    nm = n < N
    km = k < K
    if PDL:
        gdc_launch_dependents()
    if FP8:  # the codes as [BLOCK_N, K/GROUP, GROUP]: a scale block per middle index
        kb3 = tl.arange(0, BLOCK_K // GROUP)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
        w = tl.load(w_ptr + n[:, None, None].to(tl.int64) * sw + kb3,
                    mask=nm[:, None, None] & (kb3 < K), other=0.0)
    else:
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0)
    if FP8:
        kb = tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(s_ptr + n[:, None].to(tl.int64) * ss + kb[None, :],
                    mask=nm[:, None] & (kb * GROUP < K)[None, :], other=0.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    first = km & ((k * 0 + pid) == 0)  # program 0 stores the rows every program recomputes
    for m in tl.static_range(M):
        x = tl.load(x_ptr + m * sx + k, mask=km, other=0.0)
        if NORM:
            ty = x.dtype
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(r_ptr + m * sr + k, mask=km, other=0.0).to(tl.float32)).to(ty)
                tl.store(res_ptr + m * K + k, x, mask=first)
            h = x.to(tl.float32)
            var = tl.sum(h * h, axis=0) / K
            normed = (h * tl.rsqrt(var + eps)).to(ty)
            x = (nw * normed.to(tl.float32)).to(ty)
            if WRITE_NORMED:
                tl.store(xn_ptr + m * K + k, x, mask=first)
        if FP8 == 2:  # [BLOCK_N, blocks] sums of code * x, each scaled once
            xg = tl.reshape(x.to(tl.float32), [BLOCK_K // GROUP, GROUP])
            acc = tl.sum(tl.sum(w.to(tl.float32) * xg[None, :, :], axis=2) * s, axis=1)
        elif FP8:  # dequantized in registers as kernels/fp8.dequantize does, in x's dtype
            wd = (w.to(tl.float32) * s[:, :, None])
            wd = wd.to(x.dtype).to(tl.float32)
            xg = tl.reshape(x.to(tl.float32), [BLOCK_K // GROUP, GROUP])
            acc = tl.sum(tl.sum(wd * xg[None, :, :], axis=2), axis=1)
        else:
            acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += b
        tl.store(y_ptr + m * sy + n, acc.to(y_ptr.dtype.element_ty), mask=nm)


def fp8_form(scales: torch.Tensor | None) -> int:
    """The ``FP8`` constexpr of `gemv_rows` for a weight with these scales (None: bf16)."""
    if scales is None:
        return 0
    return 2 if FP8_SUM_AFTER else 1


def gemv_block_n(n: int, k: int, elem_bytes: int) -> int:
    """Weight rows per program: a power of two, the tile within ``GEMV_TILE_BYTES``, and
    about ``_PROGRAMS`` programs or more (qkv 16 -> 320 programs, o 8 -> 256, router 1 -> 128);
    0 when a single row of K does not fit (the caller takes another path). FP8 codes
    (``elem_bytes`` 1, ``FP8_HALF_ROWS``): half bf16's rows (qkv 8, o 4)."""
    rows = _rows(n, k, elem_bytes)
    if elem_bytes == 1 and rows and FP8_HALF_ROWS:
        wide = _rows(n, k, 2)
        rows = max(1, (min(rows, wide) if wide else rows) // 2)
    return rows


def _rows(n: int, k: int, elem_bytes: int) -> int:
    cap = GEMV_TILE_BYTES // (triton.next_power_of_2(k) * elem_bytes)
    if cap < 1:
        return 0
    want = max(1, n // _PROGRAMS)
    return min(1 << (want.bit_length() - 1), 1 << (cap.bit_length() - 1), 16)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
                want_normed: bool = False, cfg: dict | None = None,
                scales: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y, normed, new_residual)``. x [M, K] (M <= ``GEMV_MAX_M``, K contiguous),
    weight [N, K] (K contiguous), bias [N] or None, one dtype; M >= 1. With ``scales``
    [N, ceil(K/128)] float32 the weight is FP8 codes (`kernels/fp8.py`): y is
    ``x @ dequantize(weight, scales, x.dtype).T``.

    Without ``norm``: ``y = x @ weight.T + bias``; normed and new_residual are None.
    With ``norm = (residual or None, norm_weight [K], eps)``: the rows projected are
    ``rms_norm(x + residual)`` (of ``x`` when residual is None); ``new_residual`` is
    ``x + residual`` (``x`` itself when None) and ``normed`` the normed rows when
    ``want_normed`` (else None). The caller checks shapes and dtypes
    (:func:`phalanx.kernels.linear.use_gemv`). ``cfg`` overrides the tiles (benchmarks):
    ``BLOCK_N`` (within the 64 KiB tile), ``warps``."""
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = x.new_empty((M, N))
    residual, nw, eps = norm if norm is not None else (None, x, 0.0)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    res_out = x.new_empty((M, K)) if residual is not None else None
    normed = x.new_empty((M, K)) if norm is not None and want_normed else None
    block_n = (cfg or {}).get("BLOCK_N") or gemv_block_n(N, K, weight.element_size())
    r = residual if residual is not None else x
    # 4 warps: on the H200 a 48-layer qkv/o/router chain at M = 1 took 628 µs with 4 warps
    # against 732 with 8 (qkv 16 rows, o 8; bench/NOTES.md).
    warps = (cfg or {}).get("warps") or 4
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, r, nw, weight, scales if scales is not None else y, bias if bias is not None else y, y,
        res_out if res_out is not None else y, normed if normed is not None else y,
        N, K, x.stride(0), r.stride(0), weight.stride(0), scales.stride(0) if scales is not None else 0,
        y.stride(0), float(eps), M=M, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(K),
        FP8=fp8_form(scales), GROUP=min(128, triton.next_power_of_2(K)), NORM=norm is not None,
        HAS_RES=residual is not None, WRITE_NORMED=normed is not None, HAS_BIAS=bias is not None,
        num_warps=warps, **pdl_launch(x.device, "gemv"),
    )
    if norm is None:
        return y, None, None
    return y, normed, res_out if residual is not None else x
