"""Triton MoE routing: softmax over experts, top-k, optional renormalization, one launch;
and for decode-sized batches the router projection fused in front of it.

Contract: :func:`phalanx.kernels.moe.route_ref` (and :func:`~phalanx.kernels.moe.router_topk_ref`
for the fused form). Float32 softmax; the top k are picked by repeated arg-max (ties go
to the lower expert id), in descending probability like ``torch.topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe import ROUTER_FUSED_MAX_TOKENS
from .arrivals import arrival_counts

__all__ = ["route_triton", "router_topk_triton"]


@triton.jit
def _topk_row(logits_row, w_row, ids_row, E,
              K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
    """Routing of one token from its logits row (read past L1: the row may have been
    written by other programs of the same launch)."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(logits_row + e, mask=em, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
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
    tl.store(w_row + kk, top_w.to(w_row.dtype.element_ty), mask=km)
    tl.store(ids_row + kk, top_i, mask=km)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, s_t,
                  K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    _topk_row(logits_ptr + t * s_t, w_ptr + t * K, ids_ptr + t * K, E, K, BLOCK_E, BLOCK_K, RENORM)


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
                        BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize, num_warps=1)
    return weights, ids


@triton.jit
def _router_topk_kernel(x_ptr, gate_ptr, logits_ptr, w_ptr, ids_ptr, arrived_ptr,
                        T, E, HID, sx_t, sg_e,
                        K: tl.constexpr, BLOCK_EP: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
    # Program eb (one warp): logits[t, BLOCK_EP experts] of every token t, a GEMV over
    # the hidden dim in BLOCK_H chunks (float32 sum, rounded to the logits dtype as a
    # linear's output); then an arrival at the launch's counter (arrivals.py). The last
    # expert block to arrive routes every token from the full logits rows, token after
    # token (T is small: decode). One warp per program keeps the top-k's reductions
    # within a warp, as in _route_kernel.
    eb = tl.program_id(0)
    ex = eb * BLOCK_EP + tl.arange(0, BLOCK_EP)
    exm = ex < E
    h = tl.arange(0, BLOCK_H)
    g_rows = gate_ptr + ex[:, None].to(tl.int64) * sg_e
    for t in range(0, T):
        acc = tl.zeros([BLOCK_EP, BLOCK_H], tl.float32)
        for h0 in range(0, HID, BLOCK_H):
            hh = h0 + h
            hm = hh < HID
            g = tl.load(g_rows + hh[None, :], mask=exm[:, None] & hm[None, :], other=0.0)
            xr = tl.load(x_ptr + t * sx_t + hh, mask=hm, other=0.0)
            acc += g.to(tl.float32) * xr.to(tl.float32)[None, :]
        logit = tl.sum(acc, axis=1)
        tl.store(logits_ptr + t * E + ex, logit.to(logits_ptr.dtype.element_ty), mask=exm)
    tl.debug_barrier()
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(arrived_ptr, 0)
        for t in range(0, T):  # T <= ROUTER_FUSED_MAX_TOKENS: int32 offsets
            _topk_row(logits_ptr + t * E, w_ptr + t * K, ids_ptr + t * K, E,
                      K, BLOCK_E, BLOCK_K, RENORM)


def router_topk_triton(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(F.linear(x, gate), top_k, renormalize, x.dtype)`` in one launch:
    x [T, H], gate [E, H] -> (weights [T, k] x.dtype, ids [T, k] int64); T at most
    ``ROUTER_FUSED_MAX_TOKENS``."""
    T, hid = x.shape
    E = gate.shape[0]
    if T > ROUTER_FUSED_MAX_TOKENS:
        raise ValueError(f"router_topk_triton takes <= {ROUTER_FUSED_MAX_TOKENS} tokens, "
                         f"got {T}")
    weights = x.new_empty((T, top_k))
    ids = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    block_ep = 2
    logits = x.new_empty((T, E))
    _router_topk_kernel[(triton.cdiv(E, block_ep),)](
        x, gate, logits, weights, ids, arrival_counts("router_topk", 1, x.device),
        T, E, hid, x.stride(0), gate.stride(0),
        K=top_k, BLOCK_EP=block_ep, BLOCK_H=min(512, triton.next_power_of_2(hid)),
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
        RENORM=renormalize, num_warps=1,
    )
    return weights, ids
