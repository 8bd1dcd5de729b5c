"""How a model shard talks to its peers: the TP collectives and expert parallelism.

`ModelComm` is what the model needs from a tensor-parallel group (`comm.group_comm.GroupComm`
provides it; `LocalComm` is the single-rank identity). `ExpertParallel` carries the MoE
dispatcher of a DP×EP group and a hook run just before every dispatch (fault injection
names that point "moe_dispatch").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch


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
        if self.before_dispatch is not None:
            self.before_dispatch("moe_dispatch")
        return self.dispatcher.moe(x, weights, ids, compute)
