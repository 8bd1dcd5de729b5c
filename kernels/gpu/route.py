"""Triton MoE routing: softmax over experts, top-k, optional renormalization, one launch.

Contract: :func:`phalanx.kernels.moe.route_ref`. One program per token row; float32
softmax; the top k are picked by repeated arg-max (ties go to the lower expert id), in
descending probability like ``torch.topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, pdl_launch

__all__ = ["route_triton"]


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, s_t,
                  K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORM: tl.constexpr, PDL: tl.constexpr):
    # PDL (kernels/gpu/pdl.py): launched dependent; wait for the previous kernel first.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(logits_ptr + t * s_t + e, mask=em, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(em, p, 0.0)
    p = p / tl.sum(p, axis=0)
    kk = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_K], tl.int64)
    for i in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        top_w = tl.where(kk == i, best, top_w)
        top_i = tl.where(kk == i, idx.to(tl.int64), top_i)
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(tl.where(kk < K, top_w, 0.0), axis=0)
    km = kk < K
    tl.store(w_ptr + t * K + kk, top_w.to(w_ptr.dtype.element_ty), mask=km)
    tl.store(ids_ptr + t * K + kk, top_i, mask=km)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] out_dtype, ids [T, k] int64)`` from ``router_logits`` [T, E]."""
    T, E = router_logits.shape
    weights = torch.empty((T, top_k), dtype=out_dtype, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    _route_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0),
                        K=top_k, BLOCK_E=triton.next_power_of_2(E),
                        BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize, num_warps=1,
                        **pdl_launch(router_logits.device, "route"))
    return weights, ids
