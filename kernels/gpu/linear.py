"""Triton skinny GEMM ``out = x @ weight.T (+ bias)`` for few rows (decode, M <= 16).

Contract: ``torch.nn.functional.linear`` on a 2-D ``x`` [M, K] and a row-major
``weight`` [N, K] (K contiguous), ``bias`` [N] or None; output [M, N] in ``x.dtype``,
float32 accumulation, the bias added in float32 before the single rounding.
Dispatched from :func:`phalanx.kernels.linear.linear` (M <= ``SKINNY_MAX_M``).

At M <= 16 a linear is a pure weight stream (qkv 2048 -> 5120, o 4096 -> 2048, router
2048 -> 128 on Qwen3-30B-A3B: 40 MB per layer against ~0.4 MFLOP per row), so the
kernel is built for bytes in flight, not FLOPs:

* program ``(nb, ks)`` owns output columns ``nb*BLOCK_N ..`` (``BLOCK_N`` weight rows) for
  *all* M rows, so each weight byte is read from HBM exactly once;
* it walks its K range in ``BLOCK_K`` steps; the weight tile ``[BLOCK_N, BLOCK_K]`` is
  loaded along the contiguous K dim (16-byte vectors: K and the row stride are
  specialised as multiples of 16, and with ``EVEN_K`` the K mask disappears) and
  software-pipelined ``num_stages`` deep (cp.async into shared memory);
* the product is one ``tl.dot`` of the x tile padded to 16 rows (masked rows load no
  bytes) with the transposed weight tile, accumulated in float32 (``input_precision``
  "ieee" for float32, so GPU float32 equals the CPU reference closely). Why ``tl.dot``
  rather than an FMA ``tl.sum``: at M = 16 the FMA form needs 16 FMAs per weight
  element, which is the whole fp32 CUDA-core peak of an H200 at 4.2 TB/s of bf16; the
  MMA does them for free and M = 1 costs the same. Each output element's MMA sequence
  depends neither on the other rows nor on M, so a row gets the same bits whatever the
  batch (M <= 16) is, given the (N, K)-only tile choice below.
* ``SPLIT_K > 1`` (off by default) cuts K into ``SPLIT_K`` chunks (multiples of
  ``BLOCK_K``) over a second grid axis; the float32 partials go to a ``[SPLIT_K, M, N]``
  buffer and ``_splitk_reduce_kernel`` sums them in split order, adds the bias and rounds
  once: deterministic, no atomics. It buys parallelism for tiny N (the router: 8
  programs at ``BLOCK_N`` 16) at the price of a second launch, which inside a CUDA graph
  costs ~2 µs (bench/NOTES.md) against a ~2 µs single-launch router; hence off, and
  ``bench/kernels_gpu.py --only linear`` times both.

Nothing syncs with the host; grids come from shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention import dot_precision

__all__ = ["skinny_linear_triton", "linear_config", "BLOCK_M"]

BLOCK_M = 16  # rows of the x tile (tl.dot needs >= 16); rows >= M are masked zeros
# Default-tile knobs (H100/H200: 132 SMs, 228 KB shared memory per SM).
_MANY_PROGRAMS = 256  # enough programs to co-reside ~2-3 per SM and fill the HBM queue
_ROW_BYTES_MANY = 512  # bytes of one weight row per K step when programs are plentiful
_ROW_BYTES_FEW = 1024  # ... and when they are few: deeper tiles keep bytes in flight


@triton.jit
def row_tiles(x_rows, w_rows, k, mm, nm, k_hi, EVEN_K: tl.constexpr):
    """The x tile [M, BLOCK_K] and weight tile [N, BLOCK_K] at columns ``k`` of the row
    pointers ``x_rows`` [M, 1] / ``w_rows`` [N, 1] (rows masked by ``mm`` / ``nm``,
    columns from ``k_hi`` on by a mask unless EVEN_K: whole BLOCK_K steps)."""
    if EVEN_K:
        a = tl.load(x_rows + k[None, :], mask=mm[:, None], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=nm[:, None], other=0.0)
    else:
        km = (k < k_hi)[None, :]
        a = tl.load(x_rows + k[None, :], mask=mm[:, None] & km, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km, other=0.0)
    return a, w


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, K_CHUNK, sx_m, sw_n, so_s, so_m,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    # out[m, n] = sum_k x[m, k] * w[n, k] over k in [ks*K_CHUNK, (ks+1)*K_CHUNK) ∩ [0, K).
    # PARTIAL: store the float32 sum at out + ks*so_s (split-K); else bias, round, store.
    nb = tl.program_id(0)
    ks = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm = rm < M
    nm = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx_m  # [BLOCK_M, 1]
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw_n  # [BLOCK_N, 1]
    k_lo = ks * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a, w = row_tiles(x_rows, w_rows, k0 + rk, mm, nm, k_hi, EVEN_K)
        acc = tl.dot(a, tl.trans(w), acc=acc, input_precision=PREC)  # [BLOCK_N, BLOCK_K] tile
    omask = mm[:, None] & nm[None, :]
    if PARTIAL:
        tl.store(out_ptr + ks * so_s + rm[:, None] * so_m + rn[None, :], acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * so_m + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLIT,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # out.flat[i] = round(sum over s = 0..SPLIT-1 in order of part[s].flat[i] (+ bias[i % N])).
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    im = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(part_ptr + s * MN + i, mask=im, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=im, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=im)


@functools.lru_cache(maxsize=None)
def linear_config(N: int, K: int, elem_size: int = 2) -> dict:
    """Default tiles for a weight [N, K] of ``elem_size``-byte elements (a copy per call
    is made by the caller): keys BLOCK_N, BLOCK_K, SPLIT_K, warps, stages.

    Depends on (N, K, dtype) only, never on M, so a row's bits do not depend on the batch.
    ``BLOCK_N`` 32 once that still gives >= 256 programs (big N), else 16: the qkv
    (N 5120) gets 320 programs, about 2.4 per SM, all co-resident. ``BLOCK_K`` spans 512
    weight bytes per row then (256 bf16: 8 KB of weight + 8 KB of x tile per stage; the
    pipeliner keeps stages - 1 = 3 buffers, 48 KB of shared memory), or 1024 when
    programs are few (o: 128 programs of 16 rows x 4096; router: 8) so that each keeps
    3 x 16 KB of weight in flight (96 KB of shared memory, ~6 MB in flight for o: above
    the ~4 MB that 4.2 TB/s x ~1 µs of latency needs). 4 stages, 4 warps; no split-K
    (see the module docstring). All sweep configs compile for sm_90a without spills
    (48-80 registers), but none is tuned on the GPU yet: ``bench/kernels_gpu.py --only
    linear`` times the alternatives.
    """
    block_n = 32 if triton.cdiv(N, 32) >= _MANY_PROGRAMS else 16
    few = triton.cdiv(N, block_n) < _MANY_PROGRAMS
    row_bytes = _ROW_BYTES_FEW if few else _ROW_BYTES_MANY
    block_k = max(16, min(row_bytes // elem_size, triton.next_power_of_2(K)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, warps=4, stages=4)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         *, cfg: dict | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` [M, K] with few rows (meant for M <= 16).

    ``weight`` [N, K] must have a contiguous last dim (any row stride); ``x`` is made
    contiguous along K if it is not (a column-slice view is used as is). ``bias`` [N] or
    None. Output [M, N] in ``x.dtype``. ``cfg`` overrides :func:`linear_config` (keys
    BLOCK_N, BLOCK_K, SPLIT_K, warps, stages; BLOCK_N and BLOCK_K powers of two >= 16).
    Any M works, but M > 16 takes one launch per 16 rows, each re-reading the whole
    weight: that is ``F.linear``'s regime (see :func:`phalanx.kernels.linear.linear`).
    """
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K (stride(1) == 1)")
    out = x.new_empty((M, N))
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    x = x if x.stride(1) == 1 else x.contiguous()
    bias = None if bias is None else (bias if bias.stride(0) == 1 else bias.contiguous())
    c = dict(linear_config(N, K, weight.element_size()))
    c.update(cfg or {})
    for lo in range(0, M, BLOCK_M):  # one pass for the intended M <= 16
        _launch(x[lo:lo + BLOCK_M], weight, bias, out[lo:lo + BLOCK_M], c)
    return out


