"""Kernel backend selection: Triton on CUDA tensors, torch reference elsewhere.

Every public kernel in ``phalanx.kernels`` asks :func:`use_triton` whether to run its
Triton version (``phalanx.kernels.gpu``) or its torch ``_ref``:

* default (auto): Triton iff the tensor is on a CUDA device and ``triton`` imports;
* :func:`force_triton` ``(True)``: Triton for every tensor, CPU ones included. On CPU
  this only works under Triton's interpreter, i.e. with ``TRITON_INTERPRET=1`` in the
  environment *before* ``triton`` is first imported (tests set it themselves);
* :func:`force_triton` ``(False)``: always the torch reference (e.g. to benchmark it
  on the GPU).

``triton`` is imported lazily, only when a Triton path is actually taken, so that
``import phalanx.kernels`` stays free of it on CPU machines.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["force_triton", "forced", "triton_available", "use_triton"]

# None = auto (CUDA tensors only); True / False = forced on / off.
_forced: bool | None = None


@functools.cache
def triton_available() -> bool:
    """True iff ``import triton`` works (cached after the first call)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install without a driver
        return False
    return True


def forced() -> bool | None:
    """The current forcing state: None (auto), True or False."""
    return _forced


class force_triton:
    """Force the Triton path on (True), off (False) or back to auto (None).

    Usable as a plain setter (``force_triton(True)``) or as a context manager that
    restores the previous state on exit (``with force_triton(True): ...``).
    """

    def __init__(self, enabled: bool | None = True) -> None:
        global _forced
        self._prev = _forced
        _forced = enabled

    def __enter__(self) -> "force_triton":
        return self

    def __exit__(self, *exc: object) -> None:
        global _forced
        _forced = self._prev


def use_triton(x: torch.Tensor) -> bool:
    """Whether kernels operating on ``x`` should take the Triton path."""
    if _forced is not None:
        if _forced and not triton_available():
            raise RuntimeError("force_triton(True) but triton cannot be imported")
        return _forced
    return x.is_cuda and triton_available()
