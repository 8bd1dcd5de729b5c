"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

A batch-1 decode step is ~11 small launches a layer, each a few µs above its bytes
(bench/NOTES.md). With PDL (sm90+, CUDA 12.3+; Triton's ``launch_pdl=True`` and
``triton.language.extra.cuda.gdc_*``) a kernel launched *dependent* may begin as soon as
every program of the kernel before it has called ``gdc_launch_dependents``; it must call
``gdc_wait`` before it reads anything an earlier kernel wrote, and may read what no
kernel writes (weights) before that. ``bench/probes/pdl_gpu.py``: a chain of 2048x2048
GEMVs in one CUDA graph, 3.85 µs a kernel plain, 2.84 with the weight tile loaded
before the wait.

The protocol every PDL-launched kernel here keeps:

* every program calls ``gdc_wait`` (none returns early before it), and stores nothing
  before it: so a dependent grid completes only after its predecessor has, and
  completion stays transitive along a chain (a kernel waiting on its predecessor has
  waited on all earlier ones);
* before the wait it reads only tensors no kernel of the step writes: weights, and the
  step's inputs the host copies in before its first kernel (sequence lengths, block
  tables; decode attention with its page ids ahead reads them there).

A kernel that only *triggers* (``gdc_launch_dependents`` at its start) needs no launch
attribute; the trigger is a no-op when the next launch is not dependent.

``pdl_enabled(device, kernel)`` says whether a kernel's launches on ``device`` use it:
CUDA, compute capability 9.0 or newer, the ``gdc`` intrinsics importable, and the kernel
not turned off with ``set_pdl`` (benchmarks measure with and without).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PDL_KERNELS", "PDL_DEFAULT", "pdl_enabled", "pdl_launch", "set_pdl", "gdc_wait", "gdc_launch_dependents"]

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older triton: no PDL, kernels never reach these names
    gdc_launch_dependents = gdc_wait = None

# The kernels of a decode layer that take part, by name. "gemv": the projections (weights
# read before the wait); the others wait at their start, then let the next launch begin
# ("gemm": the batch-invariant mode's linears, kernels/gpu/invariant_gemm.py).
PDL_KERNELS = frozenset({"gemv", "gemm", "rope", "attention", "route", "moe"})
# The kernels on at start: all but "gemm", off until measured on its own (one H100,
# batch-1 decode in the batch-invariant mode with it and the GEMM's folded norm together:
# 238 tok/s against 430 with neither; bench/decode_gpu.py --baselines invpdl,invfold).
PDL_DEFAULT = PDL_KERNELS - {"gemm"}
_enabled: frozenset[str] = PDL_DEFAULT


def set_pdl(kernels: bool | frozenset[str] | set[str]) -> frozenset[str]:
    """Which kernels use PDL: True (all of ``PDL_KERNELS``), False (none) or a set of
    names (A/B runs; set before capturing graphs; ``PDL_DEFAULT`` at start). Returns the
    previous set."""
    global _enabled
    old = _enabled
    chosen = PDL_KERNELS if kernels is True else frozenset() if kernels is False else frozenset(kernels)
    if not chosen <= PDL_KERNELS:
        raise ValueError(f"unknown PDL kernels {sorted(chosen - PDL_KERNELS)}; known: {sorted(PDL_KERNELS)}")
    _enabled = chosen
    return old


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device, kernel: str = "gemv") -> bool:
    """Whether ``kernel`` on ``device`` is launched (and compiled) with PDL."""
    if kernel not in _enabled or device.type != "cuda" or gdc_wait is None:
        return False  # CPU tensors (Triton's interpreter included) never use it
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device, kernel: str) -> dict:
    """Launch keywords of a kernel with a ``PDL`` constexpr: ``PDL`` and, when on,
    Triton's ``launch_pdl``."""
    on = pdl_enabled(device, kernel)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
