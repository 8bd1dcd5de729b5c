"""The router's projection of a few decode rows with the routing folded in: one launch for
what was the post-attention norm + router GEMV and the route kernel.

Contract: :func:`phalanx.kernels.norm_linear.norm_route` (its unfolded path, the norm
folded into the GEMV and then :func:`phalanx.kernels.moe.route`, is the reference). The
GEMV is :func:`phalanx.kernels.gpu.gemv.gemv_rows` with the norm folded in (program 0
also stores the normed rows the experts read and the new residual); then each program
arrives at its row's counter (`arrivals.py`: acq_rel at GPU scope after a CTA barrier,
so its logits are released), and the program that completes a row routes it, reading
the row's logits past L1 (`topk_by_rank`).

Routing by rank (the route kernel picks by repeated arg-max, one reduction pair per
slot): an expert's rank is the number of experts before it, a higher probability or an
equal one with a lower id, which is the order of ``torch.topk`` with ties to the lower
id; the experts of rank < k store their weight and id at index rank. One [E, E]
comparison and four reductions, whatever k is. The weights are the route kernel's
(float32 softmax, renormalized over the top k); the renormalizing sum runs in another
order, so a weight may differ from the route kernel's in the last float32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counts
from .gemv import gemv_block_n, gemv_rows
from .pdl import pdl_launch

__all__ = ["norm_route_triton", "norm_route_fits", "ROUTE_FOLD_MAX_EXPERTS"]

ROUTE_FOLD_MAX_EXPERTS = 128  # the [E, E] comparison stays in one program's registers


@triton.jit
def topk_by_rank(row_ptr, w_ptr, ids_ptr, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORM: tl.constexpr):
    """Softmax top-k of the logits at `row_ptr` (E of them, read past L1) into
    ``w_ptr[0:TOPK]`` (descending) and ``ids_ptr[0:TOPK]`` (int64)."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(row_ptr + e, mask=em, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(em, p, 0.0)
    p = p / tl.sum(p, axis=0)
    pi = p[:, None]
    pj = p[None, :]
    before = (pj > pi) | ((pj == pi) & (e[None, :] < e[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    top = em & (rank < TOPK)
    if RENORM:
        p = p / tl.sum(tl.where(top, p, 0.0), axis=0)
    tl.store(w_ptr + rank, p.to(w_ptr.dtype.element_ty), mask=top)
    tl.store(ids_ptr + rank, e.to(tl.int64), mask=top)


@triton.jit
def _norm_route_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, xn_ptr, tw_ptr, ti_ptr, arrived_ptr,
    N, K, sx, sr, sw, sy, eps,
    M: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, HAS_RES: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    gemv_rows(pid, x_ptr, r_ptr, nw_ptr, w_ptr, w_ptr, w_ptr, y_ptr, res_ptr, xn_ptr, N, K, sx, sr,
              sw, 0, sy, eps, M, BLOCK_N, BLOCK_K, False, 1, True, HAS_RES, True, False, PDL)
    tl.debug_barrier()
    last = tl.num_programs(0) - 1
    for m in tl.static_range(M):
        ctr = arrived_ptr + m
        if tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu") == last:
            tl.store(ctr, 0)
            topk_by_rank(y_ptr + m * sy, tw_ptr + m * TOPK, ti_ptr + m * TOPK, N, TOPK, BLOCK_E,
                         RENORM)


def norm_route_fits(num_experts: int, hidden: int, elem_bytes: int) -> bool:
    """Whether the folded kernel takes a router weight [num_experts, hidden]."""
    return (1 <= num_experts <= ROUTE_FOLD_MAX_EXPERTS
            and gemv_block_n(num_experts, hidden, elem_bytes) > 0)


def norm_route_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, gate: torch.Tensor, top_k: int, renormalize: bool
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """``((weights [M, k] x.dtype, ids [M, k] int64), normed, new_residual)``: see the
    module docstring. The caller checks `norm_route_fits`, shapes and dtypes."""
    M, K = x.shape
    E = gate.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    logits = x.new_empty((M, E))
    normed = x.new_empty((M, K))
    res_out = x.new_empty((M, K)) if residual is not None else None
    weights = x.new_empty((M, top_k))
    ids = torch.empty((M, top_k), dtype=torch.int64, device=x.device)
    r = residual if residual is not None else x
    block_n = gemv_block_n(E, K, x.element_size())
    arrived = arrival_counts("norm_route", M, x.device)
    _norm_route_kernel[(triton.cdiv(E, block_n),)](
        x, r, norm_weight, gate, logits, res_out if res_out is not None else logits, normed,
        weights, ids, arrived, E, K, x.stride(0), r.stride(0), gate.stride(0), logits.stride(0),
        float(eps), M=M, TOPK=top_k, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(K),
        BLOCK_E=triton.next_power_of_2(E), HAS_RES=residual is not None, RENORM=renormalize,
        num_warps=4, **pdl_launch(x.device, "gemv"),
    )
    return (weights, ids), normed, res_out if residual is not None else x
