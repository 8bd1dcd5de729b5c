"""Arrival counters for kernels whose last program to finish a group merges the group.

A kernel that splits one output over several programs (the MoE down projection per
pair) can merge in the same launch: each program stores its part,
then bumps its group's counter (acq_rel, GPU scope, after a CTA barrier so every
thread's stores are released); the program that sees the count reach the group's size
reads the parts past L1 and writes the output, then stores 0 back. So the counters are
all zero between launches, and a CUDA graph replays against the same buffer without a
memset node.

One zeroed int32 buffer per (user, device), grown on demand; the users run on one
stream, one launch at a time. A buffer must not be created while a CUDA graph is being
captured: it would come from the graph's private memory pool, which the graphs captured
earlier reuse for their own activations, so their replays would overwrite the counters
(measured: garbage tokens at batch 1 after larger batches ran). The decode graphs run
every captured path once before capturing, which creates the buffers.
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counts(user: str, n: int, device: torch.device) -> torch.Tensor:
    """At least `n` zeroed int32 counters reserved for `user` on `device`."""
    key = (user, torch.device(device))
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"arrival counters for {user!r} ({n}) first requested inside a CUDA "
                               "graph capture: run the path once before capturing")
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _buffers[key] = buf
    return buf


def all_zero() -> bool:
    """Every counter is back at zero (tests: no merge left a count behind)."""
    return all(int(buf.abs().sum()) == 0 for buf in _buffers.values())
