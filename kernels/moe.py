"""MoE routing and expert computation (torch reference, HF Qwen3-MoE exact)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .activation import silu_and_mul
from .backend import use_triton
from .fp8 import dequantize
from .invariant_linear import row_invariant_linear

__all__ = [
    "route",
    "route_ref",
    "fused_experts",
    "fused_experts_ref",
    "fused_expert_pairs",
    "expert_pairs_ref",
    "sum_slots",
    "make_expert_map",
]


def route_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference softmax-then-top-k routing (HF ``Qwen3MoeTopKRouter``).

    Args:
        router_logits: [T, E_global], any float dtype.
        top_k: experts per token.
        renormalize: divide the top-k probabilities by their sum (``norm_topk_prob``).
        out_dtype: dtype of the returned weights (HF uses ``router_logits.dtype``).

    Returns:
        ``(topk_weights [T, top_k] out_dtype, topk_ids [T, top_k] int64)``; softmax
        and renormalization in float32, ids in ``torch.topk`` order (descending prob).
    """
    w = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(w, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(out_dtype), ids


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing. See :func:`route_ref` for the contract.

    Runs the one-launch Triton kernel when :func:`~phalanx.kernels.backend.use_triton`
    says so."""
    if use_triton(router_logits):
        from .gpu.route import route_triton

        return route_triton(router_logits, top_k, renormalize, out_dtype)
    return route_ref(router_logits, top_k, renormalize, out_dtype)


def make_expert_map(
    num_experts_global: int,
    local_expert_ids: Sequence[int] | torch.Tensor,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Build a global -> local expert index map.

    Returns int32 [num_experts_global] with ``map[local_expert_ids[i]] = i`` and
    ``-1`` for experts not held locally. ``local_expert_ids`` must be unique and
    in ``[0, num_experts_global)``; their order defines the local indices (i.e.
    the order of the local ``w13``/``w2`` stacks).
    """
    if isinstance(local_expert_ids, torch.Tensor):
        if device is None:
            device = local_expert_ids.device
        ids = local_expert_ids.tolist()
    else:
        ids = list(local_expert_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate local expert ids: {ids}")
    if any(not 0 <= e < num_experts_global for e in ids):
        raise ValueError(f"local expert ids out of range [0, {num_experts_global}): {ids}")
    expert_map = torch.full((num_experts_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor(ids, dtype=torch.int64)] = torch.arange(len(ids), dtype=torch.int32)
    return expert_map.to(device) if device is not None else expert_map


def fused_experts_ref(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference SwiGLU experts with weighted top-k combine (HF ``Qwen3MoeExperts``).

    Args:
        x: [T, H] (T may be 0).
        topk_weights: [T, k] routing weights (from :func:`route`).
        topk_ids: [T, k] int64 *global* expert ids.
        w13: [E_local, 2*I, H]; per expert ``cat(gate_proj.weight, up_proj.weight)``.
        w2: [E_local, H, I]; per expert ``down_proj.weight``.
        expert_map: optional int [E_global], global id -> local index or -1 (not
            held here: that (token, slot) pair contributes nothing). Without it,
            global ids are local indices.

    Returns:
        [T, H] in ``x.dtype``: ``out[t] = sum_slot w[t,slot] * w2[e] @ silu_and_mul(w13[e] @ x[t])``.
        Per local expert its (slot, token) pairs: two linears (rows padded:
        kernels/invariant_linear.py), the weight multiply in ``x.dtype``; then each
        token's slots summed in float32 in slot order (0 for a pair not held) and cast
        to ``x.dtype``: the EP combine's sum (comm/dispatch.py) and the Triton kernels',
        so a token's output has the same bits with its experts on one rank or spread
        over an EP group (HF sums in expert order in ``x.dtype``: equal within rounding).
    """
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    local_ids = topk_ids if expert_map is None else expert_map[topk_ids]
    num_local = w13.shape[0]
    held = local_ids[local_ids >= 0]
    if held.numel() > 0 and int(held.max()) >= num_local:
        raise ValueError(f"expert index {int(held.max())} out of range for {num_local} local experts")
    return sum_slots(expert_pairs_ref(x, topk_weights, local_ids, w13, w2), x.dtype)


def expert_pairs_ref(x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Each (token, slot) pair's weighted expert output, [T, k, H] in ``x.dtype``; 0 where
    ``local_ids`` [T, k] is -1 (not held)."""
    # [k, T] so torch.where yields (slot, token) pairs slot-major, like HF's expert_mask.
    ids_kt = local_ids.t()
    pairs = x.new_zeros((x.shape[0], local_ids.shape[1], x.shape[1]))
    for e in torch.unique(local_ids[local_ids >= 0]).tolist():
        slot_idx, token_idx = torch.where(ids_kt == e)
        h = row_invariant_linear(x[token_idx], w13[e])
        h = row_invariant_linear(silu_and_mul(h), w2[e])
        pairs[token_idx, slot_idx] = (h * topk_weights[token_idx, slot_idx, None]).to(x.dtype)
    return pairs


def sum_slots(pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pairs`` [T, k, H] summed over the slots in slot order in float32 (elementwise
    adds, no cross-row reduction: the EP combine's and the Triton combine's order), then
    cast to ``dtype``."""
    if pairs.shape[0] and use_triton(pairs):
        from .gpu.moe import sum_slots_triton

        return sum_slots_triton(pairs, dtype)
    acc = torch.zeros((pairs.shape[0], pairs.shape[2]), dtype=torch.float32, device=pairs.device)
    for j in range(pairs.shape[1]):
        acc += pairs[:, j].float()
    return acc.to(dtype)


def fused_expert_pairs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, expert_map: torch.Tensor | None = None,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`fused_experts` before its combine: each (token, slot) pair's weighted output
    [T, k, H] in ``x.dtype``, 0 for a pair whose expert is not held here;
    ``sum_slots(pairs, x.dtype)`` is :func:`fused_experts`'s result, bit for bit."""
    if use_triton(x):
        if scales is not None:
            raise ValueError("FP8 experts have no per-pair output on the GPU")
        from .gpu.moe import fused_experts_triton

        return fused_experts_triton(x, topk_weights, topk_ids, w13, w2, expert_map, pairs=True)
    if scales is not None:
        w13, w2 = dequantize(w13, scales[0], x.dtype), dequantize(w2, scales[1], x.dtype)
    local_ids = topk_ids if expert_map is None else expert_map[topk_ids]
    if x.shape[0] and int(local_ids.max()) >= w13.shape[0]:
        raise ValueError(f"expert index {int(local_ids.max())} out of range for {w13.shape[0]} local experts")
    return expert_pairs_ref(x, topk_weights, local_ids, w13, w2)


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """SwiGLU experts with weighted top-k combine. See :func:`fused_experts_ref`.

    ``scales``: (w13_scale, w2_scale) when the stacks are FP8 codes (`kernels/fp8.py`,
    per row and 128-column block); the reference dequantizes them to ``x.dtype``.
    Runs the Triton kernels when :func:`~phalanx.kernels.backend.use_triton` says so
    (sums each token's slots in float32; out-of-range local ids count as not held).
    """
    if scales is not None:
        if use_triton(x):
            from .gpu.moe_fp8 import fused_experts_fp8_triton

            return fused_experts_fp8_triton(x, topk_weights, topk_ids, w13, scales[0], w2, scales[1],
                                            expert_map)
        w13, w2 = dequantize(w13, scales[0], x.dtype), dequantize(w2, scales[1], x.dtype)
        return fused_experts_ref(x, topk_weights, topk_ids, w13, w2, expert_map)
    if use_triton(x):
        from .gpu.moe import fused_experts_triton

        return fused_experts_triton(x, topk_weights, topk_ids, w13, w2, expert_map)
    return fused_experts_ref(x, topk_weights, topk_ids, w13, w2, expert_map)
