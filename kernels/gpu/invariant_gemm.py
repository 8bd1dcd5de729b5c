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

__all__ = ["invariant_linear_triton", "invariant_config"]


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    # out[m, n] = round(sum over K blocks kb = 0, 1, ... of dot(x[m, kb], w[n, kb]) (+ bias[n])).
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, nm = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx_m
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, w = row_tiles(x_rows, w_rows, k0 + rk, mm, nm, K, EVEN_K)
        acc = tl.dot(a, tl.trans(w), acc=acc, input_precision=PREC)
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
                            *, cfg: dict | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., K] (leading dims flattened), each row's
    bits independent of the others. ``cfg`` overrides :func:`invariant_config`'s
    BLOCK_M / BLOCK_N / warps / stages (tests: a row's bits under other tiles)."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    rows = x.reshape(math.prod(lead), K)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    M = rows.shape[0]
    out = rows.new_empty((M, N))
    if M and N and K == 0:
        out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    elif M and N:
        c = invariant_config(M, N, K, weight.element_size())
        c.update({key: v for key, v in (cfg or {}).items() if key != "BLOCK_K"})
        grid = (triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(N, c["BLOCK_N"]))
        _gemm_kernel[grid](rows, weight, bias if bias is not None else weight, out, M, N, K,
                           rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                           EVEN_K=K % c["BLOCK_K"] == 0, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                           BLOCK_K=c["BLOCK_K"], PREC=dot_precision(x.dtype), num_warps=c["warps"],
                           num_stages=c["stages"])
    return out.reshape(*lead, N)
