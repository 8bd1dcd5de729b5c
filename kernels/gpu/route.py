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

from .arrivals import arrival_counts
from .attention import dot_precision

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
                        K: tl.constexpr, ROWS: tl.constexpr, BLOCK_EP: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        RENORM: tl.constexpr, PREC: tl.constexpr):
    # Program (token block, expert block): logits[ROWS tokens, BLOCK_EP experts] =
    # x @ gate^T (float32 sum, rounded to the logits dtype as a linear's output), then
    # an arrival at the token block's counter (arrivals.py); the last expert block to
    # arrive routes the block's tokens from the full logits rows.
    tb = tl.program_id(0)
    eb = tl.program_id(1)
    rows = tb * ROWS + tl.arange(0, ROWS)
    rm = rows < T
    ex = eb * BLOCK_EP + tl.arange(0, BLOCK_EP)
    exm = ex < E
    h = tl.arange(0, BLOCK_H)
    acc = tl.zeros([ROWS, BLOCK_EP], tl.float32)
    for h0 in range(0, HID, BLOCK_H):
        hh = h0 + h
        hm = hh < HID
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_t + hh[None, :],
                    mask=rm[:, None] & hm[None, :], other=0.0)
        g = tl.load(gate_ptr + ex[None, :].to(tl.int64) * sg_e + hh[:, None],
                    mask=hm[:, None] & exm[None, :], other=0.0)  # [BLOCK_H, BLOCK_EP]
        acc = tl.dot(a, g, acc=acc, input_precision=PREC)
    tl.store(logits_ptr + rows[:, None] * E + ex[None, :], acc.to(logits_ptr.dtype.element_ty),
             mask=rm[:, None] & exm[None, :])
    tl.debug_barrier()
    slot = arrived_ptr + tb
    if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        tl.store(slot, 0)
        for r in range(0, ROWS):
            t = (tb * ROWS + r).to(tl.int64)
            if t < T:
                _topk_row(logits_ptr + t * E, w_ptr + t * K, ids_ptr + t * K, E,
                          K, BLOCK_E, BLOCK_K, RENORM)


def router_topk_triton(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(F.linear(x, gate), top_k, renormalize, x.dtype)`` in one launch:
    x [T, H], gate [E, H] -> (weights [T, k] x.dtype, ids [T, k] int64)."""
    T, hid = x.shape
    E = gate.shape[0]
    weights = x.new_empty((T, top_k))
    ids = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    rows, block_ep = 16, 16
    logits = x.new_empty((T, E))
    grid = (triton.cdiv(T, rows), triton.cdiv(E, block_ep))
    arrived = arrival_counts("router_topk", grid[0], x.device)
    _router_topk_kernel[grid](
        x, gate, logits, weights, ids, arrived, T, E, hid, x.stride(0), gate.stride(0),
        K=top_k, ROWS=rows, BLOCK_EP=block_ep, BLOCK_H=256, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize, PREC=dot_precision(x.dtype),
        num_warps=4,
    )
    return weights, ids
