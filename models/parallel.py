"""How a model shard talks to its peers: the TP collectives and expert parallelism.

`ModelComm` is what the model needs from a tensor-parallel group (`comm.group_comm.GroupComm`
provides it; `LocalComm` is the single-rank identity). `ExpertParallel` carries the MoE
dispatcher of a DP×EP group and a hook run just before every dispatch (fault injection
names that point "moe_dispatch"); its `stages` are the MoE layer as a stage generator
(`models/stages.py`) for two-batch overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from .stages import Stages, run_to_end


class ModelComm(Protocol):
    tp_size: int
    tp_rank: int

    def all_reduce_tp(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_tp(self, t: torch.Tensor, dim: int) -> torch.Tensor: ...


class LocalComm:
    """One rank, no peers: every collective is the identity."""

    tp_size = 1
    tp_rank = 0

    def all_reduce_tp(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_tp(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t


@dataclass
class ExpertParallel:
    """The MoE dispatcher of a DP×EP group (`comm.dispatch.EPDispatcher`)."""

    dispatcher: Any
    before_dispatch: Optional[Callable[[str], None]] = None

    def moe(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return run_to_end(self.stages(x, weights, ids, compute))

    def stages(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> Stages[torch.Tensor]:
        """`moe` as a stage generator: while the dispatcher overlaps (two micro-batches)
        it yields with its dispatch and with its combine in flight; otherwise it runs the
        layer's exchanges at once (any of the dispatcher's paths) without yielding."""
        if self.before_dispatch is not None:
            self.before_dispatch("moe_dispatch")
        if not getattr(self.dispatcher, "overlap", False):
            return self.dispatcher.moe(x, weights, ids, compute)
        return (yield from self.dispatcher.moe_stages(x, weights, ids, compute))
