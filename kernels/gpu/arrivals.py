"""Arrival counters for kernels whose last program to finish a group merges the group.

A kernel that splits one output over several programs (the MoE down projection per
pair) can merge in the same launch: each program stores its part,
then bumps its group's counter (acq_rel, GPU scope, after a CTA barrier so every
thread's stores are released); the program that sees the count reach the group's size
reads the parts past L1 and writes the output, then stores 0 back. So the counters are
all zero between launches, and a CUDA graph replays against the same buffer without a
memset node.

One zeroed int32 buffer per (user, device, lane), grown on demand (a grown-out buffer is
kept, never freed: a graph captured earlier still counts in it); the users of one lane
run on one stream, one launch at a time. Lanes (`lane_scope`) are a step's micro-batches
on streams of their own (engine/lanes.py): their launches may run at once, so each lane
counts in its own buffer. A buffer must not be created while a CUDA graph is being
captured: it would come from the graph's private memory pool, which the graphs captured
earlier reuse for their own activations, so their replays would overwrite the counters
(measured: garbage tokens at batch 1 after larger batches ran). The decode graphs run
every captured path once before capturing, which creates the buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_buffers: dict[tuple[str, torch.device, int], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # replaced buffers: captured graphs may still use them
_lane: contextvars.ContextVar[int] = contextvars.ContextVar("arrival_lane", default=0)


@contextlib.contextmanager
def lane_scope(lane: int) -> Iterator[None]:
    """Within: launches take the counters of `lane` (the host launches one lane at a time)."""
    token = _lane.set(lane)
    try:
        yield
    finally:
        _lane.reset(token)


def arrival_counts(user: str, n: int, device: torch.device,
                   required: bool = True) -> torch.Tensor | None:
    """At least `n` zeroed int32 counters reserved for `user` on `device` in the current
    lane. Inside a graph capture they must exist already: else RuntimeError, or None
    when not `required` (the caller then merges without counters)."""
    key = (user, torch.device(device), _lane.get())
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if not required:
                return None
            raise RuntimeError(f"arrival counters for {user!r} ({n}) first requested inside a CUDA "
                               "graph capture: run the path once before capturing")
        if buf is not None:
            _outgrown.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf


def all_zero() -> bool:
    """Every counter is back at zero (tests: no merge left a count behind)."""
    return all(int(buf.abs().sum()) == 0 for buf in [*_buffers.values(), *_outgrown])
