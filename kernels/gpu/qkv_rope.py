"""The qkv projection of a few decode rows with the head work folded in: one launch for
what was the input norm, the qkv GEMV and the rope kernel.

Contract: :func:`phalanx.kernels.norm_linear.norm_qkv_rope` (its unfolded path is the
reference). The GEMV is :func:`phalanx.kernels.gpu.gemv.gemv_rows` with the input norm
folded in; then each program arrives at its head's counter (`arrivals.py`, one counter
per row and head, acq_rel at GPU scope after a CTA barrier, so its stores are released),
and the program that completes a head finishes it, reading the head's values past L1:

* a q head: q-normed (when the model has q/k norms) and rotated, in place in the qkv
  buffer (decode attention reads q from there, strided);
* a k head: normed, rotated and stored at the row's KV slot (page-major HND pages; a
  slot < 0 is padding and stores nothing);
* a v head: stored at the slot as it is.

The roundings are the rope kernel's (`rope._norm_rotate`). A program's rows lie within
one head (``BLOCK_N`` divides the head dim, a power of two). Counters are back at zero
after every launch (the finishing program resets its head's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counts
from .gemv import fp8_form, gemv_block_n, gemv_rows
from .pdl import pdl_launch
from .rope import _norm_rotate

__all__ = ["qkv_rope_triton", "qkv_rope_fits"]


@triton.jit
def _qkv_rope_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_ptr,
    N, K, sx, sr, sw, ss, sy, eps,
    pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qk_eps, slot_ptr, arrived_ptr,
    kc_ptr, vc_ptr, kcp, kch, kct, vcp, vch, vct, PAGE, NQ, NK,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, HALF: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    gemv_rows(pid, x_ptr, r_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_ptr, y_ptr, N, K, sx, sr, sw,
              ss, sy, eps, M, BLOCK_N, BLOCK_K, FP8, GROUP, True, HAS_RES, False, HAS_BIAS, PDL)
    tl.debug_barrier()
    head = (pid * BLOCK_N) // (2 * HALF)
    heads = NQ + 2 * NK
    for m in tl.static_range(M):
        ctr = arrived_ptr + m * heads + head
        if tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == (2 * HALF) // BLOCK_N - 1:
            tl.store(ctr, 0)
            _finish_head(y_ptr + m * sy, head, m, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qk_eps,
                         slot_ptr, kc_ptr, vc_ptr, kcp, kch, kct, vcp, vch, vct, PAGE, NQ, NK,
                         HALF, HAS_QK_NORM)


@triton.jit
def _finish_head(row_ptr, head, m, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, slot_ptr,
                 kc_ptr, vc_ptr, kcp, kch, kct, vcp, vch, vct, PAGE, NQ, NK,
                 HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    d = tl.arange(0, HALF)
    dm = d < HALF
    src = row_ptr + head * 2 * HALF + d[None, :]
    x1 = tl.load(src, cache_modifier=".cg")
    x2 = tl.load(src + HALF, cache_modifier=".cg")
    slot = tl.load(slot_ptr + m).to(tl.int64)
    page, off = slot // PAGE, slot % PAGE
    live = (d < tl.where(slot >= 0, HALF, 0))[None, :]
    if head >= NQ + NK:
        dst = vc_ptr + page * vcp + (head - NQ - NK) * vch + off * vct + d[None, :]
        tl.store(dst, x1.to(vc_ptr.dtype.element_ty), mask=live)
        tl.store(dst + HALF, x2.to(vc_ptr.dtype.element_ty), mask=live)
    else:
        pos = tl.load(pos_ptr + m).to(tl.int64)
        c = tl.load(cos_ptr + pos * HALF + d)
        s = tl.load(sin_ptr + pos * HALF + d)
        if head < NQ:
            o1, o2 = _norm_rotate(x1, x2, qw_ptr, eps, HALF, c, s, d, dm, HAS_NORM)
            tl.store(src, o1)
            tl.store(src + HALF, o2)
        else:
            o1, o2 = _norm_rotate(x1, x2, kw_ptr, eps, HALF, c, s, d, dm, HAS_NORM)
            dst = kc_ptr + page * kcp + (head - NQ) * kch + off * kct + d[None, :]
            tl.store(dst, o1.to(kc_ptr.dtype.element_ty), mask=live)
            tl.store(dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=live)


def qkv_rope_fits(n: int, k: int, head_dim: int, elem_bytes: int) -> bool:  # weight's element bytes
    """Whether the folded kernel takes a qkv weight [n, k]: a power-of-two head dim that
    the GEMV's rows per program divide."""
    block_n = gemv_block_n(n, k, elem_bytes)
    return block_n > 0 and head_dim >= 2 and head_dim & (head_dim - 1) == 0 and head_dim % block_n == 0


def qkv_rope_triton(x, residual, norm_weight, eps, weight, bias, positions, cos, sin, q_norm, k_norm,
                    k_cache, v_cache, slots, num_heads: int, num_kv_heads: int, scales=None):
    """``(q [M, num_heads, D], new_residual)``: see the module docstring. ``cos``/``sin``
    float32 [max_position, D/2]; caches [pages, kv_heads, page, D]; ``slots`` int [M];
    ``scales``: the weight is FP8 codes (`gemv_triton`); the caller checks
    `qkv_rope_fits`, dtypes, shapes and positions."""
    M, K = x.shape
    N = weight.shape[0]
    D = N // (num_heads + 2 * num_kv_heads)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y = x.new_empty((M, N))
    res_out = x.new_empty((M, K)) if residual is not None else None
    r = residual if residual is not None else x
    block_n = gemv_block_n(N, K, weight.element_size())
    arrived = arrival_counts("qkv_rope", M * (num_heads + 2 * num_kv_heads), x.device)
    _qkv_rope_kernel[(triton.cdiv(N, block_n),)](
        x, r, norm_weight, weight, scales if scales is not None else y, bias if bias is not None else y, y,
        res_out if res_out is not None else y,
        N, K, x.stride(0), r.stride(0), weight.stride(0), scales.stride(0) if scales is not None else 0,
        y.stride(0), float(eps),
        positions, cos, sin, q_norm if q_norm is not None else norm_weight,
        k_norm if k_norm is not None else norm_weight, float(eps), slots, arrived,
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_cache.shape[2],
        num_heads, num_kv_heads, M=M, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(K),
        FP8=fp8_form(scales), GROUP=min(128, triton.next_power_of_2(K)), HALF=D // 2,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, HAS_QK_NORM=q_norm is not None,
        num_warps=4, **pdl_launch(x.device, "gemv"),
    )
    q = y[:, : num_heads * D].view(M, num_heads, D)
    return q, res_out if residual is not None else x