def _launch(x, weight, bias, out, c: dict) -> None:
    """One skinny pass (x.shape[0] <= BLOCK_M) into ``out``, with split-K if asked."""
    M, K = x.shape
    N = weight.shape[0]
    bk = c["BLOCK_K"]
    split = max(1, min(int(c["SPLIT_K"]), triton.cdiv(K, bk)))
    chunk = triton.cdiv(triton.cdiv(K, split), bk) * bk  # whole BLOCK_K steps per split
    meta = dict(HAS_BIAS=bias is not None, EVEN_K=K % bk == 0, BLOCK_M=BLOCK_M,
                BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, PREC=dot_precision(x.dtype),
                num_warps=c["warps"], num_stages=c["stages"])
    b = bias if bias is not None else weight  # dummy pointer without a bias
    grid = (triton.cdiv(N, c["BLOCK_N"]), split)
    if split == 1:
        _skinny_kernel[grid](x, weight, b, out, M, N, K, chunk, x.stride(0), weight.stride(0),
                             0, out.stride(0), PARTIAL=False, **meta)
        return
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _skinny_kernel[grid](x, weight, b, part, M, N, K, chunk, x.stride(0), weight.stride(0),
                         part.stride(0), part.stride(1), PARTIAL=True, **meta)
    block = min(1024, triton.next_power_of_2(M * N))
    _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](  # out: a row slice, contiguous
        part, b, out, M * N, N, split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
