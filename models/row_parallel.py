"""Sums over the TP group whose bits do not depend on the TP width.

A row-parallel projection (attention's o, a dense MLP's down) cuts its K over the TP
ranks and an all-reduce adds the ranks' partial products, so its bits follow the width:
TP1 sums K in one chain, TP2 in two half chains and then their sum. A request prefilled
by a TP2 group and decoded (or re-prefilled after a recovery) on a TP1 rank then meets
other numbers on each side, and its tokens can differ from a fault-free run's
(ARCHITECTURE §5).

With ``leaves`` L > 1 (a power of two that every TP width of the deployment divides:
``EngineConfig.tp_invariant_width``) the whole K is cut in L equal chunks at every
width. Chunk i's product is computed in float32 by the rank that holds it; the chunks
are summed pairwise as a balanced binary tree in chunk order,
``((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))``. A rank of a width-t group holds
L / t consecutive chunks, one subtree, and sums it; the group gathers its t subtree sums
(float32, rank order) and sums the tree's top; the result is rounded once to x's dtype.
Every width dividing L gives a row the same bits.

The MoE layer's experts are whole on one rank, but a TP group's all-reduce of each
rank's summed experts adds a token's slots in another order than one rank's combine
(slot order, float32). With L > 1 a TP group exchanges the (token, slot) outputs
instead (each is nonzero on exactly one rank, so the all-reduce adds zeros: exact) and
sums the slots as one rank does (:meth:`RowParallel.experts`).

The invariant forms run where the kernels are batch-invariant (CPU always, a GPU in
the mode, kernels/batch_invariant.py); elsewhere every call is the plain all-reduce.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..config import ModelConfig
from ..kernels.batch_invariant import batch_invariant_on
from ..kernels.backend import use_triton
from ..kernels.invariant_linear import row_invariant_linear
from ..kernels.linear import project
from ..kernels.moe import fused_expert_pairs, fused_experts, sum_slots
from .parallel import ModelComm

__all__ = ["RowParallel", "pairwise_sum", "check_leaves", "row_parallel_dims", "layout_width"]


def pairwise_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The balanced binary tree sum of ``parts`` (a power of two of them) in list order:
    neighbours first, then neighbouring pairs, ..."""
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"pairwise_sum takes a power of two of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def check_leaves(leaves: int, tp_size: int, dims: dict[str, int]) -> None:
    """ValueError unless ``leaves`` is a power of two that ``tp_size`` divides and that
    divides every row-parallel K in ``dims`` (name -> size over the whole group)."""
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"tp_invariant_width must be a power of two, got {leaves}")
    if leaves > 1 and leaves % tp_size:
        raise ValueError(f"tp_invariant_width={leaves} is not a multiple of tp={tp_size}")
    for name, size in dims.items():
        if size and size % leaves:
            raise ValueError(f"tp_invariant_width={leaves} does not divide {name}={size}")


def row_parallel_dims(cfg: ModelConfig) -> dict[str, int]:
    """The row-parallel K sizes of a model (0: no such projection) for :func:`check_leaves`."""
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return {"num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim,
            "intermediate_size": cfg.intermediate_size if dense else 0,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size or 0}


def layout_width(cfg: ModelConfig, tp_widths: Iterable[int]) -> int:
    """The automatic ``tp_invariant_width`` of a layout whose groups are ``tp_widths``
    wide: the widest, when it is a power of two that divides the model's row-parallel
    sizes; else 1 (no width invariance)."""
    widest = max(tp_widths, default=1)
    try:
        check_leaves(widest, widest, row_parallel_dims(cfg))
    except ValueError:
        return 1
    return widest


class RowParallel:
    """The TP group's sums for one rank's model shard (``leaves``: see the module)."""

    def __init__(self, comm: ModelComm, leaves: int = 1) -> None:
        self.comm = comm
        self.leaves = leaves

    def invariant(self, x: torch.Tensor) -> bool:
        """Whether this call takes the width-invariant form."""
        return self.leaves > 1 and (x.device.type == "cpu" or batch_invariant_on())

    def project(self, x: torch.Tensor, weight: torch.Tensor,
                scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [T, K_local] @ weight [N, K_local].T`` summed over the TP group (FP8
        weights, ``scale``: the plain all-reduce; engine_config gives them width 1)."""
        if scale is not None or not self.invariant(x):
            return self.comm.all_reduce_tp(project(x, weight, None, scale))
        local = self.leaves // self.comm.tp_size
        if self.comm.tp_size == 1 and _on_gpu(x):  # the whole tree and its rounding: one launch
            from ..kernels.gpu.invariant_gemm import invariant_linear_triton

            return invariant_linear_triton(x, weight, leaves=local)
        total = _subtree(x, weight, local)
        if self.comm.tp_size > 1:
            gathered = self.comm.all_gather_tp(total[None].contiguous(), dim=0)
            total = pairwise_sum(list(gathered.unbind(0)))
        return total.to(x.dtype)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the TP group where each element is nonzero on one rank at
        most (exact at any width)."""
        return self.comm.all_reduce_tp(x)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, expert_map: Optional[torch.Tensor],
                scales: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """A TP group's MoE output (this rank's experts of ``expert_map``), summed over
        the group: per token its slots in slot order, the bits of one rank's
        :func:`~phalanx.kernels.moe.fused_experts` in the invariant form."""
        if self.comm.tp_size == 1 or not self.invariant(x):
            return self.comm.all_reduce_tp(fused_experts(x, weights, ids, w13, w2, expert_map, scales))
        pairs = fused_expert_pairs(x, weights, ids, w13, w2, expert_map, scales)
        return sum_slots(self.comm.all_reduce_tp(pairs), x.dtype)


def _on_gpu(x: torch.Tensor) -> bool:
    return x.device.type != "cpu" and use_triton(x)


def _subtree(x: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """``x @ weight.T`` in float32 as the tree of ``leaves`` equal chunks of x's K, each
    chunk's rows batch-invariant (GPU: the mode's GEMM sums the tree in one launch)."""
    if _on_gpu(x):
        from ..kernels.gpu.invariant_gemm import invariant_linear_triton

        return invariant_linear_triton(x, weight, leaves=leaves, out_dtype=torch.float32)
    if x.dtype != torch.float32:
        x, weight = x.float(), weight.float()
    width = x.shape[-1] // leaves
    return pairwise_sum([row_invariant_linear(x[:, i * width:(i + 1) * width].contiguous(),
                                              weight[:, i * width:(i + 1) * width].contiguous())
                         for i in range(leaves)])
