"""The batch-invariant mode: every kernel's result for a row does not depend on the rows
that share its batch, nor on whether the row was prefilled or decoded (ARCHITECTURE §5:
a seeded request's tokens are then the same alone, in any batch, and after a recovery
that re-prefills its emitted tokens).

On CPU the kernels are so always (kernels/invariant_linear.py pads rows; prefill
attention is computed row by row as decode's). On GPU it is a mode, off by default
(`EngineConfig.batch_invariant`, ``phalanx serve --batch-invariant``), because its
kernels give up speed: with it on

* every linear is the Triton GEMM of kernels/gpu/invariant_gemm.py (no cuBLAS, no GEMV);
  it can take the residual add + RMSNorm in front of a projection at a few rows, each
  row's statistics computed as the norm kernel computes them (the same bits as the norm
  kernel and the GEMM one after the other; off until measured, ``FOLD_MAX_M``);
* decode attention splits a sequence's positions by its length alone (fixed tile and
  split size, the merge always taken), and prefill attention computes each query row as
  that kernel computes a decode query at the row's position (kernels/attention.py);
* the experts' kernels already give a token the same bits whatever its batch (the small
  path equals the tiled path; the slots are summed in slot order in float32).

The mode is process-wide, like :class:`~phalanx.kernels.backend.force_triton`: an engine
sets it from its config when it is built, before its CUDA graphs are captured.
"""

from __future__ import annotations

__all__ = ["batch_invariant", "batch_invariant_on"]

_on = False


def batch_invariant_on() -> bool:
    """Whether the batch-invariant kernels are chosen (GPU; the CPU path always is)."""
    return _on


class batch_invariant:
    """Turn the mode on or off: a plain setter (``batch_invariant(True)``) or a context
    manager that restores the previous state on exit."""

    def __init__(self, enabled: bool = True) -> None:
        global _on
        self._prev = _on
        _on = bool(enabled)

    def __enter__(self) -> "batch_invariant":
        return self

    def __exit__(self, *exc: object) -> None:
        global _on
        _on = self._prev
