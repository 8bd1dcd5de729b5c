"""Triton FP8 linear: a block-scaled FP8 weight times bf16/fp16/fp32 activations.

Contract: :func:`phalanx.kernels.fp8.fp8_linear` (``x [M, K]``, weight codes ``q [N, K]``
``float8_e4m3fn``, per-row scales ``[N, ceil(K/128)]``, optional bias ``[N]`` -> ``[M, N]``
in ``x.dtype``). Two modes of one kernel, chosen from M and x's dtype:

* ``M > SKINNY_MAX_M`` and bf16/fp16 activations (prefill, big batches): activations quantized per token and
  128-column group first (`fp8_quant.quantize_groups_triton`, one launch), then FP8
  tensor-core dots over K blocks of 128: ``acc += dot(a_q, w_q) * a_s[m] * w_s[n]``
  (both operands' scales are constant over a K block). Differs from the reference by the
  activations' quantization (about 2**-4 relative per element, averaging out over K).
* otherwise (decode; float32 compute, which asks for precision): the weight tile is dequantized in registers exactly as
  the reference dequantizes it (``(q * s)`` rounded to x's dtype) and dotted with the
  activations as they are: decode is bound by the weight stream, which this halves
  against bf16; quantizing activations would add a launch and error and save nothing.

On sm_90 with bf16 activations in the first mode, weights loaded with their N-major
scales (`kernels/fp8_cublas.keep_n_major`: only where this GPU runs it) and no bias, the
GEMM is cuBLAS's block-scaled FP8 (``torch._scaled_mm``, activation scales per 128
columns, weight scales per row and 128 columns: the same products) after the same
quantization (`CUBLAS_BLOCKWISE`).

No host sync: CUDA-graph capturable. K blocks of 128 match the scales' blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counts
from .attention import dot_precision
from .fp8_quant import GROUP, f16_rows, quantize_groups_triton

__all__ = ["fp8_linear_triton", "fp8_block_dot", "scales_ahead", "CUBLAS_BLOCKWISE", "SKINNY_MAX_M"]

SKINNY_MAX_M = 16

# The FP8-activation mode's GEMM by cuBLAS where it can (module docstring). One H100, the
# Qwen3-30B-A3B shapes, quantization included (bench/probes/scaled_mm_blockwise.py): qkv at
# M = 16384 468 us against the Triton kernel's 659 (cuBLAS bf16 515), o 431 against 656
# (392); M = 128: qkv 11.8 against 14.4, o 10.6 against 14.0; M = 64 equal or better.
# `decode_gpu.py --quantization fp8 --baselines fp8tritonlin` runs the Triton kernel.
CUBLAS_BLOCKWISE = True


@triton.jit
def scales_ahead(s_ptrs, kb, nm, K, BLOCK_K: tl.constexpr, ON: tl.constexpr):
    """The weight scales of K block ``kb`` (``s_ptrs [BN]``: the tile's rows at block 0,
    ``nm`` the rows that exist; zeros past ``K``), zeros when not ON. SCALE_AFTER loops
    load a block's scales one block ahead: Triton pipelines only loads that feed a dot,
    and these meet the dot's sum after it."""
    if ON:
        inside = nm & (nm.to(tl.int32) * 0 + kb * BLOCK_K < K)  # a tensor mask, as the interpreter wants
        return tl.load(s_ptrs + kb, mask=inside, other=0.0)
    return tl.zeros(s_ptrs.shape, tl.float32)


@triton.jit
def fp8_block_dot(acc, a, a_s, w, w_s, A_FP8: tl.constexpr, SCALE_AFTER: tl.constexpr,
                  PREC: tl.constexpr):
    """One 128-wide K block: ``a [BM, BK]`` (fp8 codes with row scales ``a_s [BM]`` when
    A_FP8, else activations), ``w [BK, BN]`` fp8 codes with column scales ``w_s [BN]``.
    Without A_FP8 the weight is dequantized as the reference does (``q * s`` rounded to
    a's dtype: per code a conversion to float32, a multiply and a rounding), or with
    SCALE_AFTER the codes go to float16 (exact, one conversion per two codes) and are
    dotted with ``a`` on the float16 grid (`f16_rows`: exact for bf16 / fp16 ``a``); the
    block's sum is scaled by both powers: the reference's products without its rounding
    of ``q * s``."""
    if A_FP8:
        return acc + tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    if SCALE_AFTER:
        a16, a_p = f16_rows(a)
        return acc + tl.dot(a16, w.to(tl.float16)) * (a_p[:, None] * w_s[None, :])
    wd = (w.to(tl.float32) * w_s[None, :]).to(a.dtype)
    return tl.dot(a, wd, acc=acc, input_precision=PREC)


