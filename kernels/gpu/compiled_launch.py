"""Launches of a Triton kernel that skip the JIT's per-call argument binding.

Triton's ``kernel[grid](...)`` binds and specialises every argument in Python on every
call (tens of µs); the compiled kernel it returns can be called straight, with pointers
as integers (the slab kernel: 113 → 60 µs per launch, bench/NOTES.md v13). That is only
right for calls the compiled kernel was specialised for, so:

- a launch shape's key is its constexprs, warps, the tensors' dtypes and device; the
  kernel's integer arguments must be ``do_not_specialize`` (else their values would
  belong in the key) and every tensor 16-byte aligned (what the JIT specialises
  pointers on), else the call goes through the JIT;
- the first call of a shape goes through the JIT and keeps its compiled kernel;
- a compiled kernel that refuses its arguments (another Triton's launcher) turns
  compiled launches off for good, and the call goes through the JIT.

Arguments: the runtime ones in signature order, then the constexpr values in signature
order (the kernels that use this put their constexprs last). Under Triton's interpreter
the JIT returns nothing to keep, so every call goes through it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CompiledLaunches"]


class CompiledLaunches:
    """Launches of `kernel` (a ``@triton.jit`` function), compiled kernels kept per shape."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.enabled = True
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], args: tuple, consts: tuple,
                 num_warps: int = 4) -> None:
        """Queue one launch on the current stream. Raises what the JIT raises (e.g.
        ValueError for a pointer it cannot address)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        aligned = all(t.data_ptr() % 16 == 0 for t in tensors)
        key = (consts, num_warps, tuple(t.dtype for t in tensors),
               tensors[0].device if tensors else None)
        compiled = self._compiled.get(key) if aligned and self.enabled else None
        if compiled is not None:
            raw = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
            try:
                compiled[tuple(grid) + (1,) * (3 - len(grid))](*raw, *consts)
                return
            except (TypeError, IndexError, AttributeError):  # refused before launching
                self.disable()
        compiled = self.kernel[grid](*args, *consts, num_warps=num_warps)
        if aligned and self.enabled and hasattr(compiled, "__getitem__"):
            self._compiled[key] = compiled

    def disable(self) -> None:
        """Every later launch goes through the JIT."""
        self.enabled = False
        self._compiled.clear()
