"""Triton neox-style rotary embedding: q and k of one token in one program.

Contract: :func:`phalanx.kernels.rope.apply_rope_ref`. ``x * cos + rotate_half(x) * sin``
with ``cos``/``sin`` rounded to the activation dtype and each product and the sum
rounded to it as well (torch's op-by-op order), so bf16 matches the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_triton", "caches_on"]


@triton.jit
def _rotate_heads(x_ptr, o_ptr, w_ptr, eps, sh, NH, HALF, c, s, d, dm,
                  BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr):
    # x_ptr: this token's first head; heads sh elements apart, head_dim contiguous.
    # o_ptr: contiguous [NH, 2*HALF] output of this token. c, s: [BLOCK_D2] float32.
    # HAS_NORM: RMS-norm each head first (float32 math, rounded to the activation
    # dtype, then times the weight, rounded again: the reference's order).
    h = tl.arange(0, BLOCK_H)
    m = (h < NH)[:, None] & dm[None, :]
    src = x_ptr + h[:, None] * sh + d[None, :]
    x1 = tl.load(src, mask=m, other=0.0)
    ty = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        r = (1.0 / tl.sqrt(var + eps))[:, None]
        w1 = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        x2 = (w2 * (x2 * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    cc = c.to(ty).to(tl.float32)[None, :]
    ss = s.to(ty).to(tl.float32)[None, :]
    o1 = (x1 * cc).to(ty).to(tl.float32) - (x2 * ss).to(ty).to(tl.float32)
    o2 = (x2 * cc).to(ty).to(tl.float32) + (x1 * ss).to(ty).to(tl.float32)
    dst = o_ptr + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, o1.to(ty), mask=m)
    tl.store(dst + HALF, o2.to(ty), mask=m)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    sqt, sqh, skt, skh, NQ, NK, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D2: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D2)
    dm = d < HALF
    c = tl.load(cos_ptr + pos * HALF + d, mask=dm, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + d, mask=dm, other=0.0)
    _rotate_heads(q_ptr + t * sqt, qo_ptr + t * NQ * 2 * HALF, qw_ptr, eps, sqh, NQ, HALF, c, s, d, dm,
                  BLOCK_HQ, HAS_NORM)
    _rotate_heads(k_ptr + t * skt, ko_ptr + t * NK * 2 * HALF, kw_ptr, eps, skh, NK, HALF, c, s, d, dm,
                  BLOCK_HK, HAS_NORM)


def caches_on(rope, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope``'s float32 cos/sin caches on ``device``, copied once and kept on the object."""
    if rope.cos_cache.device == device:
        return rope.cos_cache, rope.sin_cache
    kept = rope.__dict__.setdefault("_caches_by_device", {})
    if device not in kept:
        kept[device] = (rope.cos_cache.to(device).contiguous(), rope.sin_cache.to(device).contiguous())
    return kept[device]


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, NQ, D] and k [T, NK, D] (strided views fine; D contiguous),
    RMS-norming each head first when ``q_norm``/``k_norm`` [D] are given.

    ``positions`` int [T], in range (the caller checks); caches float32 contiguous
    [max_position, D // 2] on the same device. Returns new contiguous tensors.
    """
    T, nq, hd = q.shape
    nk = k.shape[1]
    q_out = torch.empty((T, nq, hd), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, nk, hd), dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    half = hd // 2
    _rope_kernel[(T,)](
        q, k, q_out, k_out, positions, cos_cache, sin_cache,
        q_norm if q_norm is not None else q, k_norm if k_norm is not None else k, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), nq, nk, half,
        BLOCK_HQ=triton.next_power_of_2(nq), BLOCK_HK=triton.next_power_of_2(nk),
        BLOCK_D2=triton.next_power_of_2(half), HAS_NORM=q_norm is not None, num_warps=4,
    )
    return q_out, k_out
