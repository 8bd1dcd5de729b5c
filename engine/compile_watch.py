"""`CompileWatch`: Triton JIT compilations in this process, counted (issue 31: nothing
may compile once an engine is ready; operators and tests read the count).

One hook on Triton's JIT (`triton.knobs.runtime.jit_post_compile_hook`, chained to a
hook already there) counts every in-memory compilation: a kernel variant's first launch
in the process, whether its binary came from Triton's disk cache or was built. Without
Triton (or with a Triton that has no such hook) nothing is counted and `available` is
False.

`keep_compiled_kernels` points Triton's kernel cache at phalanx's
(`Envs.triton_cache_path`: PHALANX_CACHE_DIR/triton unless TRITON_CACHE_DIR is set), so a
restarted server loads its compiled kernels instead of building them again.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Optional

__all__ = ["CompileWatch", "compile_watch", "keep_compiled_kernels"]


class CompileWatch:
    """Compilations so far, in total and per kernel name."""

    def __init__(self) -> None:
        self.total = 0
        self.by_kernel: Counter[str] = Counter()
        self.available = False
        self._lock = threading.Lock()

    def _install(self) -> None:
        try:
            import triton
            runtime = triton.knobs.runtime
        except (ImportError, AttributeError):
            return
        before = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            with self._lock:
                self.total += 1
                self.by_kernel[getattr(fn, "name", None) or "?"] += 1
            return before(*args, **kwargs) if before is not None else None

        runtime.jit_post_compile_hook = hook
        self.available = True


_watch: Optional[CompileWatch] = None


def compile_watch() -> CompileWatch:
    """The process's watch, its hook installed on first use."""
    global _watch
    if _watch is None:
        _watch = CompileWatch()
        _watch._install()
    return _watch


def keep_compiled_kernels() -> None:
    """Triton's kernel cache under phalanx's cache folder (before anything compiles; a
    no-op without Triton)."""
    try:
        import triton
        cache = triton.knobs.cache
    except (ImportError, AttributeError):
        return
    from ..envs import envs
    cache.dir = str(envs().triton_cache_path)
