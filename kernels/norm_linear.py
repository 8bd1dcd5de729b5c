"""The residual add + RMSNorm in front of a projection, as one operation.

A decoder layer norms its residual stream twice, and each normed row goes straight into
a projection (qkv; the router's, whose normed rows the experts then read). At a few rows
the norm is a launch of its own that costs a few µs for a few KB (bench/NOTES.md, the
B=1 profile), so :func:`norm_linear` folds it into the projection's GEMV
(:mod:`phalanx.kernels.gpu.gemv`) when that kernel takes the call, and otherwise runs the
norm kernel and the projection one after the other. Both paths keep
:func:`norm_linear_ref`'s contract and roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import project, use_gemv
from .norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

__all__ = ["norm_linear", "norm_linear_ref", "norm_qkv_rope"]

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
    return F.linear(normed, weight, bias), normed, new_residual


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scales: torch.Tensor | None = None, want_normed: bool = False) -> Normed:
    """:func:`norm_linear_ref`'s ``(y, normed, new_residual)``; ``normed`` may be None
    unless ``want_normed``. ``scales``: the weight is FP8 codes (kernels/fp8.py)."""
    fused = (use_gemv(x, weight, bias, scales) and norm_weight.dtype == x.dtype
             and norm_weight.shape == (x.shape[1],)
             and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))
    if fused:
        from .gpu.gemv import gemv_triton

        return gemv_triton(x, weight, bias, norm=(residual, norm_weight, eps), want_normed=want_normed,
                           scales=scales)
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


def _folds(x, residual, norm_weight, weight, bias, scales, cache, head_dim, q_norm, k_norm) -> bool:
    """Whether :func:`norm_qkv_rope` takes the one-launch kernel."""
    if not (use_gemv(x, weight, bias, scales) and norm_weight.dtype == x.dtype
            and norm_weight.shape == (x.shape[1],) and cache[0].dtype == x.dtype
            and cache[1].dtype == x.dtype and (q_norm is None) == (k_norm is None)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))):
        return False
    from .gpu.qkv_rope import qkv_rope_fits

    return qkv_rope_fits(weight.shape[0], weight.shape[1], head_dim, weight.element_size())
