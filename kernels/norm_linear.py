"""The residual add + RMSNorm in front of a projection, as one operation.

A decoder layer norms its residual stream twice, and each normed row goes straight into
a projection (qkv; the router's, whose normed rows the experts then read). At a few rows
the norm is a launch of its own that costs a few µs for a few KB (bench/NOTES.md, the
B=1 profile), so :func:`norm_linear` folds it into the projection's GEMV
(:mod:`phalanx.kernels.gpu.gemv`) when that kernel takes the call, and otherwise runs the
norm kernel and the projection one after the other. Both paths keep
:func:`norm_linear_ref`'s contract and roundings. The qkv projection can also take the
head work (:func:`norm_qkv_rope`), the router's the routing (:func:`norm_route`).
"""

from __future__ import annotations

import torch

from .backend import use_triton
from .batch_invariant import batch_invariant_on
from .invariant_linear import row_invariant_linear
from .linear import project, use_gemv
from .moe import route
from .norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

__all__ = ["norm_linear", "norm_linear_ref", "norm_qkv_rope", "norm_route", "ROUTE_FOLD"]

# Whether `norm_route` folds the routing into the router's GEMV (kernels/gpu/norm_route.py).
# Off until a GPU measures it against the route kernel under PDL (bench/decode_gpu.py
# --baselines routefold); the interpreter tests run it either way.
ROUTE_FOLD = False

Normed = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, normed, new_residual)``: ``new_residual = x + residual`` rounded to x's dtype
    (``x`` itself when ``residual`` is None), ``normed = rms_norm_ref(new_residual)`` and
    ``y = F.linear(normed, weight, bias)``."""
    if residual is None:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    return row_invariant_linear(normed, weight, bias), normed, new_residual


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scales: torch.Tensor | None = None, want_normed: bool = False) -> Normed:
    """:func:`norm_linear_ref`'s ``(y, normed, new_residual)``; ``normed`` may be None
    unless ``want_normed``. ``scales``: the weight is FP8 codes (kernels/fp8.py)."""
    if _gemv_takes(x, residual, norm_weight, weight, bias, scales):
        from .gpu.gemv import gemv_triton

        return gemv_triton(x, weight, bias, norm=(residual, norm_weight, eps), want_normed=want_normed,
                           scales=scales)
    if _invariant_folds(x, residual, norm_weight, weight, bias, scales):
        from .gpu.invariant_gemm import invariant_norm_linear_triton

        return invariant_norm_linear_triton(x, residual, norm_weight, eps, weight, bias, want_normed)
    if residual is None:
        normed, new_residual = rms_norm(x, norm_weight, eps), x
    else:
        normed, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return project(normed, weight, bias, scales), normed, new_residual


def norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor | None, rope,
                  positions: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                  heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's attention input: ``(q [T, heads[0], D], new_residual)``, with the
    rotated k and v of every row stored at its KV slot (``slots``, -1 = none) of
    ``cache = (k_cache, v_cache)``. Unfolded (the reference): :func:`norm_linear`, the
    split into q/k/v heads, ``rope.apply_and_cache`` with the q/k norms (``eps``) and the
    KV write. Folded into one launch at one row (kernels/gpu/qkv_rope.py) when the GEMV
    takes the projection and the head dim suits it."""
    num_heads, num_kv_heads = heads
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    if _folds(x, residual, norm_weight, weight, bias, scales, cache, head_dim, q_norm, k_norm):
        from .gpu.qkv_rope import qkv_rope_triton
        from .gpu.rope import caches_on

        cos, sin = caches_on(rope, x.device)
        return qkv_rope_triton(x, residual, norm_weight, eps, weight, bias, positions, cos, sin,
                               q_norm, k_norm, cache[0], cache[1], slots, num_heads, num_kv_heads,
                               scales=scales)
    qkv, _, residual = norm_linear(x, residual, norm_weight, eps, weight, bias, scales)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    t = x.shape[0]
    q, _ = rope.apply_and_cache(q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim),
                                positions, q_norm, k_norm, eps,
                                kv_write=(v.reshape(t, num_kv_heads, head_dim), cache[0], cache[1], slots),
                                keep_k=False)
    return q, residual


def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
               eps: float, gate: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A MoE layer's routing of its post-attention rows: ``((weights [T, k] x.dtype, ids
    [T, k] int64), normed, new_residual)``, where ``normed`` are the rows the experts
    read. Unfolded (the reference): :func:`norm_linear` with the router's weight, then
    :func:`~phalanx.kernels.moe.route`. Folded into one launch (kernels/gpu/norm_route.py)
    when `ROUTE_FOLD` is on, the GEMV takes the projection and the experts are few."""
    if ROUTE_FOLD and _gemv_takes(x, residual, norm_weight, gate, None, None):
        from .gpu.norm_route import norm_route_fits, norm_route_triton

        if top_k <= gate.shape[0] and norm_route_fits(gate.shape[0], gate.shape[1], x.element_size()):
            return norm_route_triton(x, residual, norm_weight, eps, gate, top_k, renormalize)
    logits, normed, residual = norm_linear(x, residual, norm_weight, eps, gate, want_normed=True)
    return route(logits, top_k, renormalize, x.dtype), normed, residual


def _folds(x, residual, norm_weight, weight, bias, scales, cache, head_dim, q_norm, k_norm) -> bool:
    """Whether :func:`norm_qkv_rope` takes the one-launch kernel."""
    if not (_gemv_takes(x, residual, norm_weight, weight, bias, scales) and cache[0].dtype == x.dtype
            and cache[1].dtype == x.dtype and (q_norm is None) == (k_norm is None)):
        return False
    from .gpu.qkv_rope import qkv_rope_fits

    return qkv_rope_fits(weight.shape[0], weight.shape[1], head_dim, weight.element_size())


def _invariant_folds(x, residual, norm_weight, weight, bias, scales) -> bool:
    """Whether the batch-invariant mode's GEMM takes the norm (a few rows, one dtype, no
    FP8 codes): its norm has the bits of the mode's norm kernel at any row count."""
    if not (batch_invariant_on() and scales is None and x.dim() == 2 and use_triton(x)):
        return False
    from .gpu.invariant_gemm import FOLD_MAX_M

    return (1 <= x.shape[0] <= FOLD_MAX_M and weight.dim() == 2 and weight.dtype == x.dtype
            and weight.shape[1] == x.shape[1] and norm_weight.dtype == x.dtype
            and norm_weight.shape == (x.shape[1],)
            and (bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],)))
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def _gemv_takes(x, residual, norm_weight, weight, bias, scales) -> bool:
    """Whether the GEMV can fold this norm: it takes the projection (FP8 codes with
    ``scales`` included, when `linear.GEMV_FP8` is on) and the norm weight and residual
    match x."""
    return (use_gemv(x, weight, bias, scales) and norm_weight.dtype == x.dtype
            and norm_weight.shape == (x.shape[1],)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))
