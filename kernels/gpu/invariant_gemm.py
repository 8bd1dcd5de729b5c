"""Triton GEMM ``out = x @ weight.T (+ bias)`` whose rows do not depend on the batch.

The batch-invariant mode's linear (kernels/batch_invariant.py). cuBLAS picks its kernel,
tile and split-K by the row count, and the one-row GEMV (kernels/gpu/gemv.py) sums in
another order again, so a row's bits change with the rows beside it (on one H100 a
[5120, 2048] projection's row alone against among 2..128 rows: every row differed;
bench/probes/gpu_invariance.py). Here every output element is one chain of ``tl.dot``
steps over K in ``BLOCK_K`` blocks from k = 0 up, accumulated in float32, with no
split-K; ``BLOCK_K`` follows (K, dtype) only. The row and column tiles (``BLOCK_M``,
``BLOCK_N``) follow the shape for speed: an element's chain does not depend on them (the
probe: rows of BLOCK_M 16, 32, 64 and 128 tiles, mma.sync and wgmma alike, have equal
bits in bf16, float32 and tf32), so a row gets the same bits among any rows.

With the norm (:func:`invariant_norm_linear_triton`, up to ``FOLD_MAX_M`` rows): the
residual add + RMSNorm in front of the projection runs in the same launch (a decode
step's norm is otherwise a launch of its own, a few µs for a few KB). A row's statistics
are computed as kernels/gpu/norm.py's kernel computes them: the row loaded whole as its
[BLOCK_H] tile with its warps (``norm_warps``), so the reduction takes the same register
layout and order (checked on sm_90 in the TTGIR; tests/test_gpu.py asserts the bits); the
normed tile is then rounded as that kernel rounds. PDL (kernels/gpu/pdl.py, "gemm"):
every program waits at its start, then lets the next launch begin.

Contract: ``torch.nn.functional.linear`` on a 2-D ``x`` [M, K] and a ``weight`` [N, K]
with a contiguous last dim, ``bias`` [N] or None; output [M, N] in ``x.dtype``; the bias
added in float32 before the single rounding. No host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import dot_precision
from .linear import row_tiles
from .norm import norm_warps, row_rstd
from .pdl import gdc_launch_dependents, gdc_wait, pdl_launch

__all__ = ["invariant_linear_triton", "invariant_norm_linear_triton", "invariant_config", "FOLD_MAX_M"]


@triton.jit
def _leaf_tree(x_rows, w_rows, rk, mm, nm, LEAF_K, EVEN_K: tl.constexpr, LEAVES: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    # sum over leaves l of the dot chain over K in [l * LEAF_K, (l + 1) * LEAF_K), the
    # leaves added as a balanced binary tree in leaf order (models/row_parallel.py);
    # lvl<i> holds the finished left subtree of 2**i leaves waiting for its right one.
    tl.static_assert(LEAVES <= 8)
    lvl0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lvl1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lvl2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for leaf in tl.static_range(LEAVES):
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        lo = leaf * LEAF_K
        for k0 in range(lo, lo + LEAF_K, BLOCK_K):
            a, w = row_tiles(x_rows, w_rows, k0 + rk, mm, nm, lo + LEAF_K, EVEN_K)
            acc = tl.dot(a, tl.trans(w), acc=acc, input_precision=PREC)
        if leaf % 2 == 0:
            lvl0 = acc
        else:
            acc = lvl0 + acc
            if leaf % 4 == 1:
                lvl1 = acc
            else:
                acc = lvl1 + acc
                if leaf % 8 == 3:
                    lvl2 = acc
                else:
                    acc = lvl2 + acc
        total = acc
    return total


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, r_ptr, nw_ptr, res_ptr, xn_ptr, M, N, K, sx_m, sw_n,
                 so_m, sr_m, eps, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr,
                 HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_H: tl.constexpr, PREC: tl.constexpr, LEAVES: tl.constexpr):
    # out[m, n] = round(sum over K blocks kb = 0, 1, ... of dot(a[m, kb], w[n, kb]) (+ bias[n])),
    # a = x, or with NORM the normed rows of x (+ residual) with the bits of the norm
    # kernel's (kernels/gpu/norm.py; BLOCK_H = its row tile); programs of column tile 0
    # store those rows' new residual and (WRITE_NORMED) normed values.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, nm = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw_n
    if PDL:  # kernels/gpu/pdl.py: every program waits before its first read of x
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if NORM:
        r_rows = r_ptr + rm.to(tl.int64)[:, None] * sr_m
        o_rows = rm.to(tl.int64)[:, None] * K
        first = ((rm * 0 + tl.program_id(1)) == 0)[:, None]  # column tile 0 stores
        inv = tl.zeros([BLOCK_M], tl.float32)
        cols = tl.arange(0, BLOCK_H)
        for i in range(0, tl.minimum(BLOCK_M, M - tl.program_id(0) * BLOCK_M)):
            # each row's statistics as the norm kernel computes them (gpu/norm.py): the
            # same row tile, the same reduction, the same warps
            row = (tl.program_id(0) * BLOCK_M + i).to(tl.int64)
            xi = tl.load(x_ptr + row * sx_m + cols, mask=cols < K, other=0.0)
            if HAS_RES:
                xi = (xi.to(tl.float32) + tl.load(r_ptr + row * sr_m + cols, mask=cols < K,
                                                  other=0.0).to(tl.float32)).to(xi.dtype)
            inv = tl.where(tl.arange(0, BLOCK_M) == i, row_rstd(xi, K, eps), inv)
        for k0 in range(0, K, BLOCK_K):
            km = k0 + rk < K
            xm = mm[:, None] & km[None, :]
            h = tl.load(x_rows + k0 + rk[None, :], mask=xm, other=0.0)
            if HAS_RES:
                h = (h.to(tl.float32) + tl.load(r_rows + k0 + rk[None, :], mask=xm, other=0.0).to(
                    tl.float32)).to(h.dtype)
                tl.store(res_ptr + o_rows + k0 + rk[None, :], h, mask=xm & first)
            normed = (h.to(tl.float32) * inv[:, None]).to(h.dtype)
            g = tl.load(nw_ptr + k0 + rk, mask=km, other=0.0).to(tl.float32)
            a = (g[None, :] * normed.to(tl.float32)).to(h.dtype)
            if WRITE_NORMED:
                tl.store(xn_ptr + o_rows + k0 + rk[None, :], a, mask=xm & first)
            w = tl.load(w_rows + k0 + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc=acc, input_precision=PREC)
    elif LEAVES == 1:
        for k0 in range(0, K, BLOCK_K):
            a, w = row_tiles(x_rows, w_rows, k0 + rk, mm, nm, K, EVEN_K)
            acc = tl.dot(a, tl.trans(w), acc=acc, input_precision=PREC)
    else:
        acc = _leaf_tree(x_rows, w_rows, rk, mm, nm, K // LEAVES, EVEN_K, LEAVES, BLOCK_M, BLOCK_N,
                         BLOCK_K, PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * so_m + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def block_k(K: int, elem_size: int) -> int:
    """The K block: 256 bytes of a weight row (128 bf16, 64 float32), less for small K.
    A function of (K, dtype) only: it fixes every element's summation order."""
    return max(16, min(256 // elem_size, triton.next_power_of_2(K)))


def invariant_config(M: int, N: int, K: int, elem_size: int) -> dict:
    """Tiles for an [M, K] x [N, K] product: keys BLOCK_M, BLOCK_N, BLOCK_K, warps,
    stages. Few rows (decode) take narrow column tiles so that many programs stream the
    weight (a [2048, 4096] projection: 128 programs of 16 columns); many rows take
    128 x 128 tiles. Only ``BLOCK_K`` bears on the result (:func:`block_k`)."""
    bk = block_k(K, elem_size)
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=16 if N <= 4096 else 32, BLOCK_K=bk, warps=4, stages=4)
    if M <= 64:
        return dict(BLOCK_M=triton.next_power_of_2(M), BLOCK_N=32, BLOCK_K=bk, warps=4, stages=4)
    if M <= 256:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, warps=4, stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128 if elem_size <= 2 else 64, BLOCK_K=bk, warps=8, stages=3)


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            *, cfg: dict | None = None, out_dtype: torch.dtype | None = None,
                            leaves: int = 1) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., K] (leading dims flattened), each row's
    bits independent of the others. ``cfg`` overrides :func:`invariant_config`'s
    BLOCK_M / BLOCK_N / warps / stages (tests: a row's bits under other tiles);
    ``out_dtype`` (float32: the sums unrounded) defaults to x's. ``leaves`` (1, 2, 4 or
    8, dividing K): K summed in that many equal chunks added as a balanced binary tree
    (models/row_parallel.py), each chunk's chain with the K block of a chunk's width."""
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(math.prod(lead), K)
    out = _launch(rows if rows.stride(-1) == 1 else rows.contiguous(), weight, bias, None, cfg,
                  out_dtype, leaves)[0]
    return out.reshape(*lead, weight.shape[0])


def invariant_norm_linear_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                 eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                 want_normed: bool = False, cfg: dict | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`phalanx.kernels.norm_linear.norm_linear_ref`'s ``(y, normed, new_residual)``
    for x [M, K] in one launch (FOLD_MAX_M rows at most are worth it: every column tile
    redoes the rows' statistics): the normed rows and residual have the bits of
    kernels/gpu/norm.py's kernel, ``y`` those of this GEMM on them. ``normed`` is None
    unless ``want_normed``; the caller checks that ``norm_weight`` [K] and ``residual``
    match x's dtype and shape (kernels/norm_linear.py)."""
    if x.shape[-1] == 0:
        raise ValueError("a norm over rows of width 0")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y, normed, res_out = _launch(x, weight, bias, (residual, norm_weight, eps, want_normed), cfg)
    return y, normed, res_out if residual is not None else x


