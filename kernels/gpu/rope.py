"""Triton neox-style rotary embedding: q and k of one token in one program.

Contract: :func:`phalanx.kernels.rope.apply_rope_ref`. ``x * cos + rotate_half(x) * sin``
with ``cos``/``sin`` rounded to the activation dtype and each product and the sum
rounded to it as well (torch's op-by-op order), so bf16 matches the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, pdl_launch

__all__ = ["rope_triton", "caches_on"]


@triton.jit
def _rotate_heads(x_ptr, w_ptr, eps, sh, NH, HALF, c, s, d, dm,
                  BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr):
    # x_ptr: this token's first head; heads sh elements apart, head_dim contiguous.
    # c, s: [BLOCK_D2] float32. Returns the rotated halves (o1, o2) [BLOCK_H, BLOCK_D2]
    # in the activation dtype and the head-row mask. HAS_NORM: RMS-norm each head
    # first (float32 math, rounded to the activation dtype, then times the weight,
    # rounded again: the reference's order).
    h = tl.arange(0, BLOCK_H)
    m = (h < NH)[:, None] & dm[None, :]
    src = x_ptr + h[:, None] * sh + d[None, :]
    x1 = tl.load(src, mask=m, other=0.0)
    x2 = tl.load(src + HALF, mask=m, other=0.0)
    o1, o2 = _norm_rotate(x1, x2, w_ptr, eps, HALF, c, s, d, dm, HAS_NORM)
    return o1, o2, m


@triton.jit
def _norm_rotate(x1, x2, w_ptr, eps, HALF, c, s, d, dm, HAS_NORM: tl.constexpr):
    # Halves x1, x2 [BLOCK_H, BLOCK_D2] of heads in the activation dtype -> the rotated
    # halves in it (see _rotate_heads for the roundings).
    ty = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
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
    return o1.to(ty), o2.to(ty)


@triton.jit
def _store_heads(o_ptr, sh, o1, o2, m, d, HALF, BLOCK_H: tl.constexpr):
    dst = o_ptr + tl.arange(0, BLOCK_H)[:, None] * sh + d[None, :]
    tl.store(dst, o1.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF, o2.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    sqt, sqh, skt, skh, NQ, NK, HALF,
    v_ptr, kc_ptr, vc_ptr, slot_ptr, svt, svh, kcp, kch, kct, vcp, vch, vct, PAGE,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D2: tl.constexpr,
    HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, STORE_K: tl.constexpr, PDL: tl.constexpr,
):
    # One program per token. WRITE_KV: also store the rotated k and the token's v at its
    # KV slot (write_kv's contract: page-major HND pages, slot < 0 = padding, no store).
    # STORE_K: store the rotated k to ko_ptr too (off when only the cache needs it).
    # PDL (kernels/gpu/pdl.py): launched dependent; wait for the previous kernel first.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D2)
    dm = d < HALF
    c = tl.load(cos_ptr + pos * HALF + d, mask=dm, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + d, mask=dm, other=0.0)
    q1, q2, qm = _rotate_heads(q_ptr + t * sqt, qw_ptr, eps, sqh, NQ, HALF, c, s, d, dm,
                               BLOCK_HQ, HAS_NORM)
    _store_heads(qo_ptr + t * NQ * 2 * HALF, 2 * HALF, q1, q2, qm, d, HALF, BLOCK_HQ)
    k1, k2, km = _rotate_heads(k_ptr + t * skt, kw_ptr, eps, skh, NK, HALF, c, s, d, dm,
                               BLOCK_HK, HAS_NORM)
    if STORE_K:
        _store_heads(ko_ptr + t * NK * 2 * HALF, 2 * HALF, k1, k2, km, d, HALF, BLOCK_HK)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        hh = tl.arange(0, BLOCK_HK)
        live = (hh < tl.where(slot >= 0, NK, 0))[:, None] & dm[None, :]
        page, off = slot // PAGE, slot % PAGE
        _store_heads(kc_ptr + page * kcp + off * kct, kch, k1, k2, live, d, HALF, BLOCK_HK)
        v_src = v_ptr + t * svt + hh[:, None] * svh + d[None, :]
        v1 = tl.load(v_src, mask=live, other=0.0)
        v2 = tl.load(v_src + HALF, mask=live, other=0.0)
        _store_heads(vc_ptr + page * vcp + off * vct, vch, v1, v2, live, d, HALF, BLOCK_HK)


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
    kv_write: tuple | None = None, keep_k: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, NQ, D] and k [T, NK, D] (strided views fine; D contiguous),
    RMS-norming each head first when ``q_norm``/``k_norm`` [D] are given.

    ``positions`` int [T], in range (the caller checks); caches float32 contiguous
    [max_position, D // 2] on the same device. Returns new contiguous tensors (k: None
    when not ``keep_k``, e.g. when only the cache needs it).
    ``kv_write = (v, k_cache, v_cache, slot_mapping)``: in the same launch, store the
    rotated k and v [T, NK, D] at their slots (see ``write_kv_ref``).
    """
    T, nq, hd = q.shape
    nk = k.shape[1]
    q_out = torch.empty((T, nq, hd), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, nk, hd), dtype=k.dtype, device=k.device) if keep_k else None
    if T == 0:
        return q_out, k_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if kv_write is not None:
        v, kc, vc, slots = kv_write
        v = v if v.stride(-1) == 1 else v.contiguous()
        cache_args = (v, kc, vc, slots, v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
                      kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), kc.shape[2])
    else:
        cache_args = (k, k, k, positions) + (0,) * 9
    half = hd // 2
    _rope_kernel[(T,)](
        q, k, q_out, k_out if keep_k else q_out, positions, cos_cache, sin_cache,
        q_norm if q_norm is not None else q, k_norm if k_norm is not None else k, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), nq, nk, half, *cache_args,
        BLOCK_HQ=triton.next_power_of_2(nq), BLOCK_HK=triton.next_power_of_2(nk),
        BLOCK_D2=triton.next_power_of_2(half), HAS_NORM=q_norm is not None,
        WRITE_KV=kv_write is not None, STORE_K=keep_k, num_warps=4, **pdl_launch(q.device, "rope"),
    )
    return q_out, k_out
