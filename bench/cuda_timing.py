"""Median time of a GPU call by CUDA events (the benches' and probes' one timer)."""

from __future__ import annotations

from typing import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int = 30, warm: int = 5) -> float:
    """Median over ``reps`` calls of ``fn`` after ``warm`` untimed ones, in ms: events
    recorded around each call on the current stream, synchronized one call at a time."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