# Most rows for which norm_linear folds the norm into the GEMM in the mode (each column
# tile redoes the rows' statistics). 0, off: on one H100 the first measurement, with the
# GEMM's PDL ("gemm", kernels/gpu/pdl.py) on too, ran batch-1 decode at 238 tok/s against
# 430 with neither (24 layers; bench/NOTES.md); bench/probes/invariant_fold.py times the
# parts and `decode_gpu.py --baselines invfold,invpdl` each alone. Its bits equal the
# unfolded form's (tests/test_gpu.py sets it to 16).
FOLD_MAX_M = 0


def _launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: tuple | None,
            cfg: dict | None, out_dtype: torch.dtype | None = None, leaves: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    M, K = rows.shape
    N = weight.shape[0]
    if leaves not in (1, 2, 4, 8) or K % leaves or (leaves > 1 and norm is not None):
        raise ValueError(f"leaves={leaves} for K={K} (1, 2, 4 or 8 dividing K; no norm)")
    if weight.dim() != 2 or weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"shapes x {tuple(rows.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    residual, nw, eps, want_normed = norm if norm is not None else (None, rows, 0.0, False)
    out = rows.new_empty((M, N), dtype=out_dtype or rows.dtype)
    res_out = rows.new_empty((M, K)) if residual is not None else None
    normed = rows.new_empty((M, K)) if want_normed else None
    if M and N and K == 0 and norm is None:
        out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    elif M and N and K:
        c = invariant_config(M, N, K // leaves, weight.element_size())
        if leaves > 1:  # the tree's pending subtrees are tiles too
            c["BLOCK_N"] = min(c["BLOCK_N"], 64)
        c.update({key: v for key, v in (cfg or {}).items() if key != "BLOCK_K"})
        if norm is not None:  # the norm kernel's warps: its row reduction's layout
            c["warps"] = norm_warps(K)
        r = residual if residual is not None else rows
        grid = (triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(N, c["BLOCK_N"]))
        _gemm_kernel[grid](rows, weight, bias if bias is not None else weight, out, r, nw,
                           res_out if res_out is not None else out, normed if normed is not None else out,
                           M, N, K, rows.stride(0), weight.stride(0), out.stride(0), r.stride(0),
                           float(eps), HAS_BIAS=bias is not None, EVEN_K=K // leaves % c["BLOCK_K"] == 0,
                           NORM=norm is not None, HAS_RES=residual is not None,
                           WRITE_NORMED=normed is not None, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                           BLOCK_K=c["BLOCK_K"], BLOCK_H=triton.next_power_of_2(K) if norm else 16,
                           PREC=dot_precision(rows.dtype), LEAVES=leaves, num_warps=c["warps"],
                           num_stages=c["stages"], **pdl_launch(rows.device, "gemm"))
    return out, normed, res_out
