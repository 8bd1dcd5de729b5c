"""Rotary position embedding (neox / "rotate_half" style), HF Qwen3 default rope."""

from __future__ import annotations

import torch

from .backend import use_triton
from .norm import rms_norm

__all__ = ["RotaryEmbedding", "apply_rope_ref", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` where ``x1, x2`` are the two halves of the last dim."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference rope application, bit-exact with HF ``apply_rotary_pos_emb``.

    Args:
        q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]; same dtype.
        positions: int64 [T], each in ``[0, cos_cache.shape[0])`` (not checked here).
        cos_cache, sin_cache: float32 [max_position, head_dim // 2].

    Returns:
        ``(q_rot, k_rot)`` with the input shapes and dtypes, computed as
        ``x * cos + rotate_half(x) * sin`` with ``cos = cat(c, c).to(x.dtype)``.
    """
    cos_half = cos_cache[positions]
    sin_half = sin_cache[positions]
    # [T, head_dim] -> [T, 1, head_dim]: broadcast over heads.
    cos = torch.cat((cos_half, cos_half), dim=-1)[:, None, :]
    sin = torch.cat((sin_half, sin_half), dim=-1)[:, None, :]
    q_rot = (q * cos.to(q.dtype)) + (rotate_half(q) * sin.to(q.dtype))
    k_rot = (k * cos.to(k.dtype)) + (rotate_half(k) * sin.to(k.dtype))
    return q_rot, k_rot


class RotaryEmbedding:
    """Precomputed cos/sin caches for default (unscaled) neox-style rope.

    ``inv_freq[i] = 1 / base**(2i / head_dim)`` and ``freqs[p, i] = p * inv_freq[i]``
    are computed in float32 exactly as HF does; ``cos_cache``/``sin_cache`` are
    float32 [max_position, head_dim // 2] (the second half of HF's ``emb`` is a
    copy of the first, so only one half is stored).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        # ``dtype`` is accepted for API symmetry; caches stay float32 and are
        # rounded to the activation dtype at apply time (HF order).
        self.dtype = dtype
        self.inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        pos = torch.arange(max_position, dtype=torch.int64, device=device)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
        q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, num_heads, head_dim] and ``k`` [T, num_kv_heads, head_dim].

        With ``q_norm`` / ``k_norm`` (both [head_dim]) each head is first RMS-normed
        (Qwen3's q/k norm, :func:`~phalanx.kernels.norm.rms_norm` semantics), fused into
        the same kernel on GPU. ``positions`` is int64 [T] (absolute token positions).
        Returns new tensors ``(q_rot, k_rot)`` of the input shapes/dtypes. On the
        reference path a position ``>= max_position`` or negative raises ``ValueError``;
        the GPU path does not check (that needs a host sync; the engine bounds positions
        by the context length on admission). Runs the Triton kernel when
        :func:`~phalanx.kernels.backend.use_triton` says so.
        """
        return self.apply_and_cache(q, k, positions, q_norm, k_norm, eps)

    def apply_and_cache(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
        q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
        eps: float = 1e-6, kv_write: tuple | None = None, keep_k: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`apply`, then with ``kv_write = (v, k_cache, v_cache, slot_mapping)``
        the rotated k and ``v`` stored at their KV slots as
        :func:`~phalanx.kernels.attention.write_kv` does (one launch on GPU). Without
        ``keep_k`` the rotated k is not returned (None; on GPU not stored either)."""
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(f"head_dim mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, expected {self.head_dim}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm go together")
        if use_triton(q):
            from .gpu.rope import caches_on, rope_triton

            cos, sin = caches_on(self, q.device)
            return rope_triton(q, k, positions, cos, sin, q_norm, k_norm, eps, kv_write, keep_k)
        if positions.numel() > 0:
            lo, hi = int(positions.min()), int(positions.max())
            if hi >= self.max_position or lo < 0:
                raise ValueError(f"positions must be in [0, {self.max_position}), got range [{lo}, {hi}]")
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = apply_rope_ref(q, k, positions, self.cos_cache, self.sin_cache)
        if kv_write is not None:
            from .attention import write_kv

            v, k_cache, v_cache, slots = kv_write
            write_kv(k, v, k_cache, v_cache, slots)
        return q, (k if keep_k else None)
