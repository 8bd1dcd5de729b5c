"""`time_experts`: one decode step's expert compute measured with the kernel the ranks
run (`fused_experts`: Triton on GPU, the torch reference on CPU), by how many distinct
experts a rank holds active and how many routed rows it computes. The EP-width cost
model's expert table (`policies/ep_cost.py`) is this grid; a rank measures it at start
(`Rank.expert_costs`) and `bench/ep_width.py` in its own process.

Layout of the result: `(actives, rows, values)` with `values[i][j]` the µs of all MoE
layers of one step at `actives[i]` experts and `rows[j]` rows (plain floats, so the
caller builds the policy's `Grid` without this module importing the policies).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..config import ModelConfig
from ..kernels.moe import fused_experts

__all__ = ["ACTIVE", "ROWS", "time_experts"]

ACTIVE = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROWS = (8, 32, 128, 512)


def time_experts(model: ModelConfig, device: torch.device, dtype: torch.dtype, reps: int,
                 actives: Sequence[int] = ACTIVE, rows: Sequence[int] = ROWS
                 ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[tuple[float, ...], ...]]:
    """The expert grid of `model`'s expert shapes on `device` (random weights, seed 0;
    actives above the model's expert count are left out); `reps` timed calls a point."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    h, inter, k = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    kept = [a for a in actives if a <= model.num_experts]
    values = []
    for active in kept:
        w13 = torch.randn(active, 2 * inter, h, generator=gen, device=device).to(dtype)
        w2 = torch.randn(active, h, inter, generator=gen, device=device).to(dtype)
        row = []
        for n in rows:
            tokens = max(1, n // k)
            x = torch.randn(tokens, h, generator=gen, device=device).to(dtype)
            ids = torch.randint(0, active, (tokens, k), generator=gen, device=device)
            weights = torch.full((tokens, k), 1.0 / k, device=device)
            fused_experts(x, weights, ids, w13, w2)  # warm (and compile)
            sync()
            start = time.perf_counter()
            for _ in range(reps):
                fused_experts(x, weights, ids, w13, w2)
            sync()
            row.append((time.perf_counter() - start) / reps * 1e6 * model.num_moe_layers)
        values.append(tuple(row))
    return tuple(float(a) for a in kept), tuple(float(r) for r in rows), tuple(values)
