"""Triton ``write_kv``: a step's new keys and values scattered into their paged-cache slots.

Cache layout (see :mod:`phalanx.kernels.attention`): HND pages
``[num_pages, num_kv_heads, page_size, head_dim]``; slot ``s`` is page ``s // page_size``,
offset ``s % page_size``; a negative slot is padding and stores nothing. One program per
token, no host synchronization (capturable in CUDA graphs).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["write_kv_triton"]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    skt, skh, svt, svh, kcp, kch, kct, vcp, vch, vct,
    NKV, HD, PAGE,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per new token: all its kv heads. Slot < 0 = padding, nothing stored.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    n_heads = tl.where(slot >= 0, NKV, 0)  # padding token: every lane masked off
    m = (h < n_heads)[:, None] & (d < HD)[None, :]
    k = tl.load(k_ptr + t * skt + h[:, None] * skh + d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + t * svt + h[:, None] * svh + d[None, :], mask=m, other=0.0)
    tl.store(kc_ptr + page * kcp + h[:, None] * kch + off * kct + d[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + page * vcp + h[:, None] * vch + off * vct + d[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=m)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """In-place scatter of k, v [T, kv_heads, hd] to their slots; see ``write_kv_ref``."""
    T, nkv, hd = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        nkv, hd, k_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(nkv), BLOCK_D=triton.next_power_of_2(hd), num_warps=4,
    )