@triton.jit(do_not_specialize=["M"])  # M follows the batch (engine/warmup.py)
def _fp8_linear_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr, part_ptr, arrived_ptr, M, N, K,
    sa_m, sas_m, sw_n, sws_n, sc_m,
    HAS_BIAS: tl.constexpr, A_FP8: tl.constexpr, SCALE_AFTER: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # SPLIT_K > 1: the SPLIT_K programs of an output tile (adjacent ids) each sum one
    # share of the K blocks into part[split, M, N] (float32); the last to arrive at the
    # tile's counter (arrivals.py) adds the parts in split order and writes the tile.
    pid = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # programs sharing a band of GROUP_M row blocks (L2 reuse of w)
    first_m = pid // width * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pm = first_m + (pid % width) % size_m
    pn = (pid % width) // size_m
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    nm = rn < N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * sa_m
    w_rows = w_ptr + rn[None, :].to(tl.int64) * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    for kb in range(split * share, tl.minimum((split + 1) * share, tl.cdiv(K, BLOCK_K))):
        k = kb * BLOCK_K + kk
        km = k < K
        a = tl.load(a_rows + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        w_s = tl.load(ws_ptr + rn.to(tl.int64) * sws_n + kb, mask=nm, other=0.0)
        a_s = w_s  # unused unless A_FP8
        if A_FP8:
            a_s = tl.load(as_ptr + rm.to(tl.int64) * sas_m + kb, mask=mm, other=0.0)
        acc = fp8_block_dot(acc, a, a_s, w, w_s, A_FP8, SCALE_AFTER, PREC)
    tile_mask = mm[:, None] & nm[None, :]
    if SPLIT_K > 1:
        cells = rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + (split * M).to(tl.int64) * N + cells, acc, mask=tile_mask)
        tl.debug_barrier()
        if tl.atomic_add(arrived_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.store(arrived_ptr + pid, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for sk in range(0, SPLIT_K):  # other programs wrote the parts: read past L1
                acc += tl.load(part_ptr + (sk * M).to(tl.int64) * N + cells, mask=tile_mask,
                               other=0.0, cache_modifier=".cg")
            _store_tile(acc, bias_ptr, c_ptr, rm, rn, nm, tile_mask, sc_m, HAS_BIAS)
    else:
        _store_tile(acc, bias_ptr, c_ptr, rm, rn, nm, tile_mask, sc_m, HAS_BIAS)


@triton.jit
def _store_tile(acc, bias_ptr, c_ptr, rm, rn, nm, tile_mask, sc_m, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        # the reference adds the bias inside F.linear, in its dtype's GEMM epilogue
        acc += tl.load(bias_ptr + rn, mask=nm, other=0.0).to(tl.float32)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * sc_m + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=tile_mask)


def _tiles(m: int, n: int, k: int, a_fp8: bool) -> dict:
    """Qwen3-30B-A3B qkv / o shapes (bench/probes/fp8_tiles.py, bench/NOTES.md): decode
    tiles of 16 weight rows (the most programs), FP8 dots in 64-row tiles. At decode
    batches up to 128 a program takes at most 2048 columns of K: a longer K is shared by
    programs of 32-row tiles, the last merging (o, K = 4096: 10.1 µs against 16.2 at M = 64,
    13.0 against 22.8 at M = 128 on one H100; qkv's K = 2048 loses with any split)."""
    if not a_fp8:
        return dict(BLOCK_M=16, BLOCK_N=16, warps=4, stages=4, SCALE_AFTER=False)
    if m <= 128 and k > 2048:
        return dict(BLOCK_M=64, BLOCK_N=32, warps=4, stages=3, SCALE_AFTER=False,
                    SPLIT_K=min(8, triton.cdiv(k, 2048)))
    if m <= 1024:
        return dict(BLOCK_M=64, BLOCK_N=64, warps=4, stages=4, SCALE_AFTER=False)
    return dict(BLOCK_M=64, BLOCK_N=128, warps=4, stages=3, SCALE_AFTER=False)


def _cublas_takes(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether cuBLAS's block-scaled GEMM runs this FP8-activation product (module
    docstring): bf16 ``x``, the weight's N-major scales kept (so this GPU runs it), K in
    whole 128-column blocks, N a multiple of 16 (cuBLAS's FP8 alignment)."""
    n, k = q.shape
    return (CUBLAS_BLOCKWISE and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(scales, "n_major")
            and k % GROUP == 0 and n % 16 == 0 and q.is_contiguous() and x.is_contiguous())


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None = None, *, a_fp8: bool | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scales), bias)``; see the module docstring. ``a_fp8``
    forces the mode (None: FP8 activations iff M > SKINNY_MAX_M and x is not float32);
    ``config`` overrides tile keys (BLOCK_M, BLOCK_N, warps, stages, SCALE_AFTER, SPLIT_K:
    K shared by that many programs a tile, the last merging); any ``config``, even empty,
    runs the Triton kernel (not cuBLAS)."""
    m, k = x.shape
    n = q.shape[0]
    if m == 0:
        return x.new_empty((m, n))
    if a_fp8 is None:
        a_fp8 = m > SKINNY_MAX_M and x.dtype != torch.float32
    x = x if x.stride(-1) == 1 else x.contiguous()
    if a_fp8 and config is None and bias is None and _cublas_takes(x, q, scales):
        a, a_s = quantize_groups_triton(x, m_major=True)  # rows padded to a multiple of 4
        return torch._scaled_mm(a, q.t(), scale_a=a_s, scale_b=scales.n_major, out_dtype=x.dtype)[:m]
    out = x.new_empty((m, n))
    a, a_s = quantize_groups_triton(x) if a_fp8 else (x, scales)
    cfg = dict(_tiles(m, n, k, a_fp8), **(config or {}))
    split = cfg.get("SPLIT_K", 1)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1:  # the parts: float32, per call (a graph keeps it in its pool)
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        arrived = arrival_counts("fp8_linear", tiles, x.device)
    else:
        part = arrived = out
    _fp8_linear_kernel[(tiles * split,)](
        a, a_s, q, scales, bias if bias is not None else scales, out, part, arrived, m, n, k,
        a.stride(0), a_s.stride(0), q.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, A_FP8=a_fp8, SCALE_AFTER=cfg["SCALE_AFTER"], PREC=dot_precision(x.dtype),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=GROUP, GROUP_M=8, SPLIT_K=split,
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )
    return out
